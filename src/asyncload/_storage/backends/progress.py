"""A hedged request's signs of life: what a backend tells the race that times it.

The hedge race (``hedge.race``) sets ``watching`` to a ``Progress`` before it sends its primary
request; a backend that can tell reports there how far the request got (in the pool's line,
connecting, connected, answered with a body flowing), and the race reads it when its timer fires
to tell a straggler from a request that waits in a line or streams a long body.
"""

from __future__ import annotations

import asyncio
import contextvars
from typing import Protocol

__all__ = ["Progress", "watching"]


class _Counted(Protocol):
    @property
    def total_bytes(self) -> int: ...


class Progress:
    """A hedged request's signs of life, read by its race (``_hedge``) through ``watching``.

    A backend that can tell says when the request joins its pool's line (``queued``: not
    timed while it waits there, a line is no straggler), when it leaves it to open a connection
    (``connecting``: a connect can straggle, a SYN the server dropped waits 1 s), when it got
    its connection (``connected``) and when its response's headers came
    (``answered``, with the body's byte count); the race reads ``quiet`` when its timer fires,
    so a body that flows costs nothing per chunk. A backend that says nothing leaves the clock
    at the request's start. The latency the race learns its delay from is timed from when the
    request first left the line (``out``) too: a wave of requests that queue for the pool's
    connections would otherwise teach it a delay as long as the line, and its stragglers would
    wait that long for their hedge. A request that ends still in the line (cancelled, or a pool
    timeout) teaches nothing; one raced with no hedge to spare (a retry's last attempt) is not
    watched, and is timed from its start.
    """

    __slots__ = ("body", "moved", "out", "received", "sent", "served", "waiting")

    def __init__(self, now: float) -> None:
        self.moved = now  # loop time of the last sign of life
        self.out = now  # loop time it left the pool's line (its latency is timed from there)
        self.waiting = False  # in the pool's line, for a connection
        self.sent = False  # it has a connection
        self.served = False  # its response's headers came
        self.body: _Counted | None = None  # the body's bytes so far: body.total_bytes
        self.received = 0  # body.total_bytes when the race last looked

    def queued(self) -> None:
        self.waiting = True

    def connecting(self) -> None:
        self.moved = asyncio.get_running_loop().time()
        self._left_line()

    def connected(self) -> None:
        self.moved = asyncio.get_running_loop().time()
        self._left_line()
        self.sent = True

    def answered(self, body: _Counted | None) -> None:
        self.moved = asyncio.get_running_loop().time()
        self._left_line()
        self.sent = self.served = True
        self.body = body
        self.received = 0 if body is None else body.total_bytes

    def _left_line(self) -> None:
        if self.waiting:
            if not self.sent:  # the first line only: a redirect's first round trip is latency
                self.out = self.moved
            self.waiting = False

    def quiet(self, now: float) -> float:
        """Seconds since the request last moved (body bytes that came since the last look
        count as moving *now*; a request in the pool's line is not timed)."""
        if self.waiting:
            self.moved = now
            return 0.0
        body = self.body
        if body is not None and body.total_bytes != self.received:
            self.received = body.total_bytes
            self.moved = now
        return now - self.moved


# The Progress of the request the current task makes for a hedged race, if any (a hedge's own
# task has None): backends report to it.
watching: contextvars.ContextVar[Progress | None] = contextvars.ContextVar(
    "asyncload_watching", default=None
)
