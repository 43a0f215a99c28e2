"""The engine on its own: an asyncio queue as its inbox, a list as its output, no processes.

Datasets here sleep for seeded random times, so samples complete out of order as they would
against a real server.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import random
import sys
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

import asyncload
from asyncload._engine import Engine, WorkerConfig
from asyncload._engine import _map as _engine_map
from asyncload._protocol.messages import (
    Exhausted,
    Failure,
    IndexTask,
    IterTask,
    PassStarted,
    Result,
    Shutdown,
    StartPass,
)
from asyncload._stats import recorder as _metrics

from .._datasets import worker_config


class Jittery(asyncload.Dataset[int]):
    """Index *i* returns *i* after a seeded random sleep; counts the fetches in flight."""

    def __init__(self, n: int, *, seed: int = 0, bad: tuple[int, ...] = ()) -> None:
        self.n, self.bad = n, bad
        self.delays = [random.Random(seed + i).uniform(0.0, 0.02) for i in range(n)]
        self.in_flight = self.peak = 0

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, index: int) -> int:
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            await asyncio.sleep(self.delays[index])
            if index in self.bad:
                raise ValueError(f"sample {index} is bad")
            return index
        finally:
            self.in_flight -= 1


class Counting(asyncload.IterableDataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    async def __aiter__(self) -> AsyncIterator[int]:
        for i in range(self.n):
            await asyncio.sleep(0)
            yield i


def _config(dataset: Any, *, iterable: bool = False, max_concurrency: int = 4) -> WorkerConfig:
    return worker_config(dataset, is_iterable=iterable, max_concurrency=max_concurrency)


async def _run(
    cfg: WorkerConfig, messages: list[object], settle: float = 0.0, replies: int | None = None
) -> list[Any]:
    """Feed *messages* to a new engine, then Shutdown once every task (or *replies* of them)
    has its reply."""
    out: list[Any] = []
    engine = Engine(cfg, out.append, "in a test engine")
    inbox: asyncio.Queue[object] = asyncio.Queue()
    runner = asyncio.ensure_future(engine.run(inbox))
    tasks = (
        sum(isinstance(m, IndexTask | IterTask) for m in messages) if replies is None else replies
    )
    for m in messages:
        inbox.put_nowait(m)
        await asyncio.sleep(settle)
    for _ in range(500):  # bounded: at most ~5 s
        if sum(not isinstance(r, PassStarted) for r in out) >= tasks:
            break
        await asyncio.sleep(0.01)
    inbox.put_nowait(Shutdown())
    await asyncio.wait_for(runner, 5)
    return out


def test_every_task_gets_one_reply_with_bounded_concurrency() -> None:
    ds = Jittery(30, seed=1)
    # Batch 0 is slow (1 s a sample, the others 20 ms at most): a fourth slot carries later
    # batches past it unless the loop stalls for most of a second (seeded jitter alone once
    # completed in send order under heavy load).
    ds.delays[:3] = [1.0] * 3
    tasks = [IndexTask(k, 0, np.arange(3 * k, 3 * k + 3)) for k in range(10)]
    out = asyncio.run(_run(_config(ds, max_concurrency=4), list(tasks)))
    assert sorted(r.send_idx for r in out) == list(range(10))
    assert all(isinstance(r, Result) for r in out)
    assert {r.send_idx: r.data for r in out} == {
        k: [3 * k, 3 * k + 1, 3 * k + 2] for k in range(10)
    }
    assert ds.peak == 4  # the slots were all used, never more
    # Completion order follows the latencies, not the send order.
    assert out[0].send_idx != 0


def test_a_failing_sample_fails_its_batch_only() -> None:
    ds = Jittery(9, seed=2, bad=(4,))
    tasks = [IndexTask(k, 0, [3 * k, 3 * k + 1, 3 * k + 2]) for k in range(3)]
    out = asyncio.run(_run(_config(ds), list(tasks)))
    by_idx = {r.send_idx: r for r in out}
    assert isinstance(by_idx[1], Failure)
    assert "while fetching sample 4" in by_idx[1].error.where
    assert isinstance(by_idx[1].error.exception(), ValueError)
    assert by_idx[0].data == [0, 1, 2]
    assert by_idx[2].data == [6, 7, 8]


def test_start_pass_drops_the_old_pass_and_acknowledges() -> None:
    ds = Jittery(30, seed=3)
    ds.delays = [0.5] * 30  # the old pass's fetches are still running when StartPass arrives
    messages: list[object] = [
        IndexTask(0, 0, [0, 1, 2]),
        StartPass(1, epoch=None, shared_seed=None),
        IndexTask(0, 0, [3, 4, 5]),  # an old generation's task, arriving late: ignored
        IndexTask(0, 1, [6, 7, 8]),
    ]
    out = asyncio.run(_run(_config(ds), messages, settle=0.01))
    assert out[0] == PassStarted(1, 0)
    results = [r for r in out[1:] if isinstance(r, Result)]
    assert [(r.generation, r.data) for r in results] == [(1, [6, 7, 8])]


def test_iterable_batches_then_exhausted() -> None:
    cfg = _config(Counting(7), iterable=True)
    out = asyncio.run(_run(cfg, [IterTask(k, 0) for k in range(4)], settle=0.01))
    assert [type(r) for r in out] == [Result, Result, Result, Exhausted]
    assert [r.data for r in out[:3]] == [[0, 1, 2], [3, 4, 5], [6]]


@pytest.mark.parametrize("bad", [0, 2])
def test_sample_errors_name_the_sample(bad: int) -> None:
    out = asyncio.run(_run(_config(Jittery(3, bad=(bad,))), [IndexTask(0, 0, [0, 1, 2])]))
    (failure,) = out
    assert isinstance(failure, Failure)
    assert f"sample {bad}" in failure.error.where


# ── counters: each engine its own (no process-wide stats written by several layers) ──────────


class _Noting(asyncload.Dataset[int]):
    """Notes 10 bytes per sample, as the storage layer does for what it reads."""

    def __len__(self) -> int:
        return 100

    async def __getitem__(self, index: int) -> int:
        await asyncio.sleep(0)
        _metrics.note_bytes(10)
        return index


def test_notes_made_by_an_engines_fetches_count_for_that_engine_only() -> None:
    before = _metrics.recorder.bytes
    out: list[Any] = []

    async def main() -> _metrics.Recorder:
        engine = Engine(_config(_Noting()), out.append, "in a test engine")
        inbox: asyncio.Queue[object] = asyncio.Queue()
        for k in range(4):
            inbox.put_nowait(IndexTask(k, 0, [3 * k, 3 * k + 1, 3 * k + 2]))
        runner = asyncio.ensure_future(engine.run(inbox))
        for _ in range(500):
            if len(out) == 4:
                break
            await asyncio.sleep(0.01)
        _metrics.note_bytes(1)  # the application's own read, outside the engine
        inbox.put_nowait(Shutdown())
        await asyncio.wait_for(runner, 5)
        return engine.recorder

    rec = asyncio.run(main())
    assert rec.bytes == 12 * 10
    assert rec.samples == 12
    assert _metrics.recorder.bytes == before + 1


# ── awaitables an iterable dataset yields: each one awaited or closed, never dropped ──────────


class _Lazy(asyncload.IterableDataset[int]):
    """Yields unawaited coroutines (as ``Mix`` does for a map-style source); keeps them all."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.made: list[Any] = []

    async def _fetch(self, i: int) -> int:
        await asyncio.sleep(0.05)
        return i

    async def __aiter__(self) -> AsyncIterator[Any]:
        for i in range(self.n):
            coro = self._fetch(i)
            self.made.append(coro)
            yield coro


@pytest.mark.parametrize("settle", [0.0, 0.01])
def test_a_shutdown_closes_every_awaitable_it_did_not_await(settle: float) -> None:
    # Two slots: the pump holds a third coroutine while it waits for one, and the tasks it
    # started may not have run yet when the shutdown comes; none may go unawaited.
    ds = _Lazy(20)

    async def main() -> None:
        engine = Engine(_config(ds, iterable=True, max_concurrency=2), [].append, "in a test")
        inbox: asyncio.Queue[object] = asyncio.Queue()
        runner = asyncio.ensure_future(engine.run(inbox))
        inbox.put_nowait(IterTask(0, 0))
        await asyncio.sleep(settle)
        inbox.put_nowait(Shutdown())
        await asyncio.wait_for(runner, 5)

    asyncio.run(main())
    states = [inspect.getcoroutinestate(c) for c in ds.made]
    for c in ds.made:
        c.close()
    assert len(states) >= 3
    assert set(states) == {inspect.CORO_CLOSED}


def test_a_new_pass_leaves_no_fetch_of_the_old_one_running() -> None:
    # Fetches end every few ms, so a slot often frees in the same loop turn as StartPass: the
    # pump must not start a fetch then that the engine no longer tracks.
    class Quick(_Lazy):
        async def _fetch(self, i: int) -> int:
            await asyncio.sleep(0.001 * (i % 3))
            return i

    async def main() -> list[int]:
        seen = []
        for k in range(40):
            out: list[Any] = []
            cfg = _config(Quick(10_000), iterable=True, max_concurrency=2)
            engine = Engine(cfg, out.append, "in a test")
            inbox: asyncio.Queue[object] = asyncio.Queue()
            runner = asyncio.ensure_future(engine.run(inbox))
            inbox.put_nowait(IterTask(0, 0))
            await asyncio.sleep(0.0005 * k)
            inbox.put_nowait(StartPass(1, epoch=None, shared_seed=None))
            for _ in range(200):  # bounded: the new pass is acknowledged within ~2 s
                if PassStarted(1, 0) in out:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.01)  # a stray fetch of the old pass would have ended by now
            seen.append(engine.recorder.in_flight)  # -1: it counted itself out of the new pass
            inbox.put_nowait(Shutdown())
            await asyncio.wait_for(runner, 5)
        return seen

    assert set(asyncio.run(main())) == {0}


def test_a_shutdown_cancels_every_future_it_did_not_await() -> None:
    class Futures(asyncload.IterableDataset[Any]):
        def __init__(self) -> None:
            self.made: list[asyncio.Future[int]] = []

        async def __aiter__(self) -> AsyncIterator[Any]:
            for _ in range(20):  # futures nobody resolves: only the engine can end them
                self.made.append(asyncio.get_running_loop().create_future())
                yield self.made[-1]

    async def main() -> list[bool]:
        ds = Futures()
        engine = Engine(_config(ds, iterable=True, max_concurrency=2), [].append, "in a test")
        inbox: asyncio.Queue[object] = asyncio.Queue()
        runner = asyncio.ensure_future(engine.run(inbox))
        inbox.put_nowait(IterTask(0, 0))
        await asyncio.sleep(0.01)  # two awaited, a third held while the pump waits for a slot
        inbox.put_nowait(Shutdown())
        await asyncio.wait_for(runner, 5)
        return [f.cancelled() for f in ds.made]

    cancelled = asyncio.run(main())
    assert len(cancelled) >= 3
    assert all(cancelled)


class Gated(asyncload.Dataset[int]):
    """The first batch's samples (0-2) wait for ``gate``, or sleep ``head_s``; every sample
    notes when it started (loop time)."""

    def __init__(self, n: int, head_s: float | None = None) -> None:
        self.n, self.head_s = n, head_s
        self.gate = asyncio.Event()
        self.started: dict[int, float] = {}

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, index: int) -> int:
        self.started[index] = asyncio.get_running_loop().time()
        if index < 3:
            if self.head_s is None:
                await self.gate.wait()
            else:
                await asyncio.sleep(self.head_s)
        return index


def _pass_of(ds: Gated, batches: int) -> list[IndexTask]:
    return [IndexTask(k, 0, np.arange(3 * k, 3 * k + 3)) for k in range(batches)]


def test_a_pass_first_batch_has_the_worker_to_itself_for_head_start_at_most(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The rest of the pass waits HEAD_START behind a head batch that does not finish, then goes
    # (a straggling head must not idle the other slots for long).
    monkeypatch.setattr(_engine_map, "HEAD_START", 0.2)
    ds = Gated(9)

    opened: list[float] = []

    def open_gate() -> None:
        opened.append(asyncio.get_running_loop().time())
        ds.gate.set()

    async def main() -> list[Any]:
        asyncio.get_running_loop().call_later(0.6, open_gate)
        return await _run(_config(ds, max_concurrency=9), list(_pass_of(ds, 3)))

    out = asyncio.run(main())
    assert {r.send_idx: r.data for r in out} == {k: [3 * k, 3 * k + 1, 3 * k + 2] for k in range(3)}
    head = max(ds.started[i] for i in range(3))
    rest = [ds.started[i] for i in range(3, 9)]
    # The hold's clock starts a loop turn before the head's samples run: a little slack.
    assert min(rest) - head >= 0.19  # after the hold...
    assert max(rest) < opened[0]  # ...but not after the head batch
    assert [r.send_idx for r in out][-1] == 0  # the later batches were done first


def test_the_hold_ends_as_soon_as_the_head_batch_is_done(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_engine_map, "HEAD_START", 30.0)
    ds = Gated(9, head_s=0.05)
    out = asyncio.run(_run(_config(ds, max_concurrency=9), list(_pass_of(ds, 3))))
    assert sorted(r.send_idx for r in out) == [0, 1, 2]
    head = min(ds.started[i] for i in range(3))
    assert 0.05 <= min(ds.started[i] for i in range(3, 9)) - head < 5


def test_every_pass_starts_with_its_head_batch_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    # Persistent workers: a new pass of the same engine holds its first batch again.
    monkeypatch.setattr(_engine_map, "HEAD_START", 0.2)
    ds = Gated(9, head_s=1.0)
    tasks = [*_pass_of(ds, 1), StartPass(1, epoch=None, shared_seed=None)]
    tasks += [IndexTask(k, 1, np.arange(3 * k, 3 * k + 3)) for k in range(3)]

    async def main() -> list[Any]:
        # The first pass's task is dropped by StartPass, unanswered.
        return await _run(_config(ds, max_concurrency=9), tasks, settle=0.05, replies=3)

    out = asyncio.run(main())
    assert sorted(r.send_idx for r in out if isinstance(r, Result) and r.generation == 1) == [
        0,
        1,
        2,
    ]
    head = max(ds.started[i] for i in range(3))
    assert min(ds.started[i] for i in range(3, 9)) - head >= 0.19


def test_a_slot_freed_during_the_head_start_takes_nothing_of_the_next_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Two slots: one waits on sample 0, the other runs through 3-6 and finds the line empty
    # while the hold lasts. The next batch waiting in the queue is not its to start.
    monkeypatch.setattr(_engine_map, "HEAD_START", 0.2)
    ds = Gated(12)

    async def main() -> list[Any]:
        asyncio.get_running_loop().call_later(0.6, ds.gate.set)
        tasks = [IndexTask(0, 0, [0, 3, 4, 5, 6]), IndexTask(1, 0, [7, 8, 9])]
        return await _run(_config(ds, max_concurrency=2), tasks)

    out = asyncio.run(main())
    assert {r.send_idx: r.data for r in out} == {0: [0, 3, 4, 5, 6], 1: [7, 8, 9]}
    assert min(ds.started[i] for i in (7, 8, 9)) - ds.started[0] >= 0.19


class _Recording(asyncload.Dataset[int]):
    """Index *i* returns *i* after *delay* s; records the order samples start in, and the task
    that fetched each."""

    def __init__(self, n: int, delay: float = 0.001) -> None:
        self.n, self.delay = n, delay
        self.started: list[int] = []
        self.tasks: dict[int, asyncio.Task[Any] | None] = {}

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, index: int) -> int:
        self.started.append(index)
        self.tasks[index] = asyncio.current_task()
        await asyncio.sleep(self.delay)
        return index


def test_a_freed_slot_fetches_the_next_sample_in_line_in_its_own_task() -> None:
    # A task per sample, woken through the starter, cost each sample two turns of a busy loop.
    ds = _Recording(60)
    tasks = [IndexTask(k, 0, list(range(12 * k, 12 * k + 12))) for k in range(5)]
    out = asyncio.run(_run(_config(ds, max_concurrency=4), list(tasks)))
    assert {r.send_idx: r.data for r in out} == {
        k: list(range(12 * k, 12 * k + 12)) for k in range(5)
    }
    assert ds.started == list(range(60))  # still in order
    # A new task only where the line ran dry (between batches): one per slot at most each time,
    # not one per sample.
    assert len({id(t) for t in ds.tasks.values()}) <= 4 * (1 + 5)


def test_slots_go_on_into_the_batches_waiting_rather_than_end_at_each_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every holder ended where its batch's line ran dry, and the starter began a task per slot
    # for the next batch: at each batch, all of a worker's tasks ended and began anew.
    # The head batch's hold then ends with it, not while its last holders still run.
    monkeypatch.setattr(_engine_map, "HEAD_START", 5.0)
    ds = _Recording(60)
    tasks = [IndexTask(k, 0, list(range(12 * k, 12 * k + 12))) for k in range(5)]
    out = asyncio.run(_run(_config(ds, max_concurrency=4), list(tasks)))
    assert {r.send_idx: r.data for r in out} == {
        k: list(range(12 * k, 12 * k + 12)) for k in range(5)
    }
    assert ds.started == list(range(60))
    # The head batch's slots end with its hold (HEAD_START); then one set for the rest.
    assert len({id(t) for t in ds.tasks.values()}) <= 2 * 4


def test_a_slot_skips_the_rest_of_a_failed_batch() -> None:
    ds = Jittery(9, seed=4, bad=(0,))
    ds.delays = [0.01] * 9
    fetched: list[int] = []
    getitem = ds.__getitem__

    async def recorded(index: int) -> int:
        fetched.append(index)
        return await getitem(index)

    ds.__getitem__ = recorded  # type: ignore[method-assign]
    tasks = [IndexTask(0, 0, [0, 1, 2, 3, 4, 5]), IndexTask(1, 0, [6, 7, 8])]
    out = asyncio.run(_run(_config(ds, max_concurrency=1), list(tasks)))
    assert isinstance(out[0], Failure)
    assert out[1].data == [6, 7, 8]
    assert fetched == [0, 6, 7, 8]  # 1-5 waited in line behind 0: never fetched


def test_a_new_pass_fetches_nothing_that_waited_in_line_in_the_old_one() -> None:
    ds = _Recording(9, delay=0.2)
    messages: list[object] = [
        IndexTask(0, 0, [0, 1, 2]),  # one slot: 1 and 2 wait in line behind 0
        StartPass(1, epoch=None, shared_seed=None),
        IndexTask(0, 1, [6, 7, 8]),
    ]
    out = asyncio.run(_run(_config(ds, max_concurrency=1), messages, settle=0.05))
    assert [r.data for r in out if isinstance(r, Result)] == [[6, 7, 8]]
    assert ds.started == [0, 6, 7, 8]


def test_a_slot_that_outlives_its_cancellation_fetches_nothing_more_of_the_old_pass() -> None:
    # A sample may swallow its cancellation and return (a cache waiter whose shared fetch was
    # cancelled reads again): its slot must not go on to the samples waiting in line.
    class Swallowing(_Recording):
        async def __getitem__(self, index: int) -> int:
            self.started.append(index)
            try:
                await asyncio.sleep(self.delay)
            except asyncio.CancelledError:
                if index == 0:
                    return index
                raise
            return index

    ds = Swallowing(40, delay=0.2)
    messages: list[object] = [
        IndexTask(0, 0, list(range(30))),  # two slots: 0 and 1 run, 2-29 wait in line
        StartPass(1, epoch=None, shared_seed=None),
        IndexTask(0, 1, [30, 31]),
    ]
    out = asyncio.run(_run(_config(ds, max_concurrency=2), messages, settle=0.05))
    assert [r.data for r in out if isinstance(r, Result)] == [[30, 31]]
    assert ds.started == [0, 1, 30, 31]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="Task.cancelling()")
def test_a_sample_that_leaves_a_cancellation_behind_does_not_pass_it_to_the_next() -> None:
    # A cancellation caught and not withdrawn stays counted on the task (Task.cancelling()),
    # and the engine reads that count to tell its own cancellations from a sample's.
    class Leaving(_Recording):
        async def __getitem__(self, index: int) -> int:
            if index == 0:
                task = asyncio.current_task()
                assert task is not None
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.sleep(1)
            if index == 1:
                raise asyncio.CancelledError("from inside")  # a failure of this sample
            return await super().__getitem__(index)

    ds = Leaving(6)
    tasks = [IndexTask(0, 0, [0, 1, 2]), IndexTask(1, 0, [3, 4, 5])]
    out = asyncio.run(_run(_config(ds, max_concurrency=1), list(tasks)))
    by_idx = {r.send_idx: r for r in out}
    assert isinstance(by_idx[0], Failure)
    assert "cancelled from inside" in str(by_idx[0].error.exception())
    assert by_idx[1].data == [3, 4, 5]
