"""Whether a worker's own CPU is what bounds it: its event loop's thread, or its CPU lane, busy.

The adaptive limit (``_control/law.py``) reads a queue from latency that rises with load. A
worker whose CPU is saturated (decoding inline on its loop, or parsing thousands of responses
a second) sees its samples' latency rise with its *own* queue, not the store's. The law still
stops at that knee, but it must not probe the store's unloaded latency there: a probe drops to
a few requests in flight for a round trip, which idles the very CPU that bounds the worker
(issue #33, ``bench_autotune`` (a) and (b): 0.78 and 0.89 of the best fixed limit with the probe,
0.97 and 0.99 without it).

``CpuLoad`` measures, at most every ``EVERY`` seconds, the share of the wall time that the
loop's thread was on a CPU *or waiting for one* (``Meter``), and the share of its lane's
threads that the lane's calls used; a loop over its meter's ``busy`` line, or a lane over
``LANE_BUSY``, is bound.

Why the wait counts: a saturated loop is never idle in its poll, but on a machine whose cores
are shared (two workers, the main process and a loopback store on 2 cores) it is not always on
a core either. Its own CPU time alone cannot tell it from a loop that idles half the time:
``bench_autotune`` (a) (100 KB objects, ~3,500/s per worker, saturated) used 0.4-0.9 of the
wall time on a CPU, and (d) (small objects from a store with a line, ~750/s per worker, idle
in its poll 40% of the time) 0.36-0.6, so a line at 0.4 read (d) as bound. Its loop then never
probed the store's unloaded latency, took the latency under its own load (40 ms) as the
unloaded one (25 ms), and kept about twice the store's knee in flight. On a CPU or waiting for
one, the two read 0.95-1.0 and 0.5-0.65 (``/proc/thread-self/schedstat``'s first two fields);
(d)'s p99 after the pass's first second went from 2.7x the unloaded p99 to 2.0x (medians of 8
and 16 runs, 2026-11-27; the ranges, 2.2-3.6x and 1.3-3.9x, overlap on this noisy machine).
Where that file is missing or empty (not Linux, some containers), the thread's CPU time with
the old lines (0.4, 0.25) is what is left (``THREAD_TIME``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from .._dataset import cpu as _cpu

__all__ = ["SCHEDSTAT", "THREAD_TIME", "CpuLoad", "Meter", "best_meter", "schedstat"]

_SCHEDSTAT = "/proc/thread-self/schedstat"


@dataclass(frozen=True, slots=True)
class Meter:
    """How the loop's thread is measured: a clock of its busy seconds, and its two lines.

    ``read`` is called on the thread measured. Over ``busy`` of the wall time the thread reads
    as bound; under ``idle`` as free again; between the two it reads as it did, so that a
    loop near the line does not flip every measure.
    """

    name: str
    read: Callable[[], float]
    busy: float
    idle: float


def schedstat(path: str = _SCHEDSTAT) -> tuple[float, float]:
    """Seconds a thread (the calling one by default) ran on a CPU, and waited in a run queue
    for one (Linux). Raises ``OSError`` or ``ValueError`` where the file cannot be read."""
    with open(path, "rb") as f:
        run_ns, wait_ns = f.read().split()[:2]
    return int(run_ns) / 1e9, int(wait_ns) / 1e9


def _on_or_waiting() -> float:
    """Seconds the calling thread ran on a CPU or waited in a run queue for one (Linux)."""
    return sum(schedstat())


SCHEDSTAT = Meter("schedstat", _on_or_waiting, busy=0.85, idle=0.7)
"""On a CPU or waiting for one: a saturated loop reads ~1 however its machine's cores are
shared (module doc)."""
THREAD_TIME = Meter("thread_time", time.thread_time, busy=0.4, idle=0.25)
"""On a CPU only, where run-queue waits cannot be read: a saturated loop read 0.3-0.8 on a
machine whose 2 cores it shared, an I/O-bound one 0.12-0.6 (module doc): the lines are a
compromise."""


def best_meter() -> Meter:
    """``SCHEDSTAT`` where the calling thread's run-queue figures can be read, else
    ``THREAD_TIME``."""
    try:
        if _on_or_waiting() > 0:
            return SCHEDSTAT
    except (OSError, ValueError):
        pass
    return THREAD_TIME


class CpuLoad:
    """Samples how busy this worker's CPU is; call ``sample`` from the loop's thread.

    The first ``sample`` picks the meter (``best_meter``) and starts the clocks, on the thread
    that calls it: an engine is built on one thread and may run its loop on another (a thread
    worker). Calls from any other thread say nothing (``None``): a sync ``__getitem__``'s
    retry may give its slot back from the loop of ``asyncload.read_sync``, whose thread's
    clock is not the loop's.

    Args:
        meter: How the loop's thread is measured; ``None``: ``best_meter()`` at the first
            ``sample``.

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
    LANE_BUSY = 0.4
    """The share of the wall time the lane's threads used on a CPU, on average over them, that
    reads as bound (their CPU time: a lane's call cannot be told waiting from blocked on I/O);
    under ``LANE_IDLE`` free again."""
    LANE_IDLE = 0.25

    __slots__ = ("_at", "_bound", "_lane_s", "_loop_s", "_thread", "bound_s", "meter")

    def __init__(self, meter: Meter | None = None) -> None:
        self.meter = meter
        self._thread: int | None = None
        self._at: float | None = None
        self._loop_s = self._lane_s = 0.0
        self._bound = False
        # Wall seconds of the measures that read as bound (``LoaderStats.cpu_bound_s``).
        self.bound_s = 0.0

    def _read(self) -> float:
        """The meter's clock; a meter that fails (a file that cannot be opened any more: out
        of descriptors) gives way to ``THREAD_TIME`` and the clocks start again."""
        assert self.meter is not None
        try:
            return self.meter.read()
        except (OSError, ValueError):
            self.meter, self._at = THREAD_TIME, None
            return THREAD_TIME.read()

    @staticmethod
    def _lane() -> tuple[float, int]:
        """The lane's busy seconds so far and its threads (none: 0.0 and 1)."""
        lane = _cpu.current()
        return (0.0, 1) if lane is None else (lane.busy_s, lane.size)

    def sample(self, now: float) -> bool | None:
        """Whether the loop's thread or the lane is busy (``Meter``, ``LANE_BUSY``), from the
        time since the last measure; ``None`` if less than ``EVERY`` has passed."""
        if self._at is None:
            if self.meter is None:
                self.meter = best_meter()
            self._thread = threading.get_ident()
            self._at, self._loop_s, self._lane_s = now, self._read(), self._lane()[0]
            return None
        elapsed = now - self._at
        if elapsed < self.EVERY or threading.get_ident() != self._thread:
            return None
        loop_s, (lane_s, threads) = self._read(), self._lane()
        restart, self._at = self._at is None, now  # restart: the meter gave way (_read)
        loop = (loop_s - self._loop_s) / elapsed
        lane = (lane_s - self._lane_s) / threads / elapsed
        self._loop_s, self._lane_s = loop_s, lane_s
        if restart:
            return None
        assert self.meter is not None
        if loop >= self.meter.busy or lane >= self.LANE_BUSY:
            self._bound = True
        elif loop < self.meter.idle and lane < self.LANE_IDLE:
            self._bound = False
        if self._bound:
            self.bound_s += elapsed
        return self._bound
