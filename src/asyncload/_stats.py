"""Counters every process keeps cheaply, and the frozen snapshot ``DataLoader.stats()`` returns.

Each process (a worker, or the main process for ``num_workers=0``) owns one ``Recorder``.
The storage layer and the worker loop call the ``note_*`` functions on the hot path: each is a
few integer additions. Workers ship a ``RecorderSnapshot`` with their results; the main
process keeps the newest one per worker and merges them in ``merge``.
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass, field

__all__ = [
    "LoaderStats",
    "Recorder",
    "RecorderSnapshot",
    "merge",
    "note_bytes",
    "note_error",
    "note_retry",
    "recorder",
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


@dataclass
class Recorder:
    """Mutable per-process counters; only its own process (and event loop thread) writes them."""

    samples: int = 0
    bytes: int = 0
    in_flight: int = 0
    latency_hist: list[int] = field(default_factory=lambda: [0] * _NUM_BUCKETS)
    retries: collections.Counter[str] = field(default_factory=collections.Counter)
    errors: collections.Counter[str] = field(default_factory=collections.Counter)

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
        )

    def reset(self) -> None:
        self.samples = self.bytes = self.in_flight = 0
        self.latency_hist = [0] * _NUM_BUCKETS
        self.retries.clear()
        self.errors.clear()


recorder = Recorder()


def note_bytes(n: int) -> None:
    """Count *n* payload bytes received from storage."""
    recorder.bytes += n


def note_retry(kind: str) -> None:
    """Count one retry, by reason (``"503"``, ``"timeout"``, ``"connection"``, ...)."""
    recorder.retries[kind] += 1


def note_error(kind: str) -> None:
    """Count one failure that reached the caller, by exception class name."""
    recorder.errors[kind] += 1


@dataclass(frozen=True, slots=True)
class LoaderStats:
    """What a [`DataLoader`][asyncload.DataLoader] has done since its iterator started.

    Examples:
        >>> s = loader.stats()  # doctest: +SKIP
        >>> print(f"{s.samples_per_s:.0f}/s, p99 {s.latency_p99:.3f} s")  # doctest: +SKIP
    """

    elapsed_s: float
    """Seconds from the start of the pass (``iter(loader)``) to now, or to its end."""
    samples: int
    """Samples fetched by all workers."""
    bytes: int
    """Payload bytes read from storage by all workers."""
    batches: int
    """Batches handed to the training loop."""
    samples_per_s: float
    """``samples / elapsed_s``."""
    bytes_per_s: float
    """``bytes / elapsed_s``."""
    in_flight: tuple[int, ...]
    """Samples being fetched right now, per worker (as last reported)."""
    latency_p50: float
    """Median time to fetch one sample, in seconds (0.0 before any sample)."""
    latency_p95: float
    """95th percentile fetch time, in seconds."""
    latency_p99: float
    """99th percentile fetch time, in seconds."""
    retries: dict[str, int]
    """Retries by reason, summed over workers."""
    errors: dict[str, int]
    """Errors that reached the caller, by exception type."""
    wait_s: float
    """Seconds the training loop spent waiting for data, worker start-up included."""


def _percentile(hist: list[int], q: float) -> float:
    total = sum(hist)
    if total == 0:
        return 0.0
    rank = q * total
    acc = 0
    for b, n in enumerate(hist):
        acc += n
        if acc >= rank:
            return _bucket_upper(b)
    return _bucket_upper(len(hist) - 1)


def merge(
    snapshots: list[RecorderSnapshot],
    *,
    started: float,
    batches: int,
    wait_s: float,
    ended: float | None = None,
) -> LoaderStats:
    """Combine per-worker snapshots into one ``LoaderStats``.

    ``ended`` freezes the clock of a finished pass, so its rates stop decaying afterwards.
    """
    elapsed = max((ended if ended is not None else time.monotonic()) - started, 1e-9)
    hist = [0] * _NUM_BUCKETS
    retries: collections.Counter[str] = collections.Counter()
    errors: collections.Counter[str] = collections.Counter()
    for snap in snapshots:
        for i, n in enumerate(snap.latency_hist):
            hist[i] += n
        retries.update(dict(snap.retries))
        errors.update(dict(snap.errors))
    samples = sum(s.samples for s in snapshots)
    nbytes = sum(s.bytes for s in snapshots)
    return LoaderStats(
        elapsed_s=elapsed,
        samples=samples,
        bytes=nbytes,
        batches=batches,
        samples_per_s=samples / elapsed,
        bytes_per_s=nbytes / elapsed,
        in_flight=tuple(s.in_flight for s in snapshots),
        latency_p50=_percentile(hist, 0.50),
        latency_p95=_percentile(hist, 0.95),
        latency_p99=_percentile(hist, 0.99),
        retries=dict(retries),
        errors=dict(errors),
        wait_s=wait_s,
    )
