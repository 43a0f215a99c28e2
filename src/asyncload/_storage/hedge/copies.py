"""The copies a process's hedged rounds send, and what becomes of them.

A hedge goes out in a task of its own that the backend knows for one (``hedging``) and that
reports no signs of life (``watching``); every hedge sent and every one that answered first is
counted, per process (read by ``hedge.counts``). A copy that lost its round is cancelled and
kept alive until the cancellation has run its cleanup (a response released, a connection
closed); ``drain`` waits for a loop's ones before its clients close.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from ..._stats.recorder import note_count
from ..backends.base import hedging
from ..backends.progress import watching

__all__ = ["drain"]  # and _send, _cancel, _count_win, for the package

T = TypeVar("T")

# Hedges sent and won by this process (``counts``). Per process: hedge_counts() sums every
# reader of the process (own coroutines, read_sync, a loader without workers).
_sent = 0
_won = 0


def _send(start: Callable[[], Awaitable[T]]) -> asyncio.Future[T]:
    """The hedge, in a task of its own that the backend knows for one (``hedging``); counted."""
    global _sent
    _sent += 1
    note_count("hedges_sent")
    token = hedging.set(True)  # the task copies this context
    unwatched = watching.set(None)  # not the primary's signs of life
    try:
        return asyncio.ensure_future(start())
    finally:
        watching.reset(unwatched)
        hedging.reset(token)


# Per process: cancelled hedges of every loop, kept alive until their cleanup ran; aclose()
# (``drain``) waits for its loop's ones before it closes the clients, which all readers share.
_losers: set[asyncio.Future[object]] = set()


def _discard(fut: asyncio.Future[object]) -> None:
    _losers.discard(fut)
    if not fut.cancelled():
        fut.exception()  # retrieved: a loser's failure is not an error anyone should see


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


def _count_win() -> None:
    """A hedge answered first."""
    global _won
    _won += 1
    note_count("hedges_won")
