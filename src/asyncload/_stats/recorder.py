"""Counters kept cheaply on the hot path, and where a note goes: the running engine's recorder.

Each engine owns a ``Recorder`` and makes it ``current`` for its event loop's tasks
(a ContextVar, so a thread's engine never counts the application's own reads, and two engines
never share counters). Storage code calls ``note_bytes``, ``note_retry``,
``note_error``, ``note_count`` (named events: hedges, cache hits, samples per source of a
``Mix``) and ``note_throttle`` (a store said "too many": the engine's in-flight limit hears it
through ``Recorder.on_throttle``) without knowing about loaders; outside any engine the notes
go to the process's own ``recorder``. Knows nothing about loaders.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

__all__ = [
    "Recorder",
    "RecorderSnapshot",
    "current",
    "note_bytes",
    "note_count",
    "note_error",
    "note_retry",
    "note_throttle",
    "recorder",
    "use",
]

# Latency histogram: log-spaced buckets from 10 µs to ~170 s, 8 per factor of two.
_BUCKETS_PER_OCTAVE = 8
_MIN_LATENCY = 1e-5
_NUM_BUCKETS = 8 * 24


def _bucket(seconds: float) -> int:
    if seconds <= _MIN_LATENCY:
        return 0
    b = int(math.log2(seconds / _MIN_LATENCY) * _BUCKETS_PER_OCTAVE)
    return min(b, _NUM_BUCKETS - 1)


def _bucket_upper(b: int) -> float:
    return float(_MIN_LATENCY * 2 ** ((b + 1) / _BUCKETS_PER_OCTAVE))


@dataclass(frozen=True, slots=True)
class RecorderSnapshot:
    """What one process has counted since it started (picklable, sent with results)."""

    samples: int
    bytes: int
    in_flight: int
    latency_hist: tuple[int, ...]
    retries: tuple[tuple[str, int], ...]
    errors: tuple[tuple[str, int], ...]
    counts: tuple[tuple[str, int], ...] = ()
    limit: int = 0
    """Samples the engine may have in flight now (its adaptive limit, or the fixed one)."""
    cpu_s: float = 0.0
    """CPU seconds the worker used this pass, all its threads (in a thread worker: its loop's
    thread and its CPU lane's)."""
    lane_s: float = 0.0
    """Of those, the seconds its CPU lane's calls used (``asyncload.cpu``, lane decoders)."""
    cpu_bound_s: float = 0.0
    """Wall seconds of this pass during which its own CPU bounded it (``_engine/cpu_load.py``)."""


@dataclass
class Recorder:
    """Mutable per-process counters; only its own process (and event loop thread) writes them."""

    samples: int = 0
    bytes: int = 0
    in_flight: int = 0
    latency_hist: list[int] = field(default_factory=lambda: [0] * _NUM_BUCKETS)
    retries: collections.Counter[str] = field(default_factory=collections.Counter)
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    counts: collections.Counter[str] = field(default_factory=collections.Counter)
    limit: int = 0
    cpu_s: float = 0.0
    lane_s: float = 0.0
    cpu_bound_s: float = 0.0
    # The engine's in-flight limit, told of a throttle: (when the throttled attempt was sent,
    # the server's Retry-After). None outside an engine, or with a fixed limit.
    on_throttle: Callable[[float, float | None], None] | None = None

    def note_sample(self, latency: float) -> None:
        self.samples += 1
        self.latency_hist[_bucket(latency)] += 1

    def snapshot(self) -> RecorderSnapshot:
        return RecorderSnapshot(
            samples=self.samples,
            bytes=self.bytes,
            in_flight=self.in_flight,
            latency_hist=tuple(self.latency_hist),
            retries=tuple(sorted(self.retries.items())),
            errors=tuple(sorted(self.errors.items())),
            counts=tuple(sorted(self.counts.items())),
            limit=self.limit,
            cpu_s=self.cpu_s,
            lane_s=self.lane_s,
            cpu_bound_s=self.cpu_bound_s,
        )

    def reset(self) -> None:
        self.samples = self.bytes = self.in_flight = 0
        self.cpu_s = self.lane_s = self.cpu_bound_s = 0.0
        self.latency_hist = [0] * _NUM_BUCKETS
        self.retries.clear()
        self.errors.clear()
        self.counts.clear()


recorder = Recorder()
"""The process's own recorder: counts anything noted outside an engine (``asyncload.read``
called by the application), and in a worker process, everything (its one engine uses it)."""

_current: contextvars.ContextVar[Recorder] = contextvars.ContextVar(
    "asyncload_recorder", default=recorder
)


def current() -> Recorder:
    """The recorder notes go to here: the running engine's, else the process's own."""
    return _current.get()


@contextlib.contextmanager
def use(rec: Recorder) -> Iterator[Recorder]:
    """Send notes made in this context (and in tasks it starts) to *rec*."""
    token = _current.set(rec)
    try:
        yield rec
    finally:
        _current.reset(token)


def note_bytes(n: int) -> None:
    """Count *n* payload bytes received from storage."""
    _current.get().bytes += n


def note_retry(kind: str) -> None:
    """Count one retry, by reason (``"503"``, ``"timeout"``, ``"connection"``, ...)."""
    _current.get().retries[kind] += 1


def note_error(kind: str) -> None:
    """Count one failure that reached the caller, by exception class name."""
    _current.get().errors[kind] += 1


def note_count(name: str, n: int = 1) -> None:
    """Count *n* events called *name* (``"hedges_sent"``, ``"cache_hits"``, ``"mix:0"``, ...)."""
    _current.get().counts[name] += n


def note_throttle(sent: float, retry_after: float | None) -> None:
    """Count one answer that said "too many" (``503 SlowDown``, ``429``, ``Retry-After``) to an
    attempt sent at *sent* (``time.monotonic``), and tell the running engine's limit."""
    rec = _current.get()
    rec.counts["throttled"] += 1
    if rec.on_throttle is not None:
        rec.on_throttle(sent, retry_after)


def note_level(name: str, n: int) -> None:
    """Set the counter *name* to *n*: a figure the stats carry as it is now, not a count."""
    _current.get().counts[name] = n
