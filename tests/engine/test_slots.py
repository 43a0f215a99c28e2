"""The engine's fetch slots (``_engine/slots.py``): a fixed count, or a limit found while reading.

No network: in-memory datasets whose samples wait (a store's latency) or spin (a worker's CPU),
run by an engine on its own, as in test_core.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import asyncload
from asyncload._control import LimitController, LimitState
from asyncload._control import aside as _aside
from asyncload._engine import Engine, WorkerConfig, _core
from asyncload._engine.slots import (
    AUTO_CEILING,
    LOADER_CEILING,
    Held,
    Slots,
    initial_limit,
    most_in_flight,
)
from asyncload._protocol.messages import (
    PEERS_EVERY,
    IndexTask,
    PassStarted,
    Peers,
    Result,
    Shutdown,
)
from asyncload._stats import recorder as _metrics
from asyncload._storage.retry import retrying
from asyncload._workers.processes import ProcessWorkers
from asyncload.sources import AttemptFailed

from .._datasets import spin, worker_config


class Store(asyncload.Dataset[int]):
    """Index *i* returns *i* after *latency* seconds of waiting and *cpu* seconds of spinning
    (the loop is blocked meanwhile, as by a decode); counts the fetches in flight."""

    def __init__(self, n: int, *, latency: float = 0.0, cpu: float = 0.0) -> None:
        self.n, self.latency, self.cpu = n, latency, cpu
        self.in_flight = self.peak = 0
        self.throttle: set[int] = set()  # indices whose first attempt the store refuses
        self.limit: Any = None  # reads the engine's limit now (set by _read)
        self.phase: Any = None  # ... and its controller's phase
        self.limits: list[tuple[int, int]] = []  # the limit just before and after each throttle
        self.phases: list[str] = []  # the phase just before each throttle

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, index: int) -> int:
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            sent = time.monotonic()
            await asyncio.sleep(self.latency)
            if index in self.throttle:
                # What the storage layer's retry path does on a 503 SlowDown, then retries.
                before = self.limit()
                self.phases.append(self.phase())
                _metrics.note_throttle(sent, None)
                self.limits.append((before, self.limit()))
                await asyncio.sleep(self.latency)
            spin(self.cpu)
            return index
        finally:
            self.in_flight -= 1


def _adaptive(initial: int) -> tuple[Slots, LimitController]:
    """Adaptive slots starting at *initial*, and their controller."""
    slots = Slots(None, initial=initial)
    assert slots.controller is not None
    return slots, slots.controller


def _config(dataset: Any, max_concurrency: int | None, batch_size: int = 8) -> WorkerConfig:
    return worker_config(dataset, max_concurrency=max_concurrency, batch_size=batch_size)


async def _read(
    cfg: WorkerConfig, batches: int, *, window: int, watch: Callable[[Engine], None] | None = None
) -> list[Result]:
    """Read *batches* batches of the dataset, keeping *window* of them out (as the main
    process does); the results in the order they came. *watch* sees the engine every 2 ms."""
    out: list[Any] = []
    engine = Engine(cfg, out.append, "in a test engine")
    if isinstance(cfg.dataset, Store):
        cfg.dataset.limit = lambda: engine._sem.limit
        cfg.dataset.phase = lambda: (c := engine._sem.controller) and c.stats().phase
    inbox: asyncio.Queue[object] = asyncio.Queue()
    runner = asyncio.ensure_future(engine.run(inbox))
    size = cfg.batch_size or 1
    sent = 0
    deadline = time.monotonic() + 60  # bounded: every test here ends well before
    while sum(isinstance(r, Result) for r in out) < batches:
        assert time.monotonic() < deadline, "the engine stopped answering"
        done = sum(not isinstance(r, PassStarted) for r in out)
        while sent < batches and sent - done < window:
            inbox.put_nowait(IndexTask(sent, 0, np.arange(sent * size, (sent + 1) * size)))
            sent += 1
        await asyncio.sleep(0.002)
        if watch is not None:
            watch(engine)
    inbox.put_nowait(Shutdown())
    await asyncio.wait_for(runner, 5)
    return [r for r in out if isinstance(r, Result)]


def _last_limit(results: list[Result]) -> int:
    stats = [r.stats for r in results if r.stats is not None]
    return stats[-1].limit


@pytest.mark.timeout(60)
def test_an_explicit_max_concurrency_is_never_exceeded_and_reported() -> None:
    ds = Store(800, latency=0.005)
    results = asyncio.run(_read(_config(ds, 6), 100, window=40))
    assert sorted(x for r in results for x in r.data) == list(range(800))
    assert ds.peak == 6
    assert _last_limit(results) == 6


@pytest.mark.timeout(60)
def test_the_default_grows_to_hide_a_stores_latency() -> None:
    # 20 ms of waiting and nothing else: more in flight is more throughput, so the limit
    # leaves its start (a batch, 8) far behind, and every sample still comes exactly once.
    ds = Store(6000, latency=0.02)
    results = asyncio.run(_read(_config(ds, None), 750, window=200))
    assert sorted(x for r in results for x in r.data) == list(range(6000))
    assert ds.peak >= 64
    assert ds.peak <= AUTO_CEILING
    assert _last_limit(results) >= 64


@pytest.mark.timeout(60)
def test_the_default_stays_small_when_the_cpu_is_the_bottleneck() -> None:
    # 2 ms of CPU per sample and no waiting: samples in flight only queue for the loop (their
    # latency grows with their number, their rate does not), so the limit does not grow: it
    # hovers where a few samples queue (13-20 on a busy 2-core machine), far under the 64+
    # a store's latency earns and the 512 ceiling.
    ds = Store(1200, cpu=0.002)
    results = asyncio.run(_read(_config(ds, None), 150, window=100))
    assert sorted(x for r in results for x in r.data) == list(range(1200))
    limits = [r.stats.limit for r in results if r.stats is not None]
    assert max(limits[len(limits) // 2 :]) <= 32, limits


@pytest.mark.timeout(60)
def test_an_engine_tells_its_limit_whether_its_own_cpu_bounds_it() -> None:
    # 1 ms of the loop's CPU per sample after 20 ms of waiting (1,000/s; the knee ~20 in
    # flight): the engine measures its loop busy and tells the controller, which then makes no
    # probe (test_law.py). Waiting alone keeps the loop idle: not bound. Idle means a rate
    # whose loop work is small (a batch out at a time, 640 samples/s): at the 4,000/s the
    # limit grows to in a wider window, the loop's own work per sample kept it on a core or
    # waiting for one 0.96 of the time on a machine that three other processes shared, one CI
    # run among them: bound, truly, by a CPU it could not get.
    # The stats count the seconds it read as bound (LoaderStats.cpu_bound_s, bound_by), with a
    # fixed limit too.
    def bound_seen(
        ds: Store, cap: int | None = None, *, batches: int = 40, window: int = 20
    ) -> tuple[list[bool], float]:
        seen: list[bool] = []

        def watch(engine: Engine) -> None:
            c = engine._sem.controller
            if c is not None:
                seen.append(c.stats().cpu_bound)

        config = _config(ds, cap, batch_size=32)
        # The collector's full passes over the objects earlier tests left (torch's among them)
        # run on the loop's thread and read as its CPU: frozen, they are not walked.
        gc.collect()
        gc.freeze()
        try:
            results = asyncio.run(_read(config, batches, window=window, watch=watch))
        finally:
            gc.unfreeze()
        assert sorted(x for r in results for x in r.data) == list(range(ds.n))
        stats = [r.stats for r in results if r.stats is not None]
        return seen, stats[-1].cpu_bound_s

    busy, busy_s = bound_seen(Store(1280, latency=0.02, cpu=0.001))
    assert any(busy), busy[::10]
    assert busy_s >= 0.3, busy_s  # 1.3 s of CPU in all
    idle, idle_s = bound_seen(Store(640, latency=0.05), batches=20, window=1)
    assert len(idle) >= 10, idle  # read while the pass ran (~1 s), not once at its end
    assert not any(idle), idle[::10]
    assert idle_s == 0.0
    _, fixed_s = bound_seen(Store(1280, latency=0.02, cpu=0.001), cap=64)
    assert fixed_s >= 0.3, fixed_s


@pytest.mark.timeout(60)
def test_a_throttle_cuts_the_limit_at_once_and_nothing_is_lost() -> None:
    ds = Store(4000, latency=0.02)
    ds.throttle = set(range(2000, 2010))  # a burst of 503s midway
    results = asyncio.run(_read(_config(ds, None), 500, window=200))
    assert sorted(x for r in results for x in r.data) == list(range(4000))
    counts = [dict(r.stats.counts).get("throttled", 0) for r in results if r.stats is not None]
    assert counts[-1] == 10  # every throttle counted once (they reach loader.stats())
    # The first throttle cuts the limit at once: to 0.8 of it, or to half in slow start (the
    # doubling taken back; latency never rises here, so slow start may still be on when the
    # throttles come, at the ceiling of 512, or not, by the timing of a run). The nine others,
    # sent before the cut, are answers to the same overload and cut nothing more (ten cuts:
    # 0.8**10 = 0.11).
    first_before, first_after = ds.limits[0]
    assert first_before >= 32  # it had grown: a cut means something
    factor = 0.5 if ds.phases[0] == "slow start" else 0.8
    assert abs(first_after - factor * first_before) <= 1, (ds.phases[0], ds.limits[0])
    assert all(after >= first_after for _, after in ds.limits)


@pytest.mark.timeout(60)
def test_a_cut_goes_to_the_main_process_with_the_next_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The other workers of the loader are cut by it too (Peers): it must not wait for the
    # stats every 0.2 s, here never but at the pass's end.
    monkeypatch.setattr(_core, "_STATS_EVERY", 1e9)
    ds = Store(400, latency=0.01)
    ds.throttle = {200}
    results = asyncio.run(_read(_config(ds, None), 50, window=50))
    reported = [r for r in results if r.limit is not None]
    assert len(reported) >= 2, "only the pass's last batch reported"
    assert reported[0].limit.throttled_at is not None
    assert reported[0] is not results[-1]


@pytest.mark.timeout(10)
def test_a_slot_is_handed_on_only_while_the_limit_allows() -> None:
    async def main() -> None:
        slots = Slots(None, initial=4)
        grants = [await slots.acquire() for _ in range(4)]
        assert slots.limit == 4
        # A finished sample's holder may take the next one: still 4 in flight.
        assert slots.handoff(grants[0], True) is not None
        # Cut to 2 (in slow start the doubling is taken back: half of 4): two slots too many.
        slots.throttled(grants[1], None)
        assert slots.limit == 2
        assert slots.handoff(grants[1], True) is None  # given back, not handed on
        waiter = asyncio.ensure_future(slots.acquire())
        await asyncio.sleep(0)
        assert not waiter.done()  # 3 in flight, limit 2
        slots.release(grants[2], True)
        await asyncio.sleep(0)
        assert not waiter.done()  # 2 in flight, limit 2
        slots.release(grants[3], True)
        assert await asyncio.wait_for(waiter, 1) > 0

    asyncio.run(main())


@pytest.mark.timeout(10)
def test_a_holder_refused_its_slot_leaves_it_to_a_rejoining_sample_and_waits_for_none() -> None:
    async def main() -> None:
        slots, c = _adaptive(3)
        a, b = Held(slots, await slots.acquire()), Held(slots, await slots.acquire())
        retry = Held(slots, await slots.acquire())
        assert retry.leave()  # a retry's backoff: its slot goes back ...
        starter = await slots.acquire()  # ... and is taken
        rejoin = asyncio.ensure_future(retry.rejoin())  # the backoff is over: first in line
        await asyncio.sleep(0)
        assert not rejoin.done()
        # A finishes a sample: the sample waiting to rejoin goes first, and A neither keeps a
        # slot nor waits for one (the next sample stays in line for whoever gets a slot).
        assert not a.keep(True)
        await asyncio.wait_for(rejoin, 1)
        assert retry.held
        assert not a.held
        assert not a.keep(True)  # done with: it takes none again
        # B keeps its own: nobody waits to rejoin, and the limit allows it. Before, A waited
        # for a slot holding the next sample, and B gave its slot to A and waited in turn.
        assert b.keep(True)
        assert c.in_flight == 3
        slots.release(starter, True)
        b.release(True)
        retry.release(True)
        assert c.in_flight == 0

    asyncio.run(main())


@pytest.mark.timeout(10)
def test_a_holder_keeps_its_slot_though_others_wait_and_a_limit_that_grew_lets_them_in() -> None:
    async def main() -> None:
        slots, c = _adaptive(8)
        held = [Held(slots, await slots.acquire()) for _ in range(8)]
        starter = asyncio.ensure_future(slots.acquire())  # the next sample in line waits
        await asyncio.sleep(0)
        # Holders keep their slots for the samples next in line, though the starter waits:
        # it would take the same samples, at the cost of a task each.
        for k in range(15):
            assert held[k % 8].keep(True)
        assert not starter.done()
        # The 16th answer ends slow start's first epoch: the limit doubles, and the room it
        # made goes to the starter at once (no release would come to wake it).
        assert held[15 % 8].keep(True)
        assert c.limit == 16
        assert await asyncio.wait_for(starter, 1) > 0
        assert c.in_flight == 9

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_after_a_cut_the_holders_keep_their_slots_again(monkeypatch: pytest.MonkeyPatch) -> None:
    # A cut leaves more samples in flight than the limit: holders that finish give their slots
    # back until it fits, and then keep them again. Before, a holder refused its slot waited
    # for one again holding the next sample, and every later holder gave its slot to the one
    # waiting and waited in turn: 1,336 of 1,350 handoffs refused after one throttle.
    seen = {"asked": 0, "refused": 0, "drop": 0}
    last = [0]
    handoff = Slots.handoff

    def counting(self: Slots, granted: float, ok: bool | None) -> float | None:
        before = self.limit
        got = handoff(self, granted, ok)
        seen["asked"] += 1
        seen["refused"] += got is None
        # The limit's falls, as handoffs see it: only a fall leaves more in flight than it.
        seen["drop"] += max(0, last[0] - before) + max(0, before - self.limit)
        last[0] = self.limit
        return got

    monkeypatch.setattr(Slots, "handoff", counting)
    ds = Store(4000, latency=0.02)
    ds.throttle = set(range(2000, 2010))  # a burst of 503s midway: a cut
    results = asyncio.run(_read(_config(ds, None), 500, window=200))
    assert sorted(x for r in results for x in r.data) == list(range(4000))
    assert ds.limits  # cut
    assert seen["asked"] >= 500
    assert seen["refused"] <= 2 * seen["drop"] + 16, seen


@pytest.mark.timeout(10)
def test_sizes_follow_the_setting() -> None:
    assert most_in_flight(None, 1) == most_in_flight(None, 2) == AUTO_CEILING
    assert most_in_flight(None, 8) == LOADER_CEILING // 8  # a loader's share, each
    assert most_in_flight(None, 64) == 64  # never under a useful minimum
    assert most_in_flight(32, 8) == 32  # an explicit value is the value
    assert initial_limit(None) == 8
    assert initial_limit(64) == 64
    assert initial_limit(10_000) == AUTO_CEILING // 4

    async def main() -> tuple[int, int]:
        fixed = Slots(3)
        renewed = fixed.renewed()
        return fixed.limit, renewed.limit

    assert asyncio.run(main()) == (3, 3)


@pytest.mark.timeout(10)
def test_the_loader_takes_none_or_a_positive_int() -> None:
    ds = Store(4)
    assert asyncload.DataLoader(ds).max_concurrency is None
    assert asyncload.DataLoader(ds, max_concurrency="auto").max_concurrency is None
    assert asyncload.DataLoader(ds, max_concurrency=16).max_concurrency == 16
    for bad in (0, -1, 2.5, True, "fast"):
        with pytest.raises(ValueError, match="max_concurrency must be a positive integer"):
            asyncload.DataLoader(ds, max_concurrency=bad)  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_an_engine_starts_where_it_was_told_the_last_pass_got_to() -> None:
    ds = Store(400, latency=0.01)
    cfg = dataclasses.replace(_config(ds, None), learned_limit=LimitState(limit=100.0))
    results = asyncio.run(_read(cfg, 50, window=50))
    first = next(r.stats for r in results if r.stats is not None)
    assert first.limit == 100  # no slow start from 8
    assert any(isinstance(r.limit, LimitState) for r in results if r.stats is not None)


@pytest.mark.timeout(30)
def test_an_engine_takes_in_what_its_peers_learned() -> None:
    # Another worker of the loader met a throttle (a Peers message from the main process):
    # this engine's limit is cut at once, as if it had met it, and a peer's limit pulls it
    # halfway there.
    async def main() -> tuple[int, int, int]:
        cfg = dataclasses.replace(
            _config(Store(10), None), learned_limit=LimitState(limit=100.0, base_latency=0.05)
        )
        engine = Engine(cfg, lambda _: None, "in a test engine")
        inbox: asyncio.Queue[object] = asyncio.Queue()
        runner = asyncio.ensure_future(engine.run(inbox))
        before = engine._sem.limit
        inbox.put_nowait(Peers(LimitState(limit=100.0, throttled_at=time.monotonic())))
        await asyncio.sleep(0.01)
        cut = engine._sem.limit
        inbox.put_nowait(Peers(LimitState(limit=40.0)))
        await asyncio.sleep(0.01)
        pulled = engine._sem.limit
        inbox.put_nowait(Shutdown())
        await asyncio.wait_for(runner, 5)
        return before, cut, pulled

    before, cut, pulled = asyncio.run(main())
    assert (before, cut, pulled) == (100, 80, 60)


@pytest.mark.timeout(120)
def test_the_workers_of_a_pass_hear_what_the_others_learned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The main process passes each worker's adaptive limit on to the others during the pass,
    # on a side channel: tasks are no carrier, since the look-ahead may have sent them all.
    sent: list[tuple[int, Peers]] = []
    real_send = ProcessWorkers.send

    def send(self: ProcessWorkers, worker_id: int, msg: object) -> None:
        if isinstance(msg, Peers):
            sent.append((worker_id, msg))
        real_send(self, worker_id, msg)

    monkeypatch.setattr(ProcessWorkers, "send", send)
    loader = asyncload.DataLoader(
        Store(3000, latency=0.02), batch_size=8, num_workers=2, collate_fn=list
    )
    assert sum(len(b) for b in loader) == 3000
    assert {w for w, _ in sent} == {0, 1}, sent
    assert all(m.state.workers == 1 and m.state.limit >= 1 for _, m in sent)
    # At most one message per worker per PEERS_EVERY seconds (and the pass lasted < 5 s).
    assert len(sent) <= 2 * (5 / PEERS_EVERY + 1), len(sent)


@pytest.mark.timeout(120)
def test_the_next_pass_starts_where_the_last_ones_workers_got_to() -> None:
    loader = asyncload.DataLoader(
        Store(4000, latency=0.02), batch_size=8, num_workers=2, collate_fn=list
    )
    assert sum(len(b) for b in loader) == 4000
    got_to = loader.stats().concurrency
    assert min(got_to) > 32  # grew from a batch's worth (8)
    it = iter(loader)
    next(it)
    started_at = loader.stats().concurrency
    assert min(started_at) > 16, (got_to, started_at)
    del it


@pytest.mark.timeout(10)
def test_a_slot_given_back_unused_teaches_nothing() -> None:
    async def main() -> None:
        slots = Slots(None, initial=4)
        granted = await slots.acquire()
        slots.release()  # taken, then nothing was in line for it
        assert slots.handoff(await slots.acquire(), None) is not None  # a cancelled sample
        slots.release(granted, False)
        c = slots.controller
        assert c is not None
        stats = c.stats()
        assert (stats.in_flight, stats.requests, stats.failed) == (0, 1, 1)

    asyncio.run(main())


@pytest.mark.timeout(10)
def test_a_retry_waits_outside_its_slot_and_takes_one_again_first() -> None:
    async def main() -> None:
        slots, c = _adaptive(2)
        first = Held(slots, await slots.acquire())
        other = await slots.acquire()

        async def sample() -> None:  # a sample whose storage request backs off once
            _aside.seat.set(first)
            await _aside.sleep_aside(0.05)

        backing_off = asyncio.ensure_future(sample())
        await asyncio.sleep(0.01)
        assert (first.held, c.in_flight) == (False, 1)  # its slot went back meanwhile
        taken = await asyncio.wait_for(slots.acquire(), 1)  # ... and was taken
        late = asyncio.ensure_future(slots.acquire())  # a new sample, in line before it wakes
        await asyncio.sleep(0.08)
        assert not backing_off.done()  # woke, and waits in line: 2 in flight, limit 2
        slots.release(other, True)
        await asyncio.wait_for(backing_off, 1)  # first in line, ahead of `late`
        assert first.held
        assert not late.done()
        assert c.in_flight == 2
        slots.release(taken, True)
        await asyncio.wait_for(late, 1)
        late.result()

        # A fixed max_concurrency keeps its slot through a backoff: the user's number holds.
        fixed = Slots(1)
        kept = Held(fixed, await fixed.acquire())
        assert not kept.leave()
        assert kept.held

    asyncio.run(main())


class Throttled(Store):
    """A store whose *throttle* indices are refused once (503, retry after RETRY_AFTER s) and
    retried by the storage layer's own loop; counts what is being answered and what waits."""

    RETRY_AFTER = 0.3

    def __init__(self, n: int, *, latency: float) -> None:
        super().__init__(n, latency=latency)
        self.answering = 0  # requests the store is answering now
        self.waiting = 0  # refused requests waiting for their retry
        self.watch: list[tuple[int, int, int]] = []  # (answering, waiting, slots taken)

    async def __getitem__(self, index: int) -> int:
        refused = [index in self.throttle]

        async def attempt() -> int:
            if not refused[0] and index in self.throttle:
                self.waiting -= 1  # its retry
            self.answering += 1
            try:
                await asyncio.sleep(self.latency)
            finally:
                self.answering -= 1
            if refused[0]:
                refused[0] = False
                self.waiting += 1
                raise AttemptFailed(
                    asyncload.ServerError,
                    "slow down",
                    status=503,
                    retryable=True,
                    reason="503",
                    retry_after=self.RETRY_AFTER,
                )
            return index

        return await retrying(attempt, url=f"mem://{index}", policy=asyncload.Retry())


@pytest.mark.timeout(60)
def test_samples_waiting_to_retry_hold_no_slot() -> None:
    ds = Throttled(3000, latency=0.02)
    ds.throttle = set(range(1500, 1520))  # a burst of 503s midway

    def watch(engine: Engine) -> None:
        c = engine._sem.controller
        assert c is not None
        if ds.waiting:
            ds.watch.append((ds.answering, ds.waiting, c.in_flight))

    results = asyncio.run(_read(_config(ds, None), 375, window=200, watch=watch))
    assert sorted(x for r in results for x in r.data) == list(range(3000))
    assert ds.waiting == 0
    # While twenty refused samples waited 0.3 s for their retries, the slots taken were those
    # of the requests being answered (and a few granted, not yet sent): the waiting held none.
    # (Held through their backoff, they would be 20 on top.)
    assert max(w for _, w, _ in ds.watch) >= 15
    calm = [taken - answering for answering, waiting, taken in ds.watch if waiting >= 15]
    assert calm
    assert min(calm) <= 4, ds.watch


@pytest.mark.timeout(10)
def test_a_task_left_running_by_its_sample_never_keeps_a_slot() -> None:
    async def main() -> None:
        slots, c = _adaptive(4)
        held = Held(slots, await slots.acquire())

        async def stray() -> None:  # started by a sample, outlives it, and backs off
            _aside.seat.set(held)
            await _aside.sleep_aside(0.05)

        task = asyncio.ensure_future(stray())
        await asyncio.sleep(0.01)
        held.release(True)  # the sample's task is done with its slot
        assert c.in_flight == 0
        await asyncio.wait_for(task, 1)  # woke and took nothing (or gave it straight back)
        assert c.in_flight == 0
        assert not held.held

    asyncio.run(main())


@pytest.mark.timeout(10)
def test_slots_given_back_are_taken_again_in_the_order_they_were_given() -> None:
    async def main() -> None:
        slots, c = _adaptive(1)
        granted = await slots.acquire()
        order: list[str] = []

        async def take(name: str, first: bool) -> None:
            got = await slots.acquire(first=first)
            order.append(name)
            slots.release(got, True)

        tasks = [
            asyncio.ensure_future(take("new", False)),
            asyncio.ensure_future(take("retry-1", True)),
            asyncio.ensure_future(take("retry-2", True)),
        ]
        await asyncio.sleep(0)
        slots.release(granted, True)
        await asyncio.wait_for(asyncio.gather(*tasks), 1)
        assert order == ["retry-1", "retry-2", "new"]
        # A grant cancelled before its holder ran teaches nothing (no failed request).
        granted = await slots.acquire()
        waiter = asyncio.ensure_future(slots.acquire())
        await asyncio.sleep(0)
        slots.release(granted, True)  # granted to the waiter ...
        waiter.cancel()  # ... which is cancelled in the same turn
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert (c.in_flight, c.stats().failed) == (0, 0)

    asyncio.run(main())
