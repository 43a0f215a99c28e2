"""The CPU lane (``_dataset/cpu.py``): ``asyncload.cpu`` and ``decode_in_thread`` decoders run on a
few threads per worker, the head batch's first, while the event loop goes on fetching."""

from __future__ import annotations

import asyncio
import contextvars
import os
import random
import threading
import time
from typing import Any

import numpy as np
import pytest

import asyncload
from asyncload._dataset import cpu as _cpu
from asyncload._engine import Engine
from asyncload._protocol.messages import IndexTask, PassStarted, Result, Shutdown

from .._datasets import worker_config
from .._http_server import ObjectServer

pytestmark = pytest.mark.usefixtures("clean_storage")


@pytest.mark.timeout(20)
def test_a_lane_never_runs_more_than_its_size() -> None:
    lane = _cpu.CpuLane(2, name="test-cpu")
    try:
        futures = [lane.submit(time.sleep, 0.01) for _ in range(20)]
        for f in futures:
            f.result(timeout=10)
        assert lane.most == 2
    finally:
        lane.shutdown()
    with pytest.raises(RuntimeError, match="after shutdown"):
        lane.submit(sum, [1])
    with pytest.raises(ValueError, match="at least one thread"):
        _cpu.CpuLane(0)


@pytest.mark.timeout(20)
def test_a_lane_runs_the_lowest_batch_first_then_in_order() -> None:
    lane = _cpu.CpuLane(1, name="test-cpu")
    gate, holding = threading.Event(), threading.Event()
    ran: list[tuple[int, int]] = []

    def hold() -> None:
        holding.set()
        gate.wait(10)

    try:
        blocker = lane.submit(hold)  # holds the one thread while the rest queue
        assert holding.wait(10)
        futures = []
        for seq, batch in enumerate([5, 1, 3, 1, 0, 5]):
            ctx = contextvars.copy_context()
            ctx.run(_cpu.priority.set, batch)
            futures.append(ctx.run(lane.submit, ran.append, (batch, seq)))
        gate.set()
        blocker.result(timeout=10)
        for f in futures:
            f.result(timeout=10)
    finally:
        lane.shutdown()
    assert ran == [(0, 4), (1, 1), (1, 3), (3, 2), (5, 0), (5, 5)]


def _held(lane: _cpu.CpuLane) -> threading.Event:
    """Occupy *lane*'s one thread until the returned event is set."""
    gate, holding = threading.Event(), threading.Event()

    def hold() -> None:
        holding.set()
        gate.wait(10)

    lane.submit(hold)
    assert holding.wait(10)
    return gate


@pytest.mark.timeout(20)
def test_a_scheduled_call_runs_on_the_lane_and_its_outcome_reaches_its_awaiter() -> None:
    lane = _cpu.CpuLane(1, name="test-cpu")

    def boom() -> None:
        raise KeyError("decode failed")

    def stop() -> None:
        raise StopIteration("a decoder's next() ran dry")

    async def coroutine() -> None:
        pass

    async def main() -> tuple[str, BaseException]:
        ran_on = await lane.schedule(lambda: threading.current_thread().name)
        with pytest.raises(KeyError, match="decode failed"):
            await lane.schedule(boom)
        # A future refuses StopIteration: it comes as a RuntimeError (PEP 479), not as a hang.
        with pytest.raises(RuntimeError, match="raised StopIteration") as stopped:
            await lane.schedule(stop)
        with pytest.raises(TypeError, match="coroutine cannot run on a CPU lane"):
            lane.schedule(coroutine)
        return ran_on, stopped.value

    try:
        ran_on, stopped = asyncio.run(main())
    finally:
        lane.shutdown()
    assert ran_on.startswith("test-cpu")
    assert isinstance(stopped.__cause__, StopIteration)


@pytest.mark.timeout(20)
def test_a_scheduled_call_cancelled_before_it_starts_never_runs() -> None:
    lane = _cpu.CpuLane(1, name="test-cpu")
    ran: list[str] = []

    async def main() -> None:
        gate = _held(lane)
        skipped = lane.schedule(ran.append, "cancelled")
        later = lane.schedule(ran.append, "later")
        skipped.cancel()
        gate.set()
        await later
        with pytest.raises(asyncio.CancelledError):
            await skipped

    try:
        asyncio.run(main())
    finally:
        lane.shutdown()
    assert ran == ["later"]


@pytest.mark.timeout(20)
def test_shutdown_cancels_the_scheduled_calls_still_queued() -> None:
    lane = _cpu.CpuLane(1, name="test-cpu")
    ran: list[int] = []

    async def main() -> list[asyncio.Future[None]]:
        gate = _held(lane)
        futures = [lane.schedule(ran.append, i) for i in range(3)]
        lane.shutdown(wait=False, cancel_futures=True)  # as a worker's engine ends
        gate.set()
        await asyncio.wait(futures, timeout=10)
        return futures

    futures = asyncio.run(main())
    for thread in lane._threads:
        thread.join(10)
    assert ran == []
    assert all(f.cancelled() for f in futures)


@pytest.mark.timeout(20)
def test_a_scheduled_call_whose_loop_closed_meanwhile_is_dropped_quietly() -> None:
    lane = _cpu.CpuLane(1, name="test-cpu")
    ran: list[int] = []
    loop = asyncio.new_event_loop()
    gate = _held(lane)
    running, finish = threading.Event(), threading.Event()

    def slow(i: int) -> int:
        running.set()
        finish.wait(10)
        ran.append(i)
        return i

    async def schedule() -> list[asyncio.Future[int]]:
        return [lane.schedule(slow, 0), lane.schedule(ran.append, 1)]

    futures = loop.run_until_complete(schedule())
    gate.set()
    assert running.wait(10)  # the first call runs; the second waits for the thread
    loop.close()
    finish.set()  # the first call's result goes to a closed loop: dropped, no error
    lane.shutdown(wait=True)  # the second never starts: its loop is gone
    assert ran == [0]
    assert not any(f.done() for f in futures)


@pytest.mark.timeout(20)
def test_cpu_outside_a_worker_runs_in_the_default_executor() -> None:
    async def main() -> tuple[int, str]:
        return await asyncload.cpu(lambda a, *, b: a + b, 2, b=3), await asyncload.cpu(
            lambda: threading.current_thread().name
        )

    total, thread = asyncio.run(main())
    assert total == 5
    assert thread != threading.main_thread().name


class _Decoding(asyncload.Dataset[int]):
    """Each sample waits a seeded random while (its I/O), then does its CPU work on the lane;
    the lane's first call holds it until every other sample's work queues behind it."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.ran: list[int] = []  # the batches whose CPU work ran, in order
        self.first = True

    def __len__(self) -> int:
        return self.n

    def _work(self, index: int) -> int:
        if self.first:  # hold the lane until every other sample's work waits on it
            self.first = False
            lane = _cpu.current()
            assert lane is not None
            deadline = time.monotonic() + 10
            while len(lane._work) < self.n - 1 and time.monotonic() < deadline:
                time.sleep(0.005)
        self.ran.append(index // 4)
        return index

    async def __getitem__(self, index: int) -> int:
        await asyncio.sleep(random.Random(index).uniform(0.0, 0.03))
        return await asyncload.cpu(self._work, index)


@pytest.mark.timeout(30)
def test_the_head_batchs_cpu_work_runs_before_later_batches() -> None:
    ds = _Decoding(40)
    cfg = worker_config(ds, batch_size=4, max_concurrency=64)

    async def main() -> list[Any]:
        out: list[Any] = []
        engine = Engine(cfg, out.append, "in a test engine")
        inbox: asyncio.Queue[object] = asyncio.Queue()
        for k in range(10):
            inbox.put_nowait(IndexTask(k, 0, np.arange(4 * k, 4 * k + 4)))
        runner = asyncio.ensure_future(engine.run(inbox))
        for _ in range(500):  # bounded: ~5 s
            if sum(isinstance(r, Result) for r in out) == 10:
                break
            await asyncio.sleep(0.01)
        inbox.put_nowait(Shutdown())
        await asyncio.wait_for(runner, 5)
        return [r for r in out if not isinstance(r, PassStarted)]

    lane = _cpu.CpuLane(1, name="test-cpu")
    try:
        with _cpu.using(lane):
            results = asyncio.run(main())
    finally:
        lane.shutdown()
    assert sorted(x for r in results for x in r.data) == list(range(40))
    # All 39 others queued while the first ran: then the lane took them batch by batch.
    assert ds.ran[1:] == sorted(ds.ran[1:])
    assert ds.ran[1:] != sorted(ds.ran[1:], reverse=True)


# The decoder runs in the worker process: its counters are the worker's.
_lock = threading.Lock()
_running = 0


def slow_decode(data: bytes) -> tuple[int, int, str]:
    """Hold the lane 20 ms (a JPEG's worth); say how many decodes ran at once and where."""
    global _running
    with _lock:
        _running += 1
        at_once = _running
    try:
        time.sleep(0.02)
        return int.from_bytes(data, "big"), at_once, threading.current_thread().name
    finally:
        with _lock:
            _running -= 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 1])
def test_decoders_run_on_the_lane_while_the_loop_keeps_fetching(
    http_server: ObjectServer, num_workers: int
) -> None:
    n = 96
    urls = [http_server.put(f"d/{i}", i.to_bytes(4, "big")) for i in range(n)]
    http_server.latency = 0.05
    dataset = asyncload.RemoteFiles(urls, decode=slow_decode, decode_in_thread=True)
    loader = asyncload.DataLoader(
        dataset, batch_size=8, num_workers=num_workers, cpu_threads=2, collate_fn=list,
        max_concurrency=64,
    )  # fmt: skip
    got = [x for batch in loader for x in batch]
    assert [i for i, _, _ in got] == list(range(n))  # every sample once, in order
    assert max(at_once for _, at_once, _ in got) <= 2  # the lane's size, never more
    assert all("-cpu-" in where for _, _, where in got)
    # 96 decodes of 20 ms on 2 threads hold the lane ~1 s; meanwhile the loop kept many
    # requests at the server, not one per free decoder.
    assert http_server.peak_active >= 16


@pytest.mark.timeout(10)
def test_the_loader_checks_cpu_threads() -> None:
    ds = list(range(4))
    assert asyncload.DataLoader(ds, cpu_threads=3).cpu_threads == 3  # type: ignore[arg-type]
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="cpu_threads must be a positive integer"):
            asyncload.DataLoader(ds, cpu_threads=bad)  # type: ignore[arg-type]
    assert _cpu.default_threads(1) == len(os.sched_getaffinity(0))
    assert _cpu.default_threads(10_000) == 1


def picky_decode(data: bytes) -> int:
    value = int.from_bytes(data, "big")
    if value % 10 == 3:
        raise ValueError(f"cannot decode sample {value}")
    return value


@pytest.mark.timeout(60)
def test_lane_decodes_are_exactly_once_out_of_order_and_their_errors_skipped(
    http_server: ObjectServer,
) -> None:
    n = 80
    urls = [http_server.put(f"e/{i}", i.to_bytes(4, "big")) for i in range(n)]
    http_server.latency = 0.01
    http_server.jitter = 0.02  # answers out of order
    dataset = asyncload.RemoteFiles(urls, decode=picky_decode, decode_in_thread=True)
    loader = asyncload.DataLoader(
        dataset, batch_size=8, num_workers=2, collate_fn=list, in_order=False,
        sample_errors="skip",
    )  # fmt: skip
    got = [x for batch in loader for x in batch]
    assert sorted(got) == [i for i in range(n) if i % 10 != 3]
    assert loader.stats().skipped == {"ValueError": 8}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("cpu_threads", "on_lane"), [(1, False), (2, True)])
def test_by_default_decoders_go_to_the_lane_only_where_a_worker_has_two_cores(
    http_server: ObjectServer, cpu_threads: int, on_lane: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Measured: inline is faster at one core per worker, the lane at two or more.
    # Inline, the stand-in decode sleeps on the loop: it uses no CPU, so the loop's turns
    # (_control/turns.py) never pause between decodes, and those of samples read together run
    # back to back: several held the loop past the blocked-loop warning's 0.1 s in a CI run.
    monkeypatch.setenv("ASYNCLOAD_SLOW_CALLBACK", "0")
    urls = [http_server.put(f"a/{i}", i.to_bytes(4, "big")) for i in range(16)]
    dataset = asyncload.RemoteFiles(urls, decode=slow_decode)  # decode_in_thread left unset
    loader = asyncload.DataLoader(
        dataset, batch_size=8, num_workers=1, cpu_threads=cpu_threads, collate_fn=list
    )
    got = [x for batch in loader for x in batch]
    assert [i for i, _, _ in got] == list(range(16))
    assert {"-cpu-" in where for _, _, where in got} == {on_lane}
