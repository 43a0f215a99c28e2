"""An asyncio semaphore sized by a ``LimitController``: one per worker (``_engine/slots.py``).

``AdaptiveLimiter`` admits requests while fewer than the controller's limit are in flight
(first come, first served) and reports each answer to it.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable

from .law import LimitController
from .values import Outcome

__all__ = ["AdaptiveLimiter"]


class AdaptiveLimiter:
    """An asyncio semaphore whose size is a ``LimitController``'s limit.

    ``acquire`` waits (first come, first served) while the prefix has ``limit`` requests in
    flight; ``release`` reports the answer and lets waiters in if the limit allows.

    Args:
        controller: The controller; a new default one if omitted.
        clock: The time source (the event loop's ``time`` by default).

    Examples:
        >>> import asyncio
        >>> async def main() -> int:
        ...     limiter = AdaptiveLimiter(LimitController(cap=2, now=0.0), clock=lambda: 0.0)
        ...     await limiter.acquire()
        ...     await limiter.acquire()
        ...     waiter = asyncio.ensure_future(limiter.acquire())
        ...     await asyncio.sleep(0)
        ...     assert not waiter.done()
        ...     limiter.release(Outcome.OK, latency=0.0)
        ...     await waiter
        ...     return limiter.controller.in_flight
        >>> asyncio.run(main())
        2
    """

    def __init__(
        self,
        controller: LimitController | None = None,
        *,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.controller = controller or LimitController(now=(clock or time.monotonic)())
        self._clock = clock
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        # Requests that gave their slot back for a while (a retry's backoff): served before
        # the others, in the order they came.
        self._firsts: collections.deque[asyncio.Future[None]] = collections.deque()

    def _now(self) -> float:
        return self._clock() if self._clock is not None else asyncio.get_running_loop().time()

    async def acquire(self, *, first: bool = False) -> None:
        """Wait for a slot; the request counts as started when this returns. *first*: ahead
        of those waiting (a request that had a slot and gave it back for a while)."""
        c = self.controller
        line = self._firsts if first else self._waiters
        ahead = self._firsts or (not first and self._waiters)  # who would go before it
        if not ahead and c.start_if_room(self._now()):
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        line.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                # Granted and cancelled in the same turn: hand the slot on (nothing was sent:
                # nothing to learn).
                c.returned()
                self.wake()
            raise
        finally:
            if waiter in line:
                line.remove(waiter)

    def release(self, outcome: Outcome, latency: float, retry_after: float | None = None) -> None:
        """A request that ``acquire`` admitted was answered (see ``LimitController.finished``)."""
        self.controller.finished(self._now(), outcome, latency, retry_after)
        self.wake()

    def returned(self) -> None:
        """A slot ``acquire`` granted was not used (see ``LimitController.returned``)."""
        self.controller.returned()
        self.wake()

    @property
    def rejoining(self) -> bool:
        """Whether requests that gave their slot back for a while wait to take one again
        (``acquire(first=True)``): they go before any other."""
        return bool(self._firsts)

    def throttled(self, sent: float, retry_after: float | None = None) -> None:
        """A request admitted at *sent* was told "too many" and is being retried (see
        ``LimitController.throttled``)."""
        self.controller.throttled(self._now(), sent, retry_after)

    def wake(self) -> None:
        """Let waiters in while the limit allows (after a release, or a limit that grew)."""
        c = self.controller
        while (self._firsts or self._waiters) and c.in_flight < c.limit:
            waiter = (self._firsts or self._waiters).popleft()
            if not waiter.done():
                # Counted as started now, not when it runs: a second wake in the same turn
                # must see this slot taken.
                c.started(self._now())
                waiter.set_result(None)
