"""Whether a worker's own CPU bounds it (``_engine/cpu_load.py``): its loop's thread, its lane.

The lines' tests pass the wall clock in and read the thread's CPU time (``THREAD_TIME``), so
they do not depend on how busy the test machine is; the CPU each one reads is really spent on
this thread (or told by a lane). The run-queue meter (``SCHEDSTAT``) is tested on a core that
the test makes busy itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from asyncload._dataset import cpu as _cpu
from asyncload._engine.cpu_load import SCHEDSTAT, THREAD_TIME, CpuLoad, Meter, best_meter

pytestmark = pytest.mark.timeout(30)


def _spin(seconds: float) -> None:
    """Spend *seconds* of this thread's CPU."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_busy_loop_thread_reads_as_bound_and_an_idle_one_as_free() -> None:
    load = CpuLoad(THREAD_TIME)
    assert load.sample(0.0) is None  # the clocks start
    _spin(0.05)
    assert load.sample(0.05) is None  # under EVERY: nothing new
    assert load.sample(0.1) is True  # 0.05 s of CPU in 0.1 s: over THREAD_TIME.busy
    assert load.sample(10.0) is False  # ten seconds with next to no CPU: under .idle


def test_between_the_two_lines_the_last_reading_holds() -> None:
    load = CpuLoad(THREAD_TIME)
    load.sample(0.0)
    _spin(0.05)
    assert load.sample(0.1) is True
    _spin(0.032)  # 0.32 of 0.1 s: under busy, over idle
    assert load.sample(0.2) is True
    assert load.sample(8.0) is False
    _spin(0.04)  # 0.32 of 0.125 s
    assert load.sample(8.125) is False


def test_a_busy_lane_reads_as_bound_per_thread() -> None:
    lane = _cpu.CpuLane(2)
    try:
        with _cpu.using(lane):
            load = CpuLoad(THREAD_TIME)
            load.sample(0.0)
            lane.busy_s += 0.06  # its two threads used 0.3 of 0.1 s each: not bound
            assert load.sample(0.1) is False
            lane.busy_s += 0.1  # 0.5 each
            assert load.sample(0.2) is True
    finally:
        lane.shutdown()


def test_the_bound_seconds_count_only_the_measures_that_read_as_bound() -> None:
    # loader.stats().cpu_bound_s sums these: the wall time of each measure read as bound.
    load = CpuLoad(THREAD_TIME)
    load.sample(0.0)
    _spin(0.05)
    assert load.sample(0.1) is True
    assert load.bound_s == pytest.approx(0.1)
    _spin(0.032)  # between the lines: still bound, and counted
    assert load.sample(0.2) is True
    assert load.bound_s == pytest.approx(0.2)
    assert load.sample(8.0) is False  # 7.8 idle seconds: not counted
    assert load.bound_s == pytest.approx(0.2)


# ── the run-queue meter ───────────────────────────────────────────────────────────────────────


def _schedstat_reads() -> bool:
    try:
        return SCHEDSTAT.read() > 0
    except (OSError, ValueError):  # missing, or empty (some containers)
        return False


needs_schedstat = pytest.mark.skipif(
    not _schedstat_reads(), reason="no /proc/thread-self/schedstat figures here"
)


def test_the_meter_is_the_run_queue_one_where_it_can_be_read() -> None:
    assert (best_meter() is SCHEDSTAT) == _schedstat_reads()


def test_a_meter_that_fails_gives_way_to_the_threads_cpu_time() -> None:
    # A file that can no longer be opened (a worker out of descriptors) must not fail a fetch.
    def gone() -> float:
        raise OSError(24, "Too many open files")

    load = CpuLoad(Meter("gone", gone, busy=0.85, idle=0.7))
    assert load.sample(0.0) is None
    assert load.meter is THREAD_TIME
    _spin(0.05)
    assert load.sample(0.1) is True  # measured on the thread's CPU time from the start


def test_a_sample_from_another_thread_says_nothing() -> None:
    # A sync __getitem__'s retry may give its slot back from read_sync's loop thread.
    clock = [0.0]
    load = CpuLoad(Meter("fake", lambda: clock[0], busy=0.85, idle=0.7))
    load.sample(0.0)
    clock[0] = 0.9
    seen: list[bool | None] = []
    t = threading.Thread(target=lambda: seen.append(load.sample(1.0)))
    t.start()
    t.join(5)
    assert seen == [None]
    assert load.sample(1.0) is True  # the loop's thread: measured as it was


def _on_a_shared_core(seconds: float) -> dict[str, float]:
    """Spin *seconds* of wall time in a thread pinned to one core that two other processes
    spin on too: (its SCHEDSTAT and THREAD_TIME seconds, and what ``CpuLoad`` read) over that
    wall time."""
    core = min(os.sched_getaffinity(0))
    spin = f"import os, time\nos.sched_setaffinity(0, {{{core}}})\nprint(flush=True)\n"
    spin += "end = time.time() + 20\nwhile time.time() < end:\n    pass\n"
    out: dict[str, float] = {}

    def measure() -> None:
        os.sched_setaffinity(0, {core})  # this thread only
        load = CpuLoad(SCHEDSTAT)
        time.sleep(0.1)
        t0, s0, c0 = time.monotonic(), SCHEDSTAT.read(), time.thread_time()
        load.sample(t0)
        while time.monotonic() - t0 < seconds:
            pass
        t1 = time.monotonic()
        out["bound"] = float(bool(load.sample(t1)))
        out["sched"] = (SCHEDSTAT.read() - s0) / (t1 - t0)
        out["cpu"] = (time.thread_time() - c0) / (t1 - t0)

    hogs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(2):
            hogs.append(subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE))
        for hog in hogs:  # pinned and spinning (a loaded machine starts an interpreter slowly)
            assert hog.stdout is not None
            hog.stdout.readline()
        t = threading.Thread(target=measure)
        t.start()
        t.join(15)
    finally:
        for hog in hogs:
            hog.kill()
            hog.communicate(timeout=10)
    return out


@needs_schedstat
def test_a_loop_waiting_for_a_core_reads_as_bound_though_it_runs_a_third_of_the_time() -> None:
    # Three spinners on one core: each runs about a third of the time and waits the rest. Its
    # CPU time alone reads like a loop idle in its poll two thirds of the time (cpu_load.py).
    got = _on_a_shared_core(0.5)
    assert got["cpu"] < 0.6, got
    assert got["sched"] >= 0.9, got
    assert got["bound"] == 1.0, got


@needs_schedstat
def test_a_sleeping_loop_reads_as_free_on_the_run_queue_meter() -> None:
    load = CpuLoad(SCHEDSTAT)
    t0 = time.monotonic()
    load.sample(t0)
    time.sleep(0.2)
    assert load.sample(time.monotonic()) is False


def test_a_meter_reads_as_it_did_between_its_lines() -> None:
    clock = [0.0]
    load = CpuLoad(Meter("fake", lambda: clock[0], busy=0.85, idle=0.7))
    load.sample(0.0)
    clock[0] = 0.9  # 0.9 of a second
    assert load.sample(1.0) is True
    clock[0] += 0.75  # between the lines
    assert load.sample(2.0) is True
    clock[0] += 0.6  # under idle: free
    assert load.sample(3.0) is False
    clock[0] += 0.8  # under busy: still free
    assert load.sample(4.0) is False
