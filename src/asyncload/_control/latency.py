"""The unloaded latency of a prefix and how far chance moves it: what a queue is measured by.

The control law's latency rule (TCP Vegas's, ``law``) reads our requests waiting from an
epoch's median over the unloaded one. Medians vary by chance, though, and the least of many
noisy medians sits below the true one; ``BaseLatency`` keeps the least epoch median of the last
``base_window`` seconds, the spread of log-latency (from the interquartile range) and the
smoothed median, and gives the law the unloaded latency lifted by the noise and the factor by
which the noise widens its band. What the limit does with them is ``law``'s.
"""

from __future__ import annotations

import collections
import math

__all__ = ["BaseLatency"]


class BaseLatency:
    """The least epoch median of a window of time, and the noise around it.

    Args:
        window: Seconds a median is remembered (``ControlConfig.base_window``: a store's
            latency can change).

    Examples:
        >>> b = BaseLatency(window=10.0)
        >>> b.note(0.0, 0.05, answers=16)
        >>> b.note(1.0, 0.06, answers=16)
        >>> b.base
        0.05
        >>> b.note(11.0, 0.07, answers=16)  # the median of 11 s ago is forgotten
        >>> b.base
        0.06
    """

    def __init__(self, window: float) -> None:
        self.window = window
        # Unloaded latency: the lowest epoch median over `window` seconds, kept as a
        # monotonic deque of (time, median, answers) so that the minimum is its first entry.
        self._medians: collections.deque[tuple[float, float, int]] = collections.deque()
        self.smoothed: float | None = None
        """The smoothed median latency of recent epochs, seconds; ``None`` before the first."""
        # The spread of log-latency (its standard deviation, from the interquartile range):
        # how much medians vary by chance, so that noise is not read as a queue.
        self._spread = 0.0

    @property
    def base(self) -> float | None:
        """The unloaded latency (the least median remembered), seconds; ``None`` if unknown."""
        return self._medians[0][1] if self._medians else None

    @property
    def base_at(self) -> float | None:
        """When ``base`` was measured; ``None`` if unknown."""
        return self._medians[0][0] if self._medians else None

    def note(self, now: float, median: float, answers: int) -> None:
        """A median of *answers* answers at *now*: an epoch's, or one another controller saw
        (then *now* is when it saw it, and a median older than the window is not taken)."""
        window = self._medians
        if window and now < window[-1][0] - self.window:
            return
        while window and window[-1][1] >= median:
            window.pop()
        window.append((now, median, answers))
        while window[0][0] < now - self.window:
            window.popleft()

    def rebase(self, now: float, median: float, answers: int) -> None:
        """Forget the medians before: *median* is the unloaded latency now."""
        self._medians.clear()
        self.note(now, median, answers)

    def epoch(self, now: float, latencies: list[float]) -> tuple[float, float, float]:
        """Take in an epoch's latencies (at least one), answered by *now*.

        Returns:
            The epoch's median; the unloaded latency, lifted by the noise; and the factor by
            which the noise widens the band above it.
        """
        latencies = sorted(latencies)
        n = len(latencies)
        median = latencies[n // 2]
        q1, q3 = latencies[n // 4], latencies[(3 * n) // 4]
        if q1 > 0:
            spread = math.log(q3 / q1) / 1.349  # a normal's IQR is 1.349 sigma
            self._spread = spread if self.smoothed is None else 0.8 * self._spread + 0.2 * spread
        self.smoothed = median if self.smoothed is None else 0.75 * self.smoothed + 0.25 * median
        self.note(now, median, n)
        base, base_answers = self._medians[0][1:]
        # A median of n has a standard error of 1.25 sigma / sqrt(n) (in log terms). The base
        # is the least of many such medians, so it sits about two errors below the true one:
        # lift it by that, and ask a queue to show more than two errors above the band.
        error = 1.25 * self._spread
        base *= math.exp(2.0 * error / math.sqrt(base_answers))
        return median, base, math.exp(2.0 * error / math.sqrt(n))
