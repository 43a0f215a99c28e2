"""Hedged reads against the real loopback server, with one straggling request injected."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest

import asyncload
from asyncload._exceptions import NotFound, ServerError
from asyncload._stats import loader_stats as _stats
from asyncload._stats import recorder as _metrics
from asyncload._storage import api as _storage
from asyncload._storage import hedge as _hedge
from asyncload._storage import retry as _retry
from asyncload._storage.backends.progress import Progress
from asyncload._storage.hedge import race as _round
from asyncload._storage.retry import AttemptFailed

from .._http_server import ObjectServer

pytestmark = [pytest.mark.asyncio, pytest.mark.usefixtures("clean_storage", "frozen_heap")]

FAST = asyncload.Hedge(budget=0.05, min_delay=0.02)


@pytest.fixture
def frozen_heap() -> Iterator[None]:
    """The heap frozen, as a worker's is after its start-up (``_workers/child.py``).

    In this test process the collector's full passes walk every object earlier tests left
    (torch's among them) on the loop's thread: a pause of milliseconds holds every request
    and the server's answers together, and requests pass their learned hedge delay for it.
    Run alone, this file failed the stopped-response test's "hedges went to the 4 stopped
    requests, at most 2 more" 6 times of 6 (10 hedges sent); frozen, or with the collector
    off, it passed.
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def body(i: int) -> bytes:
    return bytes([i % 251]) * 1000 + i.to_bytes(4, "big")


async def warm_up(server: ObjectServer, n: int = 40) -> None:
    """Teach the prefix its latency (and earn the budget 0.05 x n hedge tokens)."""
    urls = [server.put(f"warm/{i}", body(i)) for i in range(n)]
    for url in urls:
        await asyncload.read(url)


async def settle(server: ObjectServer) -> None:
    """Wait (bounded) until the server has no request in its handler."""
    for _ in range(200):
        if server.active == 0:
            return
        await asyncio.sleep(0.01)


@contextlib.contextmanager
def _pool_of(size: int) -> Iterator[None]:
    """New clients keep at most *size* connections, inside the block (those made meanwhile
    keep theirs after it)."""
    saved = _storage.pool_size()
    _storage.set_pool_size(size)
    try:
        yield
    finally:
        _storage.set_pool_size(saved)


async def test_a_straggler_is_hedged_and_the_fast_copy_wins(http_server: ObjectServer) -> None:
    _storage.configure(http_server.url, hedge=FAST)
    await warm_up(http_server)
    url = http_server.put("slow.bin", body(7))
    http_server.delay("slow.bin", 3.0)  # the first request straggles; the hedge does not
    began = time.monotonic()
    assert await asyncload.read(url) == body(7)
    assert time.monotonic() - began < 1.5
    assert http_server.hits["slow.bin"] == 2
    assert _hedge.counts() == _hedge.HedgeCounts(sent=1, won=1)
    # The loser was cancelled: its connection was closed, so the server dropped the request.
    await settle(http_server)
    assert http_server.active == 0
    assert http_server.cancelled == 1
    assert not _hedge._losers
    await asyncload.aclose()


async def test_the_delay_is_learned_from_requests_out_of_the_pool_s_line(
    http_server: ObjectServer,
) -> None:
    # 40 reads at once through 2 connections at 50 ms: each takes 50 ms once it has a
    # connection, and the last waited ~1 s in the pool's line for one. The delay is learned
    # from the former (the hedge timer does not run in the line either); timed from the
    # round's start, it was the line's length, and a straggler waited that long for its hedge.
    with _pool_of(2):
        policy = asyncload.Hedge(budget=0.05, min_delay=0.0)
        _storage.configure(http_server.url, hedge=policy)
        http_server.latency = 0.05
        urls = [http_server.put(f"line/{i}", body(i)) for i in range(40)]
        got, when = await _read_all(urls)
    assert got == [body(i) for i in range(40)]
    assert max(when) > 0.9  # they did wait in line
    tracker = _hedge._latency.prefix_of(urls[0], _storage.options_for(urls[0]))
    assert 0.05 <= tracker.delay < 0.3
    await asyncload.aclose()


async def test_a_redirected_request_s_latency_counts_both_round_trips(
    http_server: ObjectServer,
) -> None:
    # Each read is a 302, then the object, 50 ms each. The second hop queues for a connection
    # again; the latency still counts from the first hop's (the hedge timer saw no sign of life
    # in the 302 either). Timed from the second hop, the delay was one hop, shorter than the
    # first hop's quiet wait, and requests were hedged for nothing.
    _storage.configure(http_server.url, hedge=asyncload.Hedge(budget=0.5, min_delay=0.0))
    http_server.latency = 0.05
    urls = []
    for i in range(24):
        http_server.put(f"obj/{i}", body(i))
        http_server.fail(f"via/{i}", "redirect:/obj/" + str(i))
        urls.append(f"{http_server.url}/via/{i}")
    got, _ = await _read_all(urls, at_once=8)
    assert got == [body(i) for i in range(24)]
    assert all(http_server.hits[f"via/{i}"] == 1 for i in range(24))
    tracker = _hedge._latency.prefix_of(urls[0], _storage.options_for(urls[0]))
    assert tracker.delay >= 0.09  # two round trips of 50 ms
    await asyncload.aclose()


async def test_a_request_that_never_left_the_line_teaches_no_latency() -> None:
    loop = asyncio.get_running_loop()
    began = loop.time()
    watch = Progress(began)
    watch.queued()
    assert _round._latency(watch, loop) is None  # cancelled in the pool's line: no latency
    await asyncio.sleep(0.05)
    watch.connected()
    assert watch.out >= began + 0.04  # the line's wait is not latency
    first = watch.out
    watch.queued()  # a redirect's second hop waits for a connection again
    await asyncio.sleep(0.02)
    watch.connecting()
    assert watch.out == first
    latency = _round._latency(watch, loop)
    assert latency is not None
    assert latency >= 0.015


async def test_hedges_do_not_queue_behind_a_full_pool_of_stragglers(
    http_server: ObjectServer,
) -> None:
    # Every connection of the pool is held by a straggler: a hedge that queued for one of them
    # would wait as long as its straggler. Hedges have connections of their own.
    with _pool_of(4):
        _storage.configure(http_server.url, hedge=asyncload.Hedge(budget=0.5, min_delay=0.02))
        await warm_up(http_server)
        urls = [http_server.put(f"full/{i}", body(i)) for i in range(4)]
        for i in range(4):
            http_server.delay(f"full/{i}", 5.0)
        began = time.monotonic()
        got = await asyncio.gather(*(asyncload.read(u) for u in urls))
    assert time.monotonic() - began < 2.5  # not the stragglers' 5 s
    assert got == [body(i) for i in range(4)]
    assert _hedge.counts() == _hedge.HedgeCounts(sent=4, won=4)
    await settle(http_server)
    assert not _hedge._losers
    await asyncload.aclose()


async def test_hedges_respect_the_budget_and_never_change_bytes(
    http_server: ObjectServer,
) -> None:
    budget = asyncload.Hedge(budget=0.1, min_delay=0.02)
    _storage.configure(http_server.url, hedge=budget)
    await warm_up(http_server, 20)
    urls = [http_server.put(f"s/{i}", body(i)) for i in range(100)]
    for i in range(100):
        http_server.delay(f"s/{i}", 0.3)  # every first request straggles
    before = _stats.recorder.bytes
    sem = asyncio.Semaphore(25)

    async def one(i: int) -> bytes:
        async with sem:
            return await asyncload.read(urls[i])

    got = await asyncio.gather(*(one(i) for i in range(100)))
    assert got == [body(i) for i in range(100)]
    assert _stats.recorder.bytes - before == sum(len(body(i)) for i in range(100))
    sent = _hedge.counts().sent
    extra = sum(http_server.hits[f"s/{i}"] for i in range(100)) - 100
    # A hedge still waiting for a connection in the per-host pacer (sources/_pacing.py) when
    # its first copy wins is cancelled before it reaches the server: counted, never sent.
    assert 0 < extra <= sent
    assert sent <= 0.1 * 120  # 120 requests so far: the budget allows 12 hedges
    await settle(http_server)
    await asyncload.aclose()


async def test_with_hedging_off_requests_equal_samples(http_server: ObjectServer) -> None:
    _storage.configure(http_server.url, hedge=None)
    await warm_up(http_server)
    urls = [http_server.put(f"o/{i}", body(i)) for i in range(30)]
    for i in range(0, 30, 3):
        http_server.delay(f"o/{i}", 0.2)
    got = await asyncio.gather(*(asyncload.read(u) for u in urls))
    assert got == [body(i) for i in range(30)]
    assert sum(http_server.hits[f"o/{i}"] for i in range(30)) == 30
    assert _hedge.counts().sent == 0


async def test_a_straggling_stream_is_hedged(http_server: ObjectServer) -> None:
    _storage.configure(http_server.url, hedge=FAST)
    await warm_up(http_server)
    data = bytes(range(256)) * 400
    url = http_server.put("big.bin", data)
    http_server.delay("big.bin", 3.0)
    began = time.monotonic()
    chunks: AsyncIterator[bytes] = asyncload.stream(url, chunk_size=4096)
    assert b"".join([c async for c in chunks]) == data
    assert time.monotonic() - began < 1.5
    assert http_server.hits["big.bin"] == 2
    assert _hedge.counts().won == 1
    await settle(http_server)
    assert http_server.active == 0
    await asyncload.aclose()


async def test_hedges_and_retries_share_the_attempts(http_server: ObjectServer) -> None:
    retry = asyncload.Retry(attempts=2, backoff=0.01)
    _storage.configure(http_server.url, hedge=FAST, retry=retry)
    await warm_up(http_server)
    url = http_server.put("bad.bin", b"x")
    http_server.delay("bad.bin", 0.3)  # the first request straggles, then both answer 503
    http_server.fail("bad.bin", "503", "503")
    with pytest.raises(ServerError) as info:
        await asyncload.read(url)
    assert info.value.attempts == 2
    assert http_server.hits["bad.bin"] == 2  # the hedge was the second attempt: no retry


@pytest.mark.parametrize("fault", ["503", "429", "500"])
async def test_no_hedge_goes_to_a_prefix_that_just_throttled_or_failed(
    http_server: ObjectServer, fault: str
) -> None:
    # Issue #33: hedges on top of retries to a store that was failing made 3-5 requests per
    # key. After a 503 SlowDown (or a 429, or a 500) a prefix gets no hedges for a while: a
    # straggler then waits for its own answer, adding nothing to the overload.
    _storage.configure(http_server.url, hedge=asyncload.Hedge(budget=0.5, min_delay=0.02))
    await warm_up(http_server)
    refused = http_server.put("refused.bin", b"r")
    http_server.fail("refused.bin", fault)  # answered at once, then retried and served
    assert await asyncload.read(refused) == b"r"
    assert http_server.hits["refused.bin"] == 2
    slow = http_server.put("slow.bin", b"s")
    http_server.delay("slow.bin", 0.4)
    assert await asyncload.read(slow) == b"s"
    assert http_server.hits["slow.bin"] == 1  # not hedged
    assert _hedge.counts().sent == 0
    # Once the prefix has been quiet for latency.HUSH, stragglers are hedged again.
    await asyncio.sleep(_hedge._latency.HUSH + 0.1)
    later = http_server.put("later.bin", b"l")
    http_server.delay("later.bin", 0.4)
    assert await asyncload.read(later) == b"l"
    assert http_server.hits["later.bin"] == 2
    assert _hedge.counts().sent == 1
    await settle(http_server)
    await asyncload.aclose()


async def test_one_attempt_means_no_hedge(http_server: ObjectServer) -> None:
    _storage.configure(http_server.url, hedge=FAST, retry=asyncload.Retry(attempts=1))
    await warm_up(http_server)
    url = http_server.put("slow.bin", b"y" * 10)
    http_server.delay("slow.bin", 0.2)
    assert await asyncload.read(url) == b"y" * 10
    assert http_server.hits["slow.bin"] == 1


async def test_hedge_options_are_checked() -> None:
    with pytest.raises(ValueError, match="budget"):
        asyncload.Hedge(budget=0)
    with pytest.raises(ValueError, match="percentile"):
        asyncload.Hedge(percentile=1.0)
    with pytest.raises(TypeError, match="hedge must be"):
        asyncload.StorageOptions(hedge=0.05)  # type: ignore[arg-type]


async def test_a_straggler_sent_before_latencies_are_learned_is_hedged(
    http_server: ObjectServer,
) -> None:
    # A fresh worker sends its first wave at once, before any latency is known: a straggler
    # in it is hedged once the others have taught the prefix its delay.
    # The others' latencies spread (jitter), as a real wave's do: the budget must still reach
    # the straggler, not requests that are merely slower than the fastest twenty.
    _storage.configure(http_server.url, hedge=asyncload.Hedge(budget=0.2, min_delay=0.02))
    http_server.latency = 0.02
    http_server.jitter = 0.03
    urls = [http_server.put(f"w/{i}", body(i)) for i in range(40)]
    http_server.delay("w/0", 3.0)
    began = time.monotonic()
    got = await asyncio.gather(*(asyncload.read(u) for u in urls))
    assert got == [body(i) for i in range(40)]
    assert time.monotonic() - began < 1.5
    assert http_server.hits["w/0"] == 2
    assert _hedge.counts().won >= 1
    assert _hedge.counts().sent <= 0.2 * 40  # the budget: 8 hedges for 40 requests
    # The loser was cancelled and its connection released, as for a learned prefix.
    await settle(http_server)
    assert http_server.active == 0
    assert not _hedge._losers
    await asyncload.aclose()


async def test_the_first_waves_hedges_go_to_its_straggler_not_to_its_queue() -> None:
    # No network: a wave of 40 requests sent at once, before any latency is known. The first
    # 20 answer in 10 ms; the rest waited for a connection and answer late in turn (as a
    # paced pool's queue does); one, the 6th sent, straggles for 2 s, and its hedge does not.
    policy = asyncload.Hedge(budget=0.2, min_delay=0.02)
    tracker = _hedge._Prefix(_storage.StorageOptions(hedge=policy))
    calls = [0] * 40

    def request(rank: int) -> Callable[[], Awaitable[int]]:
        async def start() -> int:
            calls[rank] += 1
            if rank == 5 and calls[rank] == 1:
                await asyncio.sleep(2.0)
            elif rank >= 20:
                await asyncio.sleep(0.1 + 0.02 * (rank - 20) if calls[rank] == 1 else 0.01)
            else:
                await asyncio.sleep(0.01)
            return rank

        return start

    began = time.monotonic()
    got = await asyncio.gather(*(_hedge._race(request(r), tracker, policy, 1) for r in range(40)))
    assert [value for value, _ in got] == list(range(40))
    assert time.monotonic() - began < 1.0  # the straggler's hedge answered
    assert calls[5] == 2
    # The queued requests outlived twice the first delay, but not their own wave's pace.
    assert sum(calls) - 40 == 1
    await _hedge.drain()


def _learned(delay: float = 0.02) -> tuple[_hedge._Prefix, asyncload.Hedge]:
    """A tracker whose delay is known and whose budget holds a hedge or two."""
    policy = asyncload.Hedge(budget=0.5, min_delay=delay)
    tracker = _hedge._Prefix(_storage.StorageOptions(hedge=policy))
    for _ in range(40):
        tracker.observe(0.001, policy)
        tracker.earn(policy)
    assert tracker.delay == delay
    return tracker, policy


class Copies:
    """Start functions for a request: each call is one copy; which ran, and how each ended."""

    def __init__(self, *behaviours: Callable[[], Awaitable[str]]) -> None:
        self.behaviours = list(behaviours)
        self.ended: list[str] = []

    def __call__(self) -> Awaitable[str]:
        behaviour = self.behaviours.pop(0)

        async def copy() -> str:
            try:
                value = await behaviour()
            except asyncio.CancelledError:
                self.ended.append("cancelled")
                raise
            except Exception as exc:
                self.ended.append(type(exc).__name__)
                raise
            self.ended.append(value)
            return value

        return copy()


def after(seconds: float, value: str = "", fail: Exception | None = None) -> Callable[[], Any]:
    async def run() -> str:
        await asyncio.sleep(seconds)
        if fail is not None:
            raise fail
        return value

    return run


def recording(seconds: float, value: str, tasks: list[asyncio.Task[Any] | None]) -> Any:
    async def run() -> str:
        tasks.append(asyncio.current_task())
        await asyncio.sleep(seconds)
        return value

    return run


@pytest.mark.skipif(sys.version_info < (3, 11), reason="Task.uncancel()")
async def test_once_the_delay_is_known_only_a_hedge_gets_a_task_of_its_own() -> None:
    # A task per request put two turns of a busy loop between a response and its caller.
    tracker, policy = _learned()
    tasks: list[asyncio.Task[Any] | None] = []
    copies = Copies(recording(5.0, "primary", tasks), recording(0.01, "hedge", tasks))
    task = asyncio.current_task()
    assert task is not None
    assert await _hedge._race(copies, tracker, policy, 1) == ("hedge", 2)
    assert tasks[0] is task
    assert tasks[1] is not task
    await _hedge.drain()
    assert copies.ended == ["hedge", "cancelled"]
    assert task.cancelling() == 0
    await asyncio.sleep(0)  # and no cancellation left pending either


@pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio.timeout, Task.cancelling()")
async def test_a_hedge_that_wins_leaves_its_callers_task_as_it_was() -> None:
    # The primary is cancelled when the hedge answers: the caller must not see that
    # cancellation, nor may an enclosing timeout count it.
    tracker, policy = _learned()
    copies = Copies(after(5.0, "primary"), after(0.01, "hedge"))
    async with asyncio.timeout(3.0):
        got = await _hedge._race(copies, tracker, policy, 1)
    assert got == ("hedge", 2)
    await _hedge.drain()
    assert copies.ended == ["hedge", "cancelled"]
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
    assert _hedge.counts() == _hedge.HedgeCounts(sent=1, won=1)
    await asyncio.sleep(0.05)  # nothing cancels this task later either


async def test_the_primary_that_wins_cancels_its_hedge() -> None:
    tracker, policy = _learned()
    copies = Copies(after(0.1, "primary"), after(5.0, "hedge"))
    assert await _hedge._race(copies, tracker, policy, 1) == ("primary", 2)
    await _hedge.drain()
    assert copies.ended == ["primary", "cancelled"]
    assert not _hedge._losers


async def test_cancelling_the_caller_cancels_both_copies() -> None:
    tracker, policy = _learned()
    copies = Copies(after(5.0, "primary"), after(5.0, "hedge"))
    task = asyncio.ensure_future(_hedge._race(copies, tracker, policy, 1))
    await asyncio.sleep(0.1)  # the hedge went out after 20 ms
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _hedge.drain()
    assert copies.ended == ["cancelled", "cancelled"]


async def test_a_straggler_the_budget_refused_asks_again_and_is_hedged() -> None:
    # The bucket is empty at the straggler's first delay; a token comes back later (as other
    # requests earn them). The straggler asks again every delay, each time with more of the
    # bucket open to it, and takes it.
    tracker, policy = _learned()
    tracker.tokens = 0.25  # 0.75 once this request has earned its 0.5: no hedge at first

    async def a_token_comes_back() -> None:
        await asyncio.sleep(0.05)  # after two or three delays of 20 ms
        tracker.tokens += 1.0

    copies = Copies(after(5.0, "primary"), after(0.01, "hedge"))
    refill = asyncio.ensure_future(a_token_comes_back())
    # Never the primary's 5 s.
    assert await asyncio.wait_for(_hedge._race(copies, tracker, policy, 1), 2.0) == ("hedge", 2)
    await refill
    assert tracker.tokens == pytest.approx(0.75)
    await _hedge.drain()
    assert copies.ended == ["hedge", "cancelled"]


async def test_a_refused_request_asks_at_most_every_poll_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A small min_delay lets the delay be ~1 ms (or 0): asking again must not spin the loop.
    tracker, _ = _learned(delay=0.001)
    tracker.tokens = 0.0
    policy = asyncload.Hedge(budget=1e-6, min_delay=0.001)  # earns next to nothing
    asks = 0
    spend = _hedge._Prefix.spend

    def counted(self: _hedge._Prefix, reserve: int = 0) -> bool:
        nonlocal asks
        asks += 1
        return spend(self, reserve)

    monkeypatch.setattr(_hedge._Prefix, "spend", counted)
    copies = Copies(after(0.2, "primary"))
    assert await _hedge._race(copies, tracker, policy, 1) == ("primary", 1)
    assert 1 <= asks <= 0.2 / _hedge._LEARNING_POLL + 2


async def test_a_refused_straggler_cancelled_while_asking_is_still_observed() -> None:
    # Its latency is at least what it waited: leaving it out would pull the percentile down.
    tracker, policy = _learned()
    tracker.tokens = 0.0
    finished = tracker.finished
    copies = Copies(after(5.0, "primary"))
    task = asyncio.ensure_future(_hedge._race(copies, tracker, policy, 1))
    await asyncio.sleep(0.1)  # refused at 20 ms, asking since
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _hedge.drain()
    assert copies.ended == ["cancelled"]
    assert tracker.finished == finished + 1


async def test_a_request_slightly_over_its_delay_leaves_the_reserve() -> None:
    # One request in twenty outlives a p95 delay by a little: at its first ask it may not take
    # the tokens kept for stragglers, and it answers before its next ask.
    tracker, policy = _learned(delay=0.1)
    tracker.tokens = 3.25  # + 0.5 earned: under the 1 + _RESERVE (3) that a first ask wants
    copies = Copies(after(0.15, "primary"), after(0.01, "hedge"))
    assert await _hedge._race(copies, tracker, policy, 1) == ("primary", 1)
    assert copies.ended == ["primary"]
    assert _hedge.counts().sent == 0


async def test_a_404_from_the_hedge_ends_the_round_and_counts_two_requests() -> None:
    tracker, policy = _learned()
    missing = AttemptFailed(NotFound, "missing", status=404)
    copies = Copies(after(5.0, "primary"), after(0.01, fail=missing))
    with pytest.raises(AttemptFailed) as caught:
        await _hedge._race(copies, tracker, policy, 1)
    assert caught.value is missing
    assert caught.value.requests == 2
    await _hedge.drain()
    assert copies.ended == ["AttemptFailed", "cancelled"]
    assert getattr(asyncio.current_task(), "cancelling", lambda: 0)() == 0


async def test_a_retryable_failure_waits_for_the_hedge() -> None:
    tracker, policy = _learned()
    busy = AttemptFailed(ServerError, "busy", status=503, retryable=True)
    copies = Copies(after(0.05, fail=busy), after(0.1, "hedge"))
    assert await _hedge._race(copies, tracker, policy, 1) == ("hedge", 2)
    assert copies.ended == ["AttemptFailed", "hedge"]
    assert _hedge.counts().won == 1


def _slow_down() -> AttemptFailed:
    return AttemptFailed(ServerError, "slow down", status=503, retryable=True, reason="SlowDown")


def _stamped(started: list[float], behaviour: Callable[[], Awaitable[str]]) -> Any:
    """*behaviour*, noting when it started (``time.monotonic``) in *started*."""

    async def run() -> str:
        started.append(time.monotonic())
        return await behaviour()

    return run


def _round_kind(monkeypatch: pytest.MonkeyPatch, in_place: bool) -> None:
    if not in_place:
        monkeypatch.setattr(_round, "_IN_PLACE", False)
    elif sys.version_info < (3, 11):
        pytest.skip("Task.uncancel()")


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "task"])
@pytest.mark.parametrize("throttled", ["primary", "hedge"])
async def test_a_throttle_one_copy_met_is_heard_though_the_other_answers(
    monkeypatch: pytest.MonkeyPatch, in_place: bool, throttled: str
) -> None:
    # Issue #33: the round ends with the other copy's answer, so the retry loop never judges
    # the 503: the stats, the engine's in-flight limit and the prefix's hedges must hear it all
    # the same (two loaders counted one throttle fewer than their store had answered).
    _round_kind(monkeypatch, in_place)
    tracker, policy = _learned()
    started: list[float] = []
    if throttled == "primary":  # fails after its hedge went out (at 20 ms); the hedge answers
        copies = Copies(
            _stamped(started, after(0.05, fail=_slow_down())), _stamped(started, after(0.1, "h"))
        )
    else:  # the hedge is told to slow down at once; the primary answers later
        copies = Copies(
            _stamped(started, after(0.1, "p")), _stamped(started, after(0.0, fail=_slow_down()))
        )
    told: list[tuple[float, float | None]] = []
    rec = _metrics.Recorder(on_throttle=lambda sent, after: told.append((sent, after)))
    began = time.monotonic()
    with _metrics.use(rec):
        got = await _hedge._race(copies, tracker, policy, 1)
    await _hedge.drain()
    assert got == ("h" if throttled == "primary" else "p", 2)
    assert rec.counts["throttled"] == 1
    assert len(told) == 1
    # Dated by when its own copy went out: the hedge a delay after the primary.
    if throttled == "primary":  # the primary in place: dated from when its round began
        assert began <= told[0][0] <= started[1]
    else:
        assert told[0][0] > started[0]
    assert tracker.quiet_until >= began + _hedge._latency.HUSH  # no hedges to it for a while


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "task"])
async def test_each_copy_is_heard_once_and_the_retry_loop_hears_the_round_no_more(
    monkeypatch: pytest.MonkeyPatch, in_place: bool
) -> None:
    # Both copies throttled, with one failure object (a backend may keep one): two answers,
    # two throttles. The round raises that failure, and the retry loop that judges it next
    # (next_wait) must not count it a third time; judged, a later answer with it is new.
    _round_kind(monkeypatch, in_place)
    tracker, policy = _learned()
    busy = _slow_down()
    copies = Copies(after(0.05, fail=busy), after(0.0, fail=busy))
    rec = _metrics.Recorder()
    retry = asyncload.Retry(backoff=0.0)
    with _metrics.use(rec):
        with pytest.raises(AttemptFailed) as caught:
            await _hedge._race(copies, tracker, policy, 1)
        assert caught.value is busy
        assert caught.value.requests == 2
        assert rec.counts["throttled"] == 2
        assert _retry.next_wait(busy, retry, 2, time.monotonic()) is not None
        assert rec.counts["throttled"] == 2
        _retry.next_wait(busy, retry, 3, time.monotonic())  # raised again: a new answer
        assert rec.counts["throttled"] == 3
    await _hedge.drain()


async def test_a_hedge_throttled_by_the_store_is_counted_once_and_hushes_the_prefix(
    http_server: ObjectServer,
) -> None:
    # End to end: the primary straggles, its hedge gets the store's 503 at once, the primary
    # answers. The throttle is counted once; the next straggler is not hedged.
    _storage.configure(http_server.url, hedge=asyncload.Hedge(budget=0.5, min_delay=0.02))
    await warm_up(http_server)
    before = _metrics.recorder.counts["throttled"]
    url = http_server.put("busy.bin", b"b")
    http_server.delay("busy.bin", 0.3)  # the primary's
    http_server.fail("busy.bin", "503")  # taken by the first to be answered: the hedge
    assert await asyncload.read(url) == b"b"
    assert http_server.hits["busy.bin"] == 2
    assert _hedge.counts().sent == 1
    assert _metrics.recorder.counts["throttled"] - before == 1
    slow = http_server.put("slow.bin", b"s")
    http_server.delay("slow.bin", 0.3)
    assert await asyncload.read(slow) == b"s"
    assert http_server.hits["slow.bin"] == 1  # hushed: not hedged
    await settle(http_server)
    await asyncload.aclose()


@pytest.mark.skipif(sys.version_info < (3, 11), reason="Task.cancelling(), Task.uncancel()")
async def test_a_cancellation_from_outside_with_the_hedges_answer_is_kept() -> None:
    tracker, policy = _learned()
    caller: asyncio.Future[Any] | None = None

    async def hedge_then_cancel_the_caller() -> str:
        await asyncio.sleep(0.01)
        # Runs right after the race's own callback: both cancellations land in one loop turn.
        this = asyncio.current_task()
        assert this is not None
        assert caller is not None
        this.add_done_callback(lambda _: caller.cancel())
        return "hedge"

    copies = Copies(after(5.0, "primary"), hedge_then_cancel_the_caller)
    caller = asyncio.ensure_future(_hedge._race(copies, tracker, policy, 1))
    with pytest.raises(asyncio.CancelledError):
        await caller
    await _hedge.drain()
    assert copies.ended == ["hedge", "cancelled"]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="Task.cancelling(), Task.uncancel()")
async def test_a_cancellation_caught_earlier_does_not_turn_a_hedges_answer_into_one() -> None:
    task = asyncio.current_task()
    assert task is not None
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.sleep(1.0)
    assert task.cancelling() == 1  # caught and not withdrawn, as some code does
    tracker, policy = _learned()
    copies = Copies(after(5.0, "primary"), after(0.01, "hedge"))
    assert await _hedge._race(copies, tracker, policy, 1) == ("hedge", 2)
    assert task.cancelling() == 1
    task.uncancel()


async def test_a_hedge_that_answered_in_the_turn_its_primary_failed_is_taken() -> None:
    # The hedge's answer lands first, the primary's 503 in the same loop turn, before the
    # hedge's done callback has run: the answer is used, not a retry sent.
    tracker, policy = _learned()
    futures: list[asyncio.Future[str]] = []
    both_out = asyncio.Event()

    async def copy() -> str:
        futures.append(asyncio.get_running_loop().create_future())
        if len(futures) == 2:
            both_out.set()
        return await futures[-1]

    async def settle_both() -> None:
        await both_out.wait()
        futures[1].set_result("hedge")
        futures[0].set_exception(AttemptFailed(asyncload.ServerError, "503", retryable=True))

    driver = asyncio.ensure_future(settle_both())
    assert await asyncio.wait_for(_hedge._race(copy, tracker, policy, 2), 5) == ("hedge", 2)
    await driver
    assert _hedge.counts() == _hedge.HedgeCounts(sent=1, won=1)


async def test_a_hedge_that_straggles_too_gets_one_more_copy() -> None:
    # One hedge in a hundred straggles as well: with attempts to spare, a round sends a second
    # hedge a delay after the first, and the first copy to answer wins.
    tracker, policy = _learned()
    copies = Copies(after(5.0, "primary"), after(5.0, "hedge"), after(0.01, "second hedge"))
    got = await asyncio.wait_for(_hedge._race(copies, tracker, policy, 2), 2.0)
    assert got == ("second hedge", 3)
    await _hedge.drain()
    assert copies.ended == ["second hedge", "cancelled", "cancelled"]
    assert _hedge.counts() == _hedge.HedgeCounts(sent=2, won=1)


async def test_one_attempt_to_spare_means_one_hedge_at_most() -> None:
    tracker, policy = _learned()
    copies = Copies(after(0.3, "primary"), after(5.0, "hedge"))  # a third copy would fail
    assert await _hedge._race(copies, tracker, policy, 1) == ("primary", 2)
    await _hedge.drain()
    assert copies.ended == ["primary", "cancelled"]
    assert _hedge.counts().sent == 1


# -- issue #33: a response that stops making progress is hedged; one that flows is not -----


async def _read_all(urls: list[str], at_once: int = 0) -> tuple[list[bytes], list[float]]:
    """Read *urls* all at once (one wave), or *at_once* at a time; the answers, and when each
    came (seconds from the start)."""
    began = time.monotonic()
    line = asyncio.Semaphore(at_once or len(urls))

    async def one(url: str) -> tuple[bytes, float]:
        async with line:
            data = await asyncload.read(url)
        return data, time.monotonic() - began

    got = await asyncio.gather(*(one(u) for u in urls))
    return [data for data, _ in got], [when for _, when in got]


async def _released(server: ObjectServer, seconds: float = 2.0) -> bool:
    """Whether the server has no request left in its handler within *seconds* (bounded)."""
    for _ in range(int(seconds / 0.01)):
        if server.active == 0:
            return True
        await asyncio.sleep(0.01)
    return server.active == 0


@pytest.mark.timeout(40)
@pytest.mark.parametrize("learned", [False, True], ids=["first-wave", "learned"])
@pytest.mark.parametrize("fault", ["body", "headers"])
async def test_a_response_that_stops_is_hedged_and_its_connection_released(
    http_server: ObjectServer, learned: bool, fault: str
) -> None:
    # Issue #33: among 100 objects read at once, 4 whose first request stops for far longer
    # than the test, either after its headers (the body stalls) or before them (the server
    # accepted and says nothing). Each is hedged, within the budget, long before the read
    # timeout; the others flow meanwhile; the stopped losers' connections are closed. Before,
    # a fresh prefix's first wave hedged none of its last 4 (nothing sent after them could
    # overtake them) and they waited for the read timeout; a learned prefix gave most of its
    # budget to requests waiting in the pool's line for a connection, which are no stragglers
    # (here 6 of its 10 tokens; with fewer tokens, 2 of the 4 waited for the read timeout).
    # 50 ms requests and a 150 ms floor: one that a busy machine slowed by some tens of ms is
    # no straggler here (at 10 ms and a 20 ms floor, a loaded CI hedged five of them too). The
    # line still holds the wave's last requests ~0.35 s, longer than the floor.
    budget = asyncload.Hedge(budget=0.05, min_delay=0.15)
    _storage.configure(http_server.url, hedge=budget, read_timeout=30.0 if fault == "body" else 2.0)
    http_server.latency, http_server.jitter = 0.05, 0.01
    warm = 100 if learned else 0
    if learned:  # the delay learned at the pool's concurrency; then a wave six times that
        warm_urls = [http_server.put(f"warm/{i}", body(i)) for i in range(warm)]
        with _pool_of(16):  # the clients made meanwhile keep their 16
            assert (await _read_all(warm_urls, 16))[0] == [body(i) for i in range(warm)]
    urls = [http_server.put(f"stop/{i}", body(i)) for i in range(100)]
    stopped = [3, 50, 98, 99] if learned else [96, 97, 98, 99]  # a wave's last: no one after
    for i in stopped:
        if fault == "body":
            http_server.fail(f"stop/{i}", "stall:20")  # headers, then nothing
        else:
            http_server.delay(f"stop/{i}", 20.0)  # nothing at all
    got, when = await _read_all(urls)
    assert got == [body(i) for i in range(100)]
    assert max(when) < 1.5  # not the read timeout (30 s, or 2 s), nor the 20 s stall
    hits = [http_server.hits[f"stop/{i}"] for i in range(100)]
    # Each hedged, none retried: a request per copy, within the round's copies (a hedge that
    # straggles too gets one more, _MAX_HEDGES) and the budget.
    assert all(2 <= hits[i] <= 1 + _round._MAX_HEDGES for i in stopped)
    assert max(hits) <= 1 + _round._MAX_HEDGES
    counts = _hedge.counts()
    assert counts.won >= len(stopped)
    assert sum(hits) - 100 <= counts.sent <= budget.budget * (100 + warm)
    # The budget went to them, not to the requests waiting for one of the pool's 16
    # connections (before: all 10 tokens, 6 of them on the line).
    assert counts.sent <= len(stopped) + 2
    # The stopped losers were cancelled and their connections closed: the server's handlers,
    # which would have waited 20 s, were ended by the disconnects.
    assert await _released(http_server)
    assert http_server.cancelled >= len(stopped)
    await _hedge.drain()
    assert not _hedge._losers
    await asyncload.aclose()


@pytest.mark.timeout(30)
async def test_a_body_that_flows_slowly_is_not_hedged(http_server: ObjectServer) -> None:
    # A response whose bytes keep coming is no straggler, however long it takes: a copy would
    # only add its transfer to the load. Its hedge timer finds progress and looks again later.
    _storage.configure(http_server.url, hedge=asyncload.Hedge(budget=0.5, min_delay=0.3))
    await warm_up(http_server)
    url = http_server.put("flows.bin", body(5))
    http_server.fail("flows.bin", "trickle:1.2")  # 25 pieces 48 ms apart: 4 delays in all
    assert await asyncload.read(url) == body(5)
    assert http_server.hits["flows.bin"] == 1
    assert _hedge.counts().sent == 0
    # The same response stopping for longer than the delay is hedged.
    stops = http_server.put("stops.bin", body(6))
    http_server.fail("stops.bin", "stall:20")
    began = time.monotonic()
    assert await asyncload.read(stops) == body(6)
    assert time.monotonic() - began < 3.0
    assert http_server.hits["stops.bin"] == 2
    assert await _released(http_server)
    await asyncload.aclose()


async def test_a_hundred_requests_at_five_percent_earn_five_whole_hedges() -> None:
    # 100 x 0.05 adds up to 4.99999999999999: its fifth token must still buy a hedge (the
    # last stragglers of an epoch, which earns no more, waited for the read timeout instead).
    policy = asyncload.Hedge(budget=0.05)
    tracker = _hedge._Prefix(_storage.StorageOptions(hedge=policy))
    for _ in range(100):
        tracker.earn(policy)
    assert tracker.tokens < 5.0
    assert [tracker.spend() for _ in range(6)] == [True] * 5 + [False]
