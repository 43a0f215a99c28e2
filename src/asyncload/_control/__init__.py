"""Control laws: how many requests to keep in flight, found from what the answers say.

Pure logic with the clock passed in (no I/O, no event loop but ``limiter``'s semaphore), so
that a simulator drives it as a worker does. ``law`` is the controller (issue #33), ``values``
what it takes and gives, ``latency`` the unloaded latency it measures queues by, ``limiter`` the
semaphore built on it; ``_engine/slots.py`` is where a worker uses them.
``aside`` lets a retry's backoff (storage) give its sample's slot (engine) back meanwhile;
``turns`` lets a finished read (storage) wait for the worker's loop to poll its sockets when
inline CPU work kept it from them.
"""

from __future__ import annotations

from .law import LimitController
from .limiter import AdaptiveLimiter
from .values import ControlConfig, LimitState, LimitStats, Outcome

__all__ = [
    "AdaptiveLimiter",
    "ControlConfig",
    "LimitController",
    "LimitState",
    "LimitStats",
    "Outcome",
]
