"""The main process's view of its workers' blocked loops and stuck samples (``_engine``'s
watchdogs send them): warnings once per worker, and what a ``BatchTimeout`` names."""

from __future__ import annotations

import time
import warnings

from .._engine.sample_watch import SampleStuck, stuck_sample_threshold
from .._engine.watchdog import LoopBlocked, slow_callback_threshold
from .._exceptions import BlockedLoopWarning, StuckSampleWarning, user_stacklevel

__all__ = ["StallBoard"]


class StallBoard:
    """The main process's view of its workers' blocked loops."""

    def __init__(self) -> None:
        # A bad ASYNCLOAD_SLOW_CALLBACK or ASYNCLOAD_STUCK_SAMPLE fails here, not in a worker.
        slow_callback_threshold()
        stuck_sample_threshold()
        self._held: dict[int, tuple[LoopBlocked, float]] = {}

    def take(self, msg: object) -> bool:
        """Handle *msg* if it is a :class:`LoopBlocked` or :class:`SampleStuck` (warn,
        remember); else ``False``."""
        if isinstance(msg, SampleStuck):
            warnings.warn(msg.warning_text(), StuckSampleWarning, stacklevel=user_stacklevel())
            return True
        if not isinstance(msg, LoopBlocked):
            return False
        if msg.ended:
            self._held.pop(msg.worker_id, None)
            return True
        self._held[msg.worker_id] = (msg, time.monotonic())
        if msg.warn:
            warnings.warn(msg.warning_text(), BlockedLoopWarning, stacklevel=user_stacklevel())
        return True

    def describe(self) -> str | None:
        """Which samples hold a loop now, for a ``BatchTimeout``; ``None`` if none."""
        if not self._held:
            return None
        now = time.monotonic()
        parts = [m.describe(m.blocked_s + now - t) for m, t in self._held.values()]
        return (
            "; ".join(parts)
            + " (a blocking call inside async code holds the loop: await an async client, or "
            "use asyncio.to_thread for blocking code)"
        )
