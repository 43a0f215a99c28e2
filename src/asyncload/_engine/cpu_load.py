"""Whether a worker's own CPU is what bounds it: its event loop's thread, or its CPU lane, busy.

The adaptive limit (``_control/law.py``) reads a queue from latency that rises with load. A
worker whose CPU is saturated (decoding inline on its loop, or parsing thousands of responses
a second) sees its samples' latency rise with its *own* queue, not the store's. The law still
stops at that knee, but it must not probe the store's unloaded latency there: a probe drops to
a few requests in flight for a round trip, which idles the very CPU that bounds the worker
(issue #33, ``bench_autotune`` (a) and (b): 0.78 and 0.89 of the best fixed limit with the probe,
0.97 and 0.99 without it).

``CpuLoad`` measures, at most every ``EVERY`` seconds, the share of the wall time that the
loop's thread spent on a CPU (``time.thread_time``: the caller is on that thread) and the
share of its lane's threads that the lane's calls used; over ``BUSY`` of either is bound.
Schedulers' run-queue waits are not seen (``/proc/<tid>/schedstat`` is often empty in
containers), so a loop that is always runnable on an oversubscribed machine reads lower than
1: ``BUSY`` leaves room for that.
"""

from __future__ import annotations

import time

from .._dataset import cpu as _cpu

__all__ = ["CpuLoad"]


class CpuLoad:
    """Samples how busy this worker's CPU is; call ``sample`` from the loop's thread.

    The first ``sample`` only starts the clocks, on the thread that calls it: an engine is
    built on one thread and may run its loop on another (a thread worker).

    Examples:
        >>> load = CpuLoad()
        >>> load.sample(0.0) is None  # the clocks start
        True
        >>> load.sample(0.01) is None  # too soon to tell
        True
        >>> load.sample(10.0)  # ten idle seconds (a doctest uses almost no CPU)
        False
    """

    EVERY = 0.1
    """Seconds between two measures: enough wall time that one long call does not decide."""
    BUSY = 0.4
    """The share of the wall time a thread (or the lane's threads, each) used on a CPU that
    reads as bound; under ``IDLE`` it reads as free again, and between the two it reads as it
    did (so that a loop near the line does not flip every measure). On a 2-core machine whose
    cores two workers share with the main process and a loopback store, a saturated loop
    used 0.3-0.8 of a core per 0.1 s (``bench_autotune`` (a), 100 KB objects at ~3,500/s per
    worker), an I/O-bound one 0.12-0.3 ((d), ~800 small objects a second per worker)."""
    IDLE = 0.25

    __slots__ = ("_at", "_bound", "_lane_s", "_loop_s", "bound_s")

    def __init__(self) -> None:
        self._at: float | None = None
        self._loop_s = self._lane_s = 0.0
        self._bound = False
        # Wall seconds of the measures that read as bound (``LoaderStats.cpu_bound_s``).
        self.bound_s = 0.0

    @staticmethod
    def _lane() -> tuple[float, int]:
        """The lane's busy seconds so far and its threads (none: 0.0 and 1)."""
        lane = _cpu.current()
        return (0.0, 1) if lane is None else (lane.busy_s, lane.size)

    def sample(self, now: float) -> bool | None:
        """Whether the loop's thread or the lane is busy (``BUSY``, ``IDLE``), from the time
        since the last measure; ``None`` if less than ``EVERY`` has passed (nothing new)."""
        if self._at is None:
            self._at, self._loop_s, self._lane_s = now, time.thread_time(), self._lane()[0]
            return None
        elapsed = now - self._at
        if elapsed < self.EVERY:
            return None
        loop_s, (lane_s, threads) = time.thread_time(), self._lane()
        busy = max(loop_s - self._loop_s, (lane_s - self._lane_s) / threads) / elapsed
        self._at, self._loop_s, self._lane_s = now, loop_s, lane_s
        if busy >= self.BUSY:
            self._bound = True
        elif busy < self.IDLE:
            self._bound = False
        if self._bound:
            self.bound_s += elapsed
        return self._bound
