"""Worker processes started before the pass that takes them (``_workers._standby``)."""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import os
import signal
import threading
import time
from typing import Any

import psutil
import pytest

import asyncload
from asyncload._workers import StandbySlot
from asyncload._workers import standby as standby_module
from asyncload._workers.reaper import reaper

from .._datasets import StoresBuilt, init_sets_aws_region
from .._procs import worker_processes

pytestmark = pytest.mark.usefixtures("no_leaks")


class Tagged(asyncload.Dataset[tuple[int, int, str]]):
    """Sample i is (i, the worker's pid, the dataset's tag when the pass started)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.tag = "first"
        self.extra: Any = None

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, index: int) -> tuple[int, int, str]:
        return index, os.getpid(), self.tag


def _epoch(loader: asyncload.DataLoader[Any]) -> list[tuple[int, int, str]]:
    return [(int(i), int(p), t) for batch in loader for i, p, t in zip(*batch, strict=True)]


def _new_workers(before: set[int], count: int, timeout: float = 10.0) -> set[int]:
    """The worker processes that appeared since *before*, once there are *count* of them."""
    deadline = time.monotonic() + timeout
    while True:
        new = {p.pid for p in worker_processes()} - before
        if len(new) >= count or time.monotonic() > deadline:
            return new
        time.sleep(0.02)


def test_the_next_pass_runs_on_processes_started_during_this_one() -> None:
    loader = asyncload.DataLoader(Tagged(64), batch_size=8, num_workers=2)
    before = {p.pid for p in worker_processes()}
    first = _epoch(loader)
    standby = _new_workers(before | {pid for _, pid, _ in first}, 2)
    assert len(standby) == 2, "no processes were started for the next pass"
    second = _epoch(loader)
    assert {pid for _, pid, _ in second} == standby
    assert sorted(i for i, _, _ in second) == list(range(64))


class SlowTagged(Tagged):
    async def __getitem__(self, index: int) -> tuple[int, int, str]:
        await asyncio.sleep(1.0)
        return index, os.getpid(), self.tag


def test_the_next_pass_processes_start_only_once_this_pass_has_a_batch() -> None:
    """A short pass sends its last task at iter(): starting the next pass's processes then
    would take the CPU its first requests need."""
    before = {p.pid for p in worker_processes()}
    loader = asyncload.DataLoader(SlowTagged(16), batch_size=8, num_workers=2)
    mine = _new_workers(before, 2)  # started when the loader was built; this pass takes them
    it = iter(loader)
    time.sleep(0.6)  # every task sent, no batch in yet
    assert {p.pid for p in worker_processes()} - before == mine, "next pass's started early"
    next(it)
    standby = _new_workers(before | mine, 2)
    assert len(standby) == 2, "no processes were started for the next pass"
    assert {int(p) for _, pids, _ in it for p in pids} <= mine
    assert {pid for _, pid, _ in _epoch(loader)} == standby


def test_a_long_pass_starts_the_next_passs_processes_when_its_last_task_goes_out() -> None:
    """A pass longer than its look-ahead sends its last task after batches came back: the
    next pass's processes start then, and that pass runs on them."""
    loader = asyncload.DataLoader(
        Tagged(1024), batch_size=8, num_workers=2, max_concurrency=8, prefetch_bytes=0
    )
    before = {p.pid for p in worker_processes()}
    mine = _new_workers(before, 2)  # started when the loader was built; this pass takes them
    it = iter(loader)
    next(it)
    time.sleep(0.3)
    assert {p.pid for p in worker_processes()} - before == mine, "started before the last task"
    assert {int(p) for _, pids, _ in it for p in pids} == mine
    standby = _new_workers(before | mine, 2)
    assert len(standby) == 2, "no processes were started for the next pass"
    second = _epoch(loader)
    assert {pid for _, pid, _ in second} == standby
    assert sorted(i for i, _, _ in second) == list(range(1024))


def test_what_changed_in_the_dataset_between_epochs_reaches_the_workers() -> None:
    """The config (with the dataset) is still pickled at iter(), as torch does."""
    dataset = Tagged(32)
    loader = asyncload.DataLoader(dataset, batch_size=8, num_workers=2)
    assert {t for _, _, t in _epoch(loader)} == {"first"}
    dataset.tag = "second"
    assert {t for _, _, t in _epoch(loader)} == {"second"}


def test_dropping_the_loader_stops_its_standby_processes() -> None:
    before = {p.pid for p in worker_processes()}
    loader = asyncload.DataLoader(Tagged(32), batch_size=8, num_workers=2)
    pids = {pid for _, pid, _ in _epoch(loader)}
    standby = _new_workers(before | pids, 2)
    assert len(standby) == 2
    del loader
    gc.collect()
    # The finalizer hands the stop to the reaper and returns (NOTE [ Who stops workers ]).
    alive = _gone(standby)
    assert not alive, f"standby processes left running: {alive}"


def test_a_standby_process_that_died_is_replaced() -> None:
    loader = asyncload.DataLoader(Tagged(32), batch_size=8, num_workers=2)
    before = {p.pid for p in worker_processes()}
    pids = {pid for _, pid, _ in _epoch(loader)}
    standby = _new_workers(before | pids, 2)
    victim = min(standby)
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while psutil.pid_exists(victim) and time.monotonic() < deadline:
        time.sleep(0.02)  # reaped (one that dies after iter() took it fails the pass)
    second = _epoch(loader)
    assert sorted(i for i, _, _ in second) == list(range(32))
    assert victim not in {pid for _, pid, _ in second}


def test_a_dataset_that_stopped_pickling_is_named_and_nothing_is_left() -> None:
    dataset = Tagged(32)
    loader = asyncload.DataLoader(dataset, batch_size=8, num_workers=2)
    _epoch(loader)
    dataset.extra = lambda: None  # can't be pickled for the next pass's workers
    with (
        pytest.warns(UserWarning, match="pickle error"),
        pytest.raises(asyncload.NotPicklable, match="extra"),
    ):
        _epoch(loader)


def test_the_first_pass_runs_on_processes_started_when_the_loader_was_built() -> None:
    for kw in ({}, {"persistent_workers": True}):
        before = {p.pid for p in worker_processes()}
        loader = asyncload.DataLoader(Tagged(32), batch_size=8, num_workers=2, **kw)
        early = _new_workers(before, 2)  # before any iter()
        assert len(early) == 2, kw
        assert {pid for _, pid, _ in _epoch(loader)} == early, kw
        # The next round counts new processes: the next pass's, which this loader may still be
        # starting in the background, must have started and stopped before it looks.
        slot = loader._standby
        assert slot is not None
        del loader
        gc.collect()
        slot.close(wait=True)
        deadline = time.monotonic() + 10
        while {p.pid for p in worker_processes()} - before and time.monotonic() < deadline:
            time.sleep(0.02)


def test_persistent_workers_and_fork_start_no_standby_after_the_first_pass() -> None:
    for kw in ({"persistent_workers": True}, {"multiprocessing_context": "fork"}):
        before = {p.pid for p in worker_processes()}
        loader = asyncload.DataLoader(Tagged(32), batch_size=8, num_workers=2, **kw)
        it = iter(loader)
        pids = {int(p) for _, batch_pids, _ in it for p in batch_pids}
        time.sleep(0.3)  # a standby would have been started by now
        extra = {p.pid for p in worker_processes()} - before - pids
        assert not extra, (kw, extra)
        del it, loader
        gc.collect()


def _gone(pids: set[int], timeout: float = 10.0) -> set[int]:
    """Those of *pids* still running after up to *timeout* seconds."""
    deadline = time.monotonic() + timeout
    while True:
        alive = {p.pid for p in worker_processes()} & pids
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.02)


def test_a_loader_dropped_before_iterating_stops_the_processes_it_started() -> None:
    before = {p.pid for p in worker_processes()}
    loader = asyncload.DataLoader(Tagged(32), batch_size=8, num_workers=2)
    early = _new_workers(before, 2)
    assert len(early) == 2
    del loader
    gc.collect()
    assert not _gone(early)


def test_a_slot_closed_while_starting_stops_what_it_started() -> None:
    forkserver = multiprocessing.get_context("forkserver")
    before = {p.pid for p in worker_processes()}
    slot = StandbySlot()
    slot.prepare(forkserver, 2)
    starting = slot._thread
    slot.close()  # a loader collected at once: no wait, the start stops what it started
    assert starting is not None
    starting.join(10)
    assert not _gone({p.pid for p in worker_processes()} - before)
    slot = StandbySlot()
    slot.prepare(forkserver, 2)
    slot.close(wait=True)  # at exit: waits for the start, then stops both
    assert not ({p.pid for p in worker_processes()} - before)
    slot.prepare(multiprocessing.get_context("forkserver"), 2)  # closed: starts nothing
    assert slot.take(multiprocessing.get_context("forkserver"), 2) is None


def test_a_ctrl_c_inside_the_start_of_the_standby_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Thread.start() waits for the new thread to begin; a KeyboardInterrupt there leaves a
    thread that begins a moment later. A program that goes on (a notebook's cell run again)
    takes its set as usual, and the exit waits for it and stops what it started, rather than
    tearing down the interpreter under a start that makes semaphores and processes."""
    forkserver = multiprocessing.get_context("forkserver")
    real_start = threading.Thread.start
    cut: list[threading.Thread] = []

    def start_then_ctrl_c(thread: threading.Thread) -> None:
        if thread.name != "asyncload-standby":
            real_start(thread)
            return
        cut.append(thread)
        later = threading.Timer(0.1, real_start, args=(thread,))
        later.daemon = True
        later.start()
        raise KeyboardInterrupt

    before = {p.pid for p in worker_processes()}
    monkeypatch.setattr(threading.Thread, "start", start_then_ctrl_c)
    slot = StandbySlot()
    with pytest.raises(KeyboardInterrupt):
        slot.prepare(forkserver, 2)
    standby = slot.take(forkserver, 2)  # join() raised here: the thread had not begun
    assert standby is not None
    assert len(standby.procs) == 2
    standby.close()
    with pytest.raises(KeyboardInterrupt):
        slot.prepare(forkserver, 2)
    assert cut[-1] in standby_module._starting, "the exit would not wait for this start"
    slot.close(wait=True)  # as at exit: waits for the start, then stops what it started
    assert not cut[-1].is_alive()
    assert not ({p.pid for p in worker_processes()} - before)


def test_a_ctrl_c_before_the_standby_thread_exists_costs_a_moment_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A KeyboardInterrupt inside start() before its OS thread was made: a thread that never
    begins. The next pass waits a moment for it (the two look alike), then forgets it, and
    the exit does not wait for it again."""
    forkserver = multiprocessing.get_context("forkserver")
    cut: list[threading.Thread] = []

    def ctrl_c_first(thread: threading.Thread) -> None:
        cut.append(thread)
        raise KeyboardInterrupt

    monkeypatch.setattr(threading.Thread, "start", ctrl_c_first)
    slot = StandbySlot()
    with pytest.raises(KeyboardInterrupt):
        slot.prepare(forkserver, 2)
    monkeypatch.undo()
    t0 = time.monotonic()
    assert slot.take(forkserver, 2) is None
    assert time.monotonic() - t0 < standby_module._BEGIN_GRACE + 1
    assert cut[0] not in standby_module._starting
    slot.close()


@pytest.mark.usefixtures("clean_storage")
def test_standby_processes_build_the_configured_stores_before_their_pass() -> None:
    pytest.importorskip("obstore", reason="obstore (asyncload-torch[s3]) is not installed")
    # Nothing listens there: building a store connects to nothing.
    asyncload.configure("s3://asyncload-standby", endpoint="http://127.0.0.1:9", region="r")
    loader = asyncload.DataLoader(StoresBuilt(), batch_size=None, num_workers=1)
    for _ in range(2):  # processes started when the loader was built, then by the first pass
        # Built before the first sample, and the one a read of the bucket uses.
        assert [tuple(t) for t in loader] == [(1, 1), (1, 1)]
    del loader
    gc.collect()
    # A worker_init_fn that changes the environment: the store is built again, after it.
    loader = asyncload.DataLoader(
        StoresBuilt(), batch_size=None, num_workers=1, worker_init_fn=init_sets_aws_region
    )
    assert [tuple(t) for t in loader] == [(0, 1), (1, 1)]


def test_a_standby_of_another_shape_is_not_used() -> None:
    slot = StandbySlot()
    forkserver = multiprocessing.get_context("forkserver")
    slot.prepare(forkserver, 2)
    assert slot.take(forkserver, 3) is None  # stopped, not handed out
    slot.prepare(forkserver, 2)
    standby = slot.take(forkserver, 2)
    assert standby is not None
    assert len(standby.procs) == 2
    assert all(p.is_alive() for p in standby.procs)
    standby.close()
    assert not any(p.is_alive() for p in standby.procs)


@pytest.mark.usefixtures("clean_storage")
def test_standby_processes_build_stores_under_the_environment_the_main_process_has_now(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("obstore", reason="obstore (asyncload-torch[s3]) is not installed")
    asyncload.configure("s3://asyncload-standby", endpoint="http://127.0.0.1:9", region="r")
    first = asyncload.DataLoader(StoresBuilt(), batch_size=None, num_workers=1)
    assert len(list(first)) == 2  # the workers' server runs, with the environment of now
    del first
    gc.collect()
    # Set after the server started: its children have the old environment until their pass
    # gives them the main process's. Stores a standby built under the old one would be
    # dropped then (they read AWS_*), and built again in front of the first sample.
    monkeypatch.setenv("AWS_REGION", "set-after-the-server-started")
    loader = asyncload.DataLoader(StoresBuilt(), batch_size=None, num_workers=1)
    assert [tuple(t) for t in loader] == [(1, 1), (1, 1)]


class _NoSemaphores:
    """A start method whose every queue and event fails (no /dev/shm left, say)."""

    def get_start_method(self) -> str:
        return "forkserver"

    def Event(self) -> Any:
        raise OSError(28, "No space left on device")


def test_a_standby_set_that_fails_to_start_is_not_tried_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ASYNCLOAD_MAX_STANDBY", "64")  # room, whatever earlier tests left stopping
    broken = _NoSemaphores()
    slot = StandbySlot()
    slot.prepare(broken, 2)
    deadline = time.monotonic() + 10
    while slot.held and time.monotonic() < deadline:  # the start fails in its thread
        time.sleep(0.01)
    assert not slot.held
    assert slot._off
    slot.prepare(broken, 2)  # off for this loader: no start, no loop of failures
    assert slot._thread is None
    # Nothing half-built is held by the reaper (it owns what has processes).
    assert not [o for o in list(reaper._owned) if getattr(o, "context", None) is broken]
    slot.close()
