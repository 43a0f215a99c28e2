"""Whether a worker's own CPU bounds it (``_engine/cpu_load.py``): its loop's thread, its lane.

The wall clock is passed in, so the measures do not depend on how busy the test machine is;
the CPU each one reads is really spent on this thread (or told by a lane).
"""

from __future__ import annotations

import time

import pytest

from asyncload._dataset import cpu as _cpu
from asyncload._engine.cpu_load import CpuLoad

pytestmark = pytest.mark.timeout(30)


def _spin(seconds: float) -> None:
    """Spend *seconds* of this thread's CPU."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_busy_loop_thread_reads_as_bound_and_an_idle_one_as_free() -> None:
    load = CpuLoad()
    assert load.sample(0.0) is None  # the clocks start
    _spin(0.05)
    assert load.sample(0.05) is None  # under EVERY: nothing new
    assert load.sample(0.1) is True  # 0.05 s of CPU in 0.1 s: over BUSY
    assert load.sample(10.0) is False  # ten seconds with next to no CPU: under IDLE


def test_between_the_two_lines_the_last_reading_holds() -> None:
    load = CpuLoad()
    load.sample(0.0)
    _spin(0.05)
    assert load.sample(0.1) is True
    _spin(0.032)  # 0.32 of 0.1 s: under BUSY, over IDLE
    assert load.sample(0.2) is True
    assert load.sample(8.0) is False
    _spin(0.04)  # 0.32 of 0.125 s
    assert load.sample(8.125) is False


def test_a_busy_lane_reads_as_bound_per_thread() -> None:
    lane = _cpu.CpuLane(2)
    try:
        with _cpu.using(lane):
            load = CpuLoad()
            load.sample(0.0)
            lane.busy_s += 0.06  # its two threads used 0.3 of 0.1 s each: not bound
            assert load.sample(0.1) is False
            lane.busy_s += 0.1  # 0.5 each
            assert load.sample(0.2) is True
    finally:
        lane.shutdown()


def test_the_bound_seconds_count_only_the_measures_that_read_as_bound() -> None:
    # loader.stats().cpu_bound_s sums these: the wall time of each measure read as bound.
    load = CpuLoad()
    load.sample(0.0)
    _spin(0.05)
    assert load.sample(0.1) is True
    assert load.bound_s == pytest.approx(0.1)
    _spin(0.032)  # between the lines: still bound, and counted
    assert load.sample(0.2) is True
    assert load.bound_s == pytest.approx(0.2)
    assert load.sample(8.0) is False  # 7.8 idle seconds: not counted
    assert load.bound_s == pytest.approx(0.2)
