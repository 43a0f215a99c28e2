"""A retry's backoff waits outside its sample's fetch slot.

A sample holds one of its worker's fetch slots while it is fetched (``_engine/slots.py``).
When one of its storage requests fails and the retry policy waits before the next attempt
(``_storage/retry.py`` ``backoff``), the sample steps aside for that wait: its slot goes back
to the adaptive limit, and it takes one again, ahead of samples not yet started, before the
retry is sent. So the limit counts requests the store is answering, not samples asleep: after
a throttle cuts it, the retries come back within the cut limit (issue #33), and a backoff's
seconds are not taken for the store's latency.

The engine lends each running sample's slot as a ``Seat`` in a ContextVar; storage calls
``sleep_aside``. Outside an engine, or with a fixed ``max_concurrency`` (the user's number
holds through backoffs too), it is a plain sleep.
"""

from __future__ import annotations

import asyncio
import contextvars
from typing import Protocol

__all__ = ["Seat", "seat", "sleep_aside"]


class Seat(Protocol):
    """The fetch slot a running sample holds."""

    def leave(self) -> bool:
        """Give the slot back for a wait; whether it was given (``rejoin`` then takes one)."""

    async def rejoin(self) -> None:
        """Take a slot again, ahead of samples not yet started."""


seat: contextvars.ContextVar[Seat | None] = contextvars.ContextVar("asyncload_seat", default=None)
"""The slot of the sample this task fetches, if an engine lent one (each sample's task sets
it in its own context)."""


async def sleep_aside(seconds: float) -> None:
    """Sleep *seconds* (a retry's backoff) without holding the current sample's slot.

    A cancellation while asleep or in line leaves the slot given back. A sample that catches it
    and goes on runs without a slot (one over the limit, for a while); its task then takes no
    next sample (``Held.keep``), and gives back only what it holds.
    """
    held = seat.get()
    if held is None or not held.leave():
        await asyncio.sleep(seconds)
        return
    await asyncio.sleep(seconds)
    await held.rejoin()
