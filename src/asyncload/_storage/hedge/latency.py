"""What a prefix's recent latencies teach: its hedge delay, and its token bucket.

One ``_Prefix`` per configured prefix and origin (``_prefix_of``): the delay is a high
percentile of its last ``_WINDOW`` latencies, never below ``Hedge.min_delay``; the bucket earns
``Hedge.budget`` tokens per request and a hedge spends one (see the package doc).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..state import current

if TYPE_CHECKING:
    from ..backends.base import StorageOptions
    from ..retry import Hedge

__all__ = ["prefix_of"]  # and _Prefix, for the package

# Latencies kept per prefix, and how often the percentile is recomputed from them: a sort of
# 512 floats every 64 requests is well under a microsecond per request.
_WINDOW = 512
_RECOMPUTE_EVERY = 64
# Before this many observations the percentile means little: no hedging yet.
_MIN_SAMPLES = 20
# Tokens a quiet prefix may save up, so a burst of stragglers after a calm period is bounded.
_MAX_TOKENS = 10.0
_MAX_PREFIXES = 1024
# Tokens are sums of budget fractions: a whole one may fall short of 1.0 by rounding.
_EPSILON = 1e-9
# Seconds after a throttle or a failure during which a prefix gets no hedges (beyond the
# retry's own backoff): a hedge to a store that is pushing back or failing only adds to it
# (issue #33's fault campaign: 3-5 requests per key where 3 were expected).
HUSH = 1.0


class _Prefix:
    """Recent latencies and the hedge token bucket of one prefix."""

    __slots__ = (
        "delay",
        "filled",
        "finished",
        "latencies",
        "next",
        "options",
        "quiet_until",
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
        self.quiet_until = 0.0  # no hedge before this time.monotonic() (``hush``)

    def observe(self, seconds: float | None, policy: Hedge) -> None:
        """A request finished after *seconds* out of its pool's line; None: it never left the
        line (cancelled there, or a pool timeout), so it counts as finished, with no latency."""
        self.finished += 1
        if seconds is None:
            return
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

    def hush(self, seconds: float) -> None:
        """The prefix throttled or failed: no hedge for *seconds* (``HUSH`` at least)."""
        self.quiet_until = max(self.quiet_until, time.monotonic() + max(seconds, HUSH))

    def spend(self, reserve: int = 0) -> bool:
        """Take a token for a hedge, leaving *reserve* tokens in the bucket (see ``_RESERVE``);
        none while the prefix is hushed."""
        if self.tokens < 1.0 + reserve - _EPSILON:  # 20 x 0.05 sums to 0.99999...
            return False
        if self.quiet_until and time.monotonic() < self.quiet_until:
            return False
        self.tokens -= 1.0
        return True


def prefix_of(url: str, options: StorageOptions) -> _Prefix:
    """The tracker of *url*'s prefix in this context's storage state: every read of a prefix
    in the context (any loader, ``read_sync``, your own coroutines) feeds and spends one, since
    the latency and the hedge budget are the store's."""
    # One tracker per configured prefix (its options object) and origin (scheme://host/ or
    # bucket): the default options serve every unconfigured host, whose latencies differ.
    slash = url.find("/", url.find("://") + 3)
    key = (id(options), url if slash < 0 else url[:slash])
    trackers: dict[tuple[int, str], _Prefix] = current().hedges
    tracker = trackers.get(key)
    if tracker is None or tracker.options is not options:
        if len(trackers) >= _MAX_PREFIXES:
            trackers.clear()
        tracker = trackers[key] = _Prefix(options)
    return tracker
