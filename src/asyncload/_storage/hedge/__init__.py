"""Hedged reads: a second identical GET when the first one straggles; the first answer wins.

Object stores have long per-request tails (one request in a hundred takes ten times the
median). Waiting for a straggler holds a whole batch, so ``read`` and ``open_stream``
race a *hedge*: when a request has shown no sign of life for the delay (a high percentile of
the recent latencies of its prefix, never below a floor), an identical request is sent (never to
a prefix that throttled or failed in the last ``latency.HUSH`` seconds, nor during a retry's
backoff: a hedge would add to the overload), whichever
finishes first is used, and the other is cancelled. A hedge that straggles too gets one more
copy a delay later (``_MAX_HEDGES``). Cancelling releases the loser's response,
and aiohttp closes a connection whose body was not read to the end, so nothing leaks; bytes are
counted by the caller from the winner only. A hedge goes out on connections of its own
(``sources._base.hedging``): it is sent when its primary's pool is busiest. A request sent
before the prefix's delay is known (the first wave of a fresh worker) is hedged too, once it is
slow twice over (see ``_straggles``). Once the delay is known, the request runs in its caller's
task and a timer sends the hedge, which alone gets a task (``_race_in_place``, Python 3.11+).

A sign of life is what the backend reports through ``backends.progress.Progress`` (the HTTP one
does): the request got its connection (it is not timed while it waits in the pool's line, which
is no straggler), its headers came, or bytes of its body came since the timer last looked. So a
body that stalls after its headers is hedged like headers that are late, and one that flows is
not hedged however long it takes; the timer reads the body's byte count when it fires, nothing
runs per chunk. A backend that reports nothing is timed from the request's start.

Costs are bounded twice. A token bucket per prefix earns ``Hedge.budget`` tokens per
request and a hedge spends one, so hedges never exceed ``budget x requests`` (plus nothing: the
bucket starts empty). A request the bucket refused asks again every delay, and the longer it is
out the more of the bucket is open to it (``_RESERVE``), so the budget goes to real stragglers
first. And a hedge is an attempt of the [`Retry`][asyncload.Retry] policy: a
request with ``attempts=1`` is never hedged, and a round uses one attempt per copy it sent.

Counters (hedges sent and won, per process) are read with ``counts``.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..retry import AttemptFailed, Attempts, Hedge
from . import copies as _copies
from . import latency as _latency

# The parts' settings and state, under the names tests and docs use (explicit re-exports).
from .copies import _losers as _losers
from .copies import drain
from .latency import _MAX_TOKENS as _MAX_TOKENS
from .latency import _Prefix as _Prefix
from .race import _LEARNING_POLL as _LEARNING_POLL
from .race import _race

if TYPE_CHECKING:
    from ..backends.base import Backend, Resume, StorageOptions

__all__ = ["Hedge", "HedgeCounts", "applies", "counts", "drain", "open_stream", "read", "reset"]


@dataclass(frozen=True, slots=True)
class HedgeCounts:
    """Hedges this process has sent and won (the hedge answered first) since it started.

    Returned by [`asyncload.hedge_counts`][asyncload.hedge_counts].
    """

    sent: int
    """Hedged requests sent: a second (or third) copy of a read that was slow to answer."""
    won: int
    """Hedged requests that answered before the request they doubled."""


def counts() -> HedgeCounts:
    """Hedges sent and won by this process since it started.

    For reads made in this process: from your own coroutines, ``asyncload.read_sync``, or a
    ``DataLoader`` with ``num_workers=0``. Worker processes count their own; a loader's pass
    reports the sum over its workers as ``loader.stats().hedges_sent`` and ``.hedges_won``.

    Examples:
        >>> import asyncload
        >>> before = asyncload.hedge_counts()
        >>> data = asyncload.read_sync("s3://bucket/key")  # doctest: +SKIP
        >>> after = asyncload.hedge_counts()
        >>> after.sent - before.sent  # hedges that read needed
        0
    """
    return HedgeCounts(sent=_copies._sent, won=_copies._won)


def reset() -> None:
    """Zero the hedge counters (tests; the trackers are the storage state's: ``forget``)."""
    _copies._sent = _copies._won = 0


def applies(url: str, options: StorageOptions) -> bool:
    """Whether reads of *url* are hedged under *options*."""
    if options.hedge is None:
        return False
    return not url.startswith(("file:", "FILE:", "/")) and "://" in url


async def read(
    backend: Backend, url: str, start: int | None, end: int | None, options: StorageOptions
) -> bytes:
    """``Backend.read`` with hedging and retries sharing one count of attempts."""
    hedge = options.hedge
    assert hedge is not None
    tracker = _latency.prefix_of(url, options)

    def hush(failure: AttemptFailed, wait: float | None) -> None:
        if failure.retryable:  # throttling or failing: no hedges while it waits, and after
            tracker.hush(wait or 0.0)

    attempts = Attempts(url, options.retry, judged=hush)
    while True:
        attempts.sent()
        try:
            data, _ = await _race(
                lambda: backend.read(url, start, end, options), tracker, hedge, attempts.spare
            )
            return data
        except AttemptFailed as failure:
            await attempts.failed(failure, failure.requests)


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

    tracker = _latency.prefix_of(url, options)
    try:
        (winner, chunk), _ = await _race(opened, tracker, hedge, spare)
    except BaseException as exc:
        if isinstance(exc, AttemptFailed) and exc.retryable:
            tracker.hush(exc.retry_after or 0.0)  # as read() does
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
