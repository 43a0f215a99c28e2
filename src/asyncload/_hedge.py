"""Hedged reads: a second identical GET when the first one straggles; the first answer wins.

Object stores have long per-request tails (one request in a hundred takes ten times the
median). Waiting for a straggler holds a whole batch, so ``read`` and ``open_stream``
race a *hedge*: when a request has not answered within the delay (a high percentile of the
recent latencies of its prefix, never below a floor), an identical request is sent, whichever
finishes first is used, and the other is cancelled. A hedge that straggles too gets one more
copy a delay later (``_MAX_HEDGES``). Cancelling releases the loser's response,
and aiohttp closes a connection whose body was not read to the end, so nothing leaks; bytes are
counted by the caller from the winner only. A hedge goes out on connections of its own
(``sources._base.hedging``): it is sent when its primary's pool is busiest. A request sent
before the prefix's delay is known (the first wave of a fresh worker) is hedged too, once it is
slow twice over (see ``_straggles``).

Costs are bounded twice. A token bucket per prefix earns ``Hedge.budget`` tokens per
request and a hedge spends one, so hedges never exceed ``budget x requests`` (plus nothing: the
bucket starts empty). A request the bucket refused asks again every delay, and the longer it is
out the more of the bucket is open to it (``_RESERVE``), so the budget goes to real stragglers
first. And a hedge is an attempt of the [`Retry`][asyncload.Retry] policy: a
request with ``attempts=1`` is never hedged, and a round uses one attempt per copy it sent.

Counters (hedges sent and won, per process) are read with ``counts``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from ._metrics import note_count
from ._retry import AttemptFailed, Hedge, backoff, give_up, next_wait
from .sources._base import hedging

if TYPE_CHECKING:
    from .sources._base import Backend, Resume, StorageOptions

__all__ = ["Hedge", "HedgeCounts", "counts", "open_stream", "read", "reset"]

T = TypeVar("T")

# Latencies kept per prefix, and how often the percentile is recomputed from them: a sort of
# 512 floats every 64 requests is well under a microsecond per request.
_WINDOW = 512
_RECOMPUTE_EVERY = 64
# Before this many observations the percentile means little: no hedging yet.
_MIN_SAMPLES = 20
# How often a request sent before the delay was learned looks whether it is due (at least), and
# how many requests sent after it must have finished first (see _straggles).
_LEARNING_POLL = 0.02
_OVERTAKEN = 4
# _RESERVE: by its definition, one request in twenty outlives a p95 delay, mostly by a little,
# and those would spend a 5% budget whole. A request the bucket refused asks again every delay
# (tokens come back with every request), and at its first ask it leaves this many tokens in the
# bucket, at its second one fewer, and so on: the longer a request is out, the surer it is a
# straggler. The end of an epoch earns no more tokens (no more requests), and its last
# stragglers need some.
_RESERVE = 3
# Hedges one round may send: a second one when the first straggles too (see _race).
_MAX_HEDGES = 2
# Tokens a quiet prefix may save up, so a burst of stragglers after a calm period is bounded.
_MAX_TOKENS = 10.0
_MAX_PREFIXES = 1024
# Backends where a second request cannot beat the first (the local disk).
_UNHEDGED_SCHEMES = ("", "file")


@dataclass(frozen=True, slots=True)
class HedgeCounts:
    """Hedges this process has sent and won (the hedge answered first) since it started."""

    sent: int
    won: int


_sent = 0
_won = 0


def counts() -> HedgeCounts:
    """Hedges sent and won by this process; a loader's pass reports its own in ``stats()``."""
    return HedgeCounts(sent=_sent, won=_won)


class _Prefix:
    """Recent latencies and the hedge token bucket of one prefix."""

    __slots__ = (
        "delay",
        "filled",
        "finished",
        "latencies",
        "next",
        "options",
        "since",
        "started",
        "tokens",
    )

    def __init__(self, options: StorageOptions) -> None:
        self.options = options  # the key holds its id(): keep it alive, and check it is the same
        self.latencies = [0.0] * _WINDOW
        self.next = 0
        self.filled = 0
        self.since = 0
        self.delay = float("inf")
        self.tokens = 0.0
        self.started = 0  # requests sent, and requests answered (or failed), ever
        self.finished = 0

    def observe(self, seconds: float, policy: Hedge) -> None:
        self.finished += 1
        self.latencies[self.next] = seconds
        self.next = (self.next + 1) % _WINDOW
        self.filled = min(self.filled + 1, _WINDOW)
        self.since += 1
        if self.since >= _RECOMPUTE_EVERY or (
            self.filled >= _MIN_SAMPLES and self.delay == float("inf")
        ):
            self.since = 0
            recent = sorted(self.latencies[: self.filled])
            q = recent[min(len(recent) - 1, int(policy.percentile * len(recent)))]
            self.delay = max(policy.min_delay, q) if self.filled >= _MIN_SAMPLES else float("inf")

    def earn(self, policy: Hedge) -> None:
        self.tokens = min(_MAX_TOKENS, self.tokens + policy.budget)

    def spend(self, reserve: int = 0) -> bool:
        """Take a token for a hedge, leaving *reserve* tokens in the bucket (see ``_RESERVE``)."""
        if self.tokens < 1.0 + reserve:
            return False
        self.tokens -= 1.0
        return True


_prefixes: dict[tuple[int, str], _Prefix] = {}


def _prefix_of(url: str, options: StorageOptions) -> _Prefix:
    # One tracker per configured prefix (its options object) and origin (scheme://host/ or
    # bucket): the default options serve every unconfigured host, whose latencies differ.
    slash = url.find("/", url.find("://") + 3)
    key = (id(options), url if slash < 0 else url[:slash])
    tracker = _prefixes.get(key)
    if tracker is None or tracker.options is not options:
        if len(_prefixes) >= _MAX_PREFIXES:
            _prefixes.clear()
        tracker = _prefixes[key] = _Prefix(options)
    return tracker


def reset() -> None:
    """Forget every learned latency and zero the counters (tests)."""
    global _sent, _won
    _prefixes.clear()
    _sent = _won = 0


def applies(url: str, options: StorageOptions) -> bool:
    """Whether reads of *url* are hedged under *options*."""
    if options.hedge is None:
        return False
    return not url.startswith(("file:", "FILE:", "/")) and "://" in url


def _send(start: Callable[[], Awaitable[T]]) -> asyncio.Future[T]:
    """The hedge, in a task of its own that the backend knows for one (``hedging``); counted."""
    global _sent
    _sent += 1
    note_count("hedges_sent")
    token = hedging.set(True)  # the task copies this context
    try:
        return asyncio.ensure_future(start())
    finally:
        hedging.reset(token)


_losers: set[asyncio.Future[object]] = set()


def _discard(fut: asyncio.Future[object]) -> None:
    _losers.discard(fut)
    if not fut.cancelled():
        fut.exception()  # retrieved: a loser's failure is not an error anyone should see


async def _settles(fut: asyncio.Future[T], timeout: float) -> bool:
    """Whether *fut* is done within *timeout* seconds (it is not cancelled either way).

    ``asyncio.wait((fut,), timeout=...)`` does this on every request's path; this does it with
    one waiter, one timer and no sets (~2x cheaper).
    """
    if fut.done():
        return True
    loop = fut.get_loop()
    waiter: asyncio.Future[None] = loop.create_future()

    def wake(_: object = None) -> None:
        if not waiter.done():
            waiter.set_result(None)

    timer = loop.call_later(timeout, wake)
    fut.add_done_callback(wake)
    try:
        await waiter
    finally:
        timer.cancel()
        fut.remove_done_callback(wake)
    return fut.done()


def _cancel(fut: asyncio.Future[T]) -> None:
    if fut.done():
        if not fut.cancelled():
            fut.exception()
        return
    fut.cancel()
    # Keep a reference until the cancellation has run the loser's cleanup (response released).
    _losers.add(fut)  # type: ignore[arg-type]
    fut.add_done_callback(_discard)  # type: ignore[arg-type]


async def drain() -> None:
    """Wait until every cancelled loser of this loop has finished cleaning up (before closing
    clients). Losers of a loop that closed meanwhile were finalized with it: forgotten."""
    loop = asyncio.get_running_loop()
    for fut in [f for f in _losers if f.get_loop().is_closed()]:
        _losers.discard(fut)
    while mine := [f for f in _losers if f.get_loop() is loop]:
        await asyncio.wait(mine)


async def _straggles(
    primary: asyncio.Future[T], tracker: _Prefix, policy: Hedge, began: float, rank: int
) -> bool:
    """For a request sent before its prefix's delay was learned: wait until *primary* is due a
    hedge; whether it is still running then.

    A fresh worker sends its first few hundred requests at once; *rank* went before this one.
    It looks again every ``min_delay`` (20 ms at least), and is due only when it is slow twice
    over: at twice the delay (the first estimate comes from the fastest of that wave), and once
    requests sent after it have overtaken it (four more have finished than went before it). A
    request that waited in line for a connection is not overtaken, so the budget goes to the
    wave's real stragglers. Without this a straggler of the first wave, often in the first
    batch, would hold it its whole 0.5-2 s.
    """
    loop = asyncio.get_running_loop()
    while True:
        delay = tracker.delay
        if delay == float("inf") or tracker.finished - rank < _OVERTAKEN:
            timeout = max(policy.min_delay, _LEARNING_POLL)
        else:
            timeout = began + 2 * delay - loop.time()
            if timeout <= 0:
                return not primary.done()
        if await _settles(primary, timeout):
            return False


async def _race(
    start: Callable[[], Awaitable[T]], tracker: _Prefix, policy: Hedge, spare: int
) -> tuple[T, int]:
    """One round: the request, and hedges if it straggles. Returns (result, requests sent).

    Raises the round's ``AttemptFailed`` with ``requests`` set to the requests it used.
    """
    global _won
    loop = asyncio.get_running_loop()
    began = loop.time()
    delay = tracker.delay
    rank = tracker.started  # requests of this prefix sent before this one
    tracker.started += 1
    tracker.earn(policy)
    if spare < 1:
        # Nothing to race: no task, the request runs in the caller's.
        try:
            result = await start()
        except AttemptFailed:
            tracker.observe(loop.time() - began, policy)
            raise
        tracker.observe(loop.time() - began, policy)
        return result, 1
    primary: asyncio.Future[T] = asyncio.ensure_future(start())
    straggles = False
    try:
        if delay != float("inf"):  # the usual case: one wait, in this coroutine
            straggles, asks = not await _settles(primary, delay), 0
        else:  # slow twice over when it returns: the whole bucket is open to it
            straggles, asks = await _straggles(primary, tracker, policy, began, rank), _RESERVE
        # Refused: ask again a delay later (never sooner than _LEARNING_POLL: min_delay may be
        # 0), more of the bucket open each time (_RESERVE).
        while straggles and not tracker.spend(max(0, _RESERVE - asks)):
            wait = max(tracker.delay, _LEARNING_POLL)
            straggles, asks = not await _settles(primary, wait), asks + 1
    except BaseException:
        if straggles:  # a straggler cancelled while it asked: its latency is at least this
            tracker.observe(loop.time() - began, policy)
        _cancel(primary)
        raise
    if not straggles:
        try:
            result = await primary
        finally:
            tracker.observe(loop.time() - began, policy)
        return result, 1
    copies: list[asyncio.Future[T]] = [primary, _send(start)]
    pending: set[asyncio.Future[T]] = set(copies)
    failure: AttemptFailed | None = None
    # A hedge straggles too, one time in a hundred: with ~40 stragglers a run, one of them in
    # three. Both copies then hold their batch until the primary answers (0.5-2 s). So a round
    # may send one more copy, a delay after the last, when the attempts and the bucket allow.
    most = 1 + min(spare, _MAX_HEDGES)
    last = loop.time()
    try:
        while pending:
            timeout, delay = None, tracker.delay
            # A hedge goes out once the delay is known (_straggles), and it stays known; uvloop
            # would refuse an infinite timeout all the same.
            if len(copies) < most and delay != float("inf"):
                timeout = max(last + max(delay, _LEARNING_POLL) - loop.time(), 0)
            done, pending = await asyncio.wait(
                pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
            if not done:  # every copy out still straggles: another one, if a token is left
                last = loop.time()
                if tracker.spend():
                    copies.append(_send(start))
                    pending.add(copies[-1])
                continue
            # Several may be done in one wake-up: prefer a success, and the earlier copy.
            for fut in sorted(done, key=copies.index):
                exc = fut.exception()
                if exc is None:
                    if fut is not primary:
                        _won += 1
                        note_count("hedges_won")
                    return fut.result(), len(copies)
                if not isinstance(exc, AttemptFailed):
                    raise exc
                failure = exc
                if not exc.retryable:  # a 404 or a 403 will not change for the twin
                    pending.clear()
                    break
    finally:
        # The primary's latency is at least this long: a lower bound keeps the percentile honest.
        tracker.observe(loop.time() - began, policy)
        for fut in copies:
            _cancel(fut)
    assert failure is not None
    failure.requests = len(copies)
    raise failure


async def read(
    backend: Backend, url: str, start: int | None, end: int | None, options: StorageOptions
) -> bytes:
    """``Backend.read`` with hedging and retries sharing one count of attempts."""
    policy = options.retry
    hedge = options.hedge
    assert hedge is not None
    tracker = _prefix_of(url, options)
    attempt = 0
    started = time.monotonic()
    while True:
        try:
            data, _ = await _race(
                lambda: backend.read(url, start, end, options),
                tracker,
                hedge,
                policy.attempts - attempt - 1,
            )
            return data
        except AttemptFailed as failure:
            attempt += failure.requests
            wait = next_wait(failure, policy, attempt, started)
            if wait is None:
                raise give_up(failure, url, attempt) from failure.__cause__
            await backoff(failure, url, wait, attempt, policy)


async def _first(gen: AsyncGenerator[bytes, None]) -> tuple[AsyncGenerator[bytes, None], bytes]:
    try:
        return gen, await gen.__anext__()
    except StopAsyncIteration:
        return gen, b""
    except BaseException:
        await gen.aclose()
        raise


async def open_stream(
    backend: Backend,
    url: str,
    offset: int,
    chunk_size: int,
    options: StorageOptions,
    spare: int,
    resume: Resume,
) -> AsyncGenerator[bytes, None]:
    """``Backend.stream_version``, its opening request hedged (up to the first chunk).

    *spare* is how many attempts the retry policy has left besides this one. A failure that
    used a hedge too carries ``requests == 2`` for the caller's count of attempts.
    """
    hedge = options.hedge
    if hedge is None or spare < 1:
        async for chunk in backend.stream_version(url, offset, chunk_size, options, resume):
            yield chunk
        return
    gens: list[AsyncGenerator[bytes, None]] = []

    def opened() -> Awaitable[tuple[AsyncGenerator[bytes, None], bytes]]:
        gen = backend.stream_version(url, offset, chunk_size, options, resume)
        gens.append(gen)
        return _first(gen)

    try:
        (winner, chunk), _ = await _race(opened, _prefix_of(url, options), hedge, spare)
    except BaseException:
        for gen in gens:
            if not _running(gen):
                await gen.aclose()
        raise
    for gen in gens:
        # A loser still inside its request is closed by its own cancellation; one that
        # already holds a first chunk is parked here and closed now.
        if gen is not winner and not _running(gen):
            await gen.aclose()
    async with aclosing(winner):
        if chunk:
            yield chunk
        async for chunk in winner:
            yield chunk


def _running(gen: AsyncGenerator[bytes, None]) -> bool:
    # Inside a step (awaiting its request in another task): aclose() would raise.
    return bool(getattr(gen, "ag_running", False))
