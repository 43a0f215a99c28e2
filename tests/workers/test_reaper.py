"""Who stops workers (NOTE [ Who stops workers ] in ``_workers/_reaper.py``): finalizers never
block, standby processes are bounded and reclaimed, loaders built and dropped by the hundred
leave nothing behind (issue 29, items 1, 2 and 5)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from asyncload._workers import reaper as _reaper
from asyncload._workers.reaper import Reaper, StandbyBudget

from .._procs import run_script, script_env

BENCH_CHURN = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_churn.py"


class _Holder:
    def __init__(self, name: str, evicted: list[str]) -> None:
        self.name = name
        self.evicted = evicted

    def evict(self) -> None:
        self.evicted.append(self.name)


def test_a_new_set_pushes_out_the_oldest_within_the_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ASYNCLOAD_MAX_STANDBY", "6")
    evicted: list[str] = []
    budget = StandbyBudget()
    a, b, c = (_Holder(n, evicted) for n in "abc")
    assert budget.admit(a, 2)
    assert budget.admit(b, 4)
    assert budget.alive() == 6
    assert budget.admit(c, 2)  # a is the oldest: it makes room
    assert evicted == ["a"]
    assert budget.alive() == 6
    big = _Holder("big", evicted)
    assert budget.admit(big, 8)  # larger than the bound: alone
    assert evicted == ["a", "b", "c"]
    assert budget.alive() == 8


def test_sets_on_their_way_out_count_until_they_have_stopped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ASYNCLOAD_MAX_STANDBY", "4")
    evicted: list[str] = []
    budget = StandbyBudget()
    retired = object()
    budget.stopping(retired, 4)  # pushed out, its stop still queued behind the reaper
    assert not budget.admit(_Holder("a", evicted), 2)  # no room: the pass starts its own
    budget.stopped(retired)
    assert budget.admit(_Holder("a", evicted), 2)
    assert budget.alive() == 2


def test_idle_sets_are_reclaimed_and_zero_turns_standby_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    evicted: list[str] = []
    budget = StandbyBudget()
    monkeypatch.setenv("ASYNCLOAD_STANDBY_IDLE", "0.05")
    assert budget.admit(_Holder("a", evicted), 2)
    budget.reclaim_idle()
    assert evicted == []
    time.sleep(0.1)
    budget.reclaim_idle()
    assert evicted == ["a"]
    assert budget.alive() == 0
    monkeypatch.setenv("ASYNCLOAD_MAX_STANDBY", "0")
    assert not budget.admit(_Holder("b", evicted), 2)


def test_bad_settings_say_what_to_give(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCLOAD_MAX_STANDBY", "many")
    with pytest.raises(ValueError, match="ASYNCLOAD_MAX_STANDBY='many' is not a whole number"):
        _reaper.max_standby_processes()
    monkeypatch.setenv("ASYNCLOAD_STANDBY_IDLE", "soon")
    with pytest.raises(ValueError, match="ASYNCLOAD_STANDBY_IDLE='soon' is not a number"):
        _reaper.standby_idle_s()


def test_a_submit_never_blocks_and_a_waiting_one_returns_once_its_job_ran(
    capsys: pytest.CaptureFixture[str],
) -> None:
    reaper = Reaper()
    reaper.ensure_started()
    gate = threading.Event()
    ran: list[str] = []
    reaper.submit(lambda: gate.wait(10))  # the reaper is busy
    t0 = time.monotonic()
    reaper.submit(lambda: ran.append("queued"))  # what a finalizer does
    assert time.monotonic() - t0 < 0.1
    assert ran == []
    gate.set()
    reaper.submit(lambda: ran.append("waited"), wait=True)
    assert ran == ["queued", "waited"]

    def fails() -> None:
        raise OSError("a queue was closed twice")

    reaper.submit(fails)  # reported, and the reaper goes on
    assert reaper.drain(10)
    reaper.submit(lambda: ran.append("after"), wait=True)
    assert ran[-1] == "after"
    err = capsys.readouterr().err
    assert "stopping DataLoader workers failed" in err
    assert "a queue was closed twice" in err


@pytest.mark.slow
@pytest.mark.timeout(180)
class _SlowToBegin:
    """A job lock that the reaper's thread takes 0.3 s after asking: the moment between taking
    a job from the queue and beginning it, stretched."""

    def __init__(self, owner: Reaper) -> None:
        self.owner = owner
        self.lock = owner._job_lock

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self.lock.acquire(blocking, timeout)

    def release(self) -> None:
        self.lock.release()

    def __enter__(self) -> _SlowToBegin:
        if self.owner.on_reaper_thread():
            time.sleep(0.3)
        self.lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


@pytest.mark.timeout(30)
def test_at_exit_the_job_the_thread_has_taken_ends_before_the_drain_returns() -> None:
    # multiprocessing's exit handler joins the children right after this drain: a stop job
    # still running then closes the Process objects it joins ("process object is closed").
    owner = Reaper()
    owner.ensure_started()
    owner._job_lock = _SlowToBegin(owner)  # type: ignore[assignment]
    ran: list[bool] = []
    owner.submit(lambda: ran.append(True))
    deadline = time.monotonic() + 5
    while not owner._queue.empty() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert owner._queue.empty()  # taken by the thread, not begun

    _reaper._drain_at_exit(owner)
    assert ran == [True]
    assert owner._thread is not None
    assert not owner._thread.is_alive()


def test_finalizers_on_other_threads_never_block_while_another_pass_iterates() -> None:
    """A collection on another thread runs dropped passes' finalizers (a num_workers=0 pass
    dropped mid-epoch, now and then one with processes and its loader): they hand the stop to
    the reaper and return. At e28034f one joined the loop thread there (5.8 s)."""
    out: dict[str, Any] = run_script("finalizers.py", "200", timeout=170)
    assert out["rounds"] == out["batches"] == 200
    assert out["slowest"] < 2.0, out


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_hundreds_of_loaders_built_and_dropped_leave_nothing_and_stay_bounded(
    tmp_path: Path,
) -> None:
    """Never iterated, one batch, a whole epoch, an exception out of the loop; persistent or
    not; 2 or 4 workers; half in reference cycles (issue 29: 883 idle processes piled up).
    ``benchmarks/bench_churn.py`` runs the same with thousands of loaders and busy cores."""
    result = tmp_path / "churn.json"
    done = subprocess.run(
        [
            sys.executable,
            str(BENCH_CHURN),
            "--loaders",
            "160",
            "--hogs",
            "0",
            "--json",
            str(result),
        ],
        capture_output=True,
        text=True,
        timeout=170,
        env=script_env(),
        check=False,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(result.read_text())
    base, peak, after = out["base"], out["peak"], out["after"]
    assert out["tracebacks"] == 0, out["stderr_tail"]
    cap = _reaper.max_standby_processes()
    # A pass's workers (at most 4), standby sets (the bound), and passes in reference cycles
    # that the next collection stops: bounded by the churn's shape, not by its length.
    assert peak["processes"] <= cap + 4 * 4, out
    assert peak["threads"] <= base["threads"] + 12, out
    assert after["processes"] == base["processes"], out
    assert after["threads"] == base["threads"], out
    assert after["fds"] <= base["fds"] + 2, out
    assert after["shm"] <= base["shm"], (out["shm_left"], out)
    assert after["rss_mib"] - base["rss_mib"] < 64, out
