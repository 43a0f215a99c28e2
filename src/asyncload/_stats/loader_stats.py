"""The frozen snapshot ``DataLoader.stats()`` returns, and how a pass tallies it.

The counters themselves live in ``_stats.recorder`` (re-exported here, so ``_stats.note_bytes`` and
friends keep working): each engine owns a ``Recorder``, which storage code notes into
through a ContextVar. Workers ship a ``RecorderSnapshot`` with their results; the main
process keeps the newest one per worker and merges them in ``merge``.
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .recorder import (
    _NUM_BUCKETS,
    Recorder,
    RecorderSnapshot,
    _bucket_upper,
    note_bytes,
    note_error,
    note_retry,
    note_throttle,
    recorder,
)

__all__ = [
    "LoaderStats",
    "Recorder",
    "RecorderSnapshot",
    "Tally",
    "merge",
    "note_bytes",
    "note_error",
    "note_retry",
    "note_throttle",
    "recorder",
]


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
    concurrency: tuple[int, ...]
    """Samples each worker may have in flight now, as last reported: the limit it found
    itself (``max_concurrency=None``, the default) or the fixed ``max_concurrency``."""
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
    head_wait_s: float = 0.0
    """Of ``wait_s``, the seconds spent waiting for a late batch while later ones were ready
    (``in_order=True``): the cost of stragglers, which ``prefetch_bytes`` lets workers overlap."""

    throttled: int = 0
    """Answers that said "too many" (``503 SlowDown``, ``429``, ``Retry-After``), summed over
    workers: each cut that worker's in-flight limit and was retried (also in ``retries``)."""
    hedges_sent: int = 0
    """Hedged requests sent (a second request for a straggling read), summed over workers."""
    hedges_won: int = 0
    """Hedged requests that answered before the request they doubled."""
    cache_hits: int = 0
    """Reads served by the local cache (``cache_dir``)."""
    cache_misses: int = 0
    """Reads the local cache had to fetch from the store."""
    shards_empty: int = 0
    """``TarShards`` shards that held no sample (each also warned about)."""
    shards_unterminated: int = 0
    """``TarShards`` shards that ended without tar's end-of-archive block (warned about)."""
    mixed: tuple[int, ...] = ()
    """Samples a [`Mix`][asyncload.Mix] drew from each of its datasets, in their order: the
    realised proportions (``()`` without a ``Mix``). Counted as drawn, so samples fetched
    ahead of a loop that stopped early are included."""

    skipped: dict[str, int] = field(default_factory=dict)
    """Samples left out of their batch by ``sample_errors='skip'/'warn'``, by exception type."""

    consumer_s: float = 0.0
    """Seconds the training loop held the batches it was given (``elapsed_s - wait_s``): its
    own work between ``next()`` calls."""
    transfer_s: float = 0.0
    """CPU seconds this process spent inside ``next()`` receiving batches (unpacking them from
    shared memory, reordering), not waiting for them."""
    worker_cpu_s: float = 0.0
    """CPU seconds the workers used, summed: fetching, decoding, transforms, collating."""
    cpu_lane_s: float = 0.0
    """Of ``worker_cpu_s``, the seconds of the workers' CPU lanes (``asyncload.cpu`` calls,
    ``decode_in_thread`` decoders)."""
    cpu_bound_s: float = 0.0
    """Wall seconds during which a worker's own CPU was what bounded it, summed over workers:
    its event loop's thread on a core or waiting for one at least 0.85 of the time (Linux;
    elsewhere its CPU time, 0.4), or its CPU lane busy, measured every 0.1 s
    (``_engine/cpu_load.py``). It tells a worker that runs out of CPU from one that waits on
    its store where its cores are shared (another process or the store itself running on
    them), so that ``worker_cpu_s`` stays well under the cores it was given."""
    bound_by: str = ""
    """Which stage holds the pass back, from the figures above: ``"consumer"`` (the training
    loop waited for data less than a tenth of the time: the loader keeps up), ``"transfer"``
    (this process is busy receiving batches), ``"cpu"`` (the workers use the cores they have,
    or their CPU bounded them for at least half the pass (``cpu_bound_s``): decoding and
    transforms; more workers only help with more cores, cheaper transforms do),
    ``"storage"`` (the workers wait on the store: see ``concurrency``, ``throttled`` and the
    latencies); ``""`` before the first batch."""

    def as_dict(self, prefix: str = "") -> dict[str, float]:
        """Flat numbers, one key per figure, for a metrics logger (TensorBoard's
        ``add_scalars``, W&B's ``log``, Lightning's ``log_dict``).

        Per-worker tuples become their sum (``in_flight``, ``concurrency``); dicts become one
        key each (``retries/503``, ``errors/NotFound``, ``skipped/ValueError``, ``mixed/0``);
        ``bound_by`` becomes one key set to 1 (``bound_by/storage``).

        Args:
            prefix: Put before every key (e.g. ``"loader/"``).

        Examples:
            >>> stats = loader.stats()  # doctest: +SKIP
            >>> wandb.log(stats.as_dict("loader/"), step=step)  # doctest: +SKIP
            >>> self.log_dict(stats.as_dict("loader/"))  # in a LightningModule  # doctest: +SKIP
        """
        out: dict[str, float] = {}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if isinstance(value, str):  # a label: one key set to 1 (bound_by/cpu)
                if value:
                    out[f"{prefix}{name}/{value}"] = 1.0
            elif isinstance(value, dict):
                for key, n in sorted(value.items()):
                    out[f"{prefix}{name}/{key}"] = float(n)
            elif isinstance(value, tuple):
                if name == "mixed":
                    for i, n in enumerate(value):
                        out[f"{prefix}{name}/{i}"] = float(n)
                else:
                    out[f"{prefix}{name}"] = float(sum(value))
            else:
                out[f"{prefix}{name}"] = float(value)
        return out


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
    head_wait_s: float = 0.0,
    skipped: dict[str, int] | None = None,
    transfer_s: float = 0.0,
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
    worker_cpu_s = sum(s.cpu_s for s in snapshots)
    cpu_bound_s = sum(s.cpu_bound_s for s in snapshots)
    consumer_s = max(0.0, elapsed - wait_s)
    return LoaderStats(
        elapsed_s=elapsed,
        samples=samples,
        bytes=nbytes,
        batches=batches,
        samples_per_s=samples / elapsed,
        bytes_per_s=nbytes / elapsed,
        in_flight=tuple(s.in_flight for s in snapshots),
        concurrency=tuple(s.limit for s in snapshots),
        latency_p50=_percentile(hist, 0.50),
        latency_p95=_percentile(hist, 0.95),
        latency_p99=_percentile(hist, 0.99),
        retries=dict(retries),
        errors=dict(errors),
        wait_s=wait_s,
        head_wait_s=head_wait_s,
        **_counted(snapshots),
        skipped=dict(skipped or {}),
        consumer_s=consumer_s,
        transfer_s=transfer_s,
        worker_cpu_s=worker_cpu_s,
        cpu_lane_s=sum(s.lane_s for s in snapshots),
        cpu_bound_s=cpu_bound_s,
        bound_by=_bound_by(
            batches,
            elapsed,
            wait_s,
            transfer_s,
            worker_cpu_s,
            len(snapshots),
            cpu_bound_s=cpu_bound_s,
        ),
    )


# The training loop waited for data less than this share of the pass: the loader keeps up.
_CONSUMER_BOUND = 0.1
# The workers used at least this share of the cores they can use (one each: Python code holds
# the GIL; decoders that release it on a CPU lane may use more): they are CPU-bound.
_CPU_BOUND = 0.8
# ... or their own measures read bound for at least this share of the pass (start-up counts in
# the pass: a worker is not busy while its first connections open). On 2 shared cores the
# JPEG pipeline's workers, bound by their decode, used 0.70 of two cores (the store and the
# training process took the rest) and read "storage" by the rule above alone (2026-11-27).
_CPU_BOUND_TIME = 0.5


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _bound_by(
    batches: int,
    elapsed: float,
    wait_s: float,
    transfer_s: float,
    worker_cpu_s: float,
    workers: int,
    *,
    cpu_bound_s: float = 0.0,
) -> str:
    """Which stage holds the pass back (``LoaderStats.bound_by``)."""
    if batches == 0 or workers == 0:
        return ""
    if wait_s <= _CONSUMER_BOUND * elapsed:
        return "consumer"
    if transfer_s >= 0.5 * wait_s:
        return "transfer"
    cores = min(_cores(), workers)
    # More workers than cores share them with this process: what it used is not theirs.
    spare = transfer_s if workers >= _cores() else 0.0
    capacity = max(elapsed * cores - spare, 1e-9)
    if worker_cpu_s >= _CPU_BOUND * capacity:
        return "cpu"
    if cpu_bound_s >= _CPU_BOUND_TIME * elapsed * workers:
        return "cpu"
    return "storage"


# Counters noted by name (``_metrics.note_count``) that are fields of ``LoaderStats`` as they are.
_COUNTED = (
    "throttled",
    "hedges_sent",
    "hedges_won",
    "cache_hits",
    "cache_misses",
    "shards_empty",
    "shards_unterminated",
)
_MIX = "mix:"  # "mix:<i>": a sample a Mix drew from its dataset i


def _counted(snapshots: list[RecorderSnapshot]) -> dict[str, Any]:
    total: collections.Counter[str] = collections.Counter()
    for snap in snapshots:
        total.update(dict(snap.counts))
    out: dict[str, Any] = {name: total[name] for name in _COUNTED}
    mixed = {int(k[len(_MIX) :]): n for k, n in total.items() if k.startswith(_MIX)}
    out["mixed"] = tuple(mixed.get(i, 0) for i in range(max(mixed) + 1)) if mixed else ()
    return out


class Tally:
    """What one pass has done so far; outlives its pass so ``stats()`` works after the loop.

    ``live`` reads an engine's counters directly (one in this process); otherwise each
    worker's newest snapshot, as it rode in on a reply, is kept in ``workers``.
    """

    __slots__ = (
        "batches",
        "ended",
        "head_wait_s",
        "live",
        "skipped",
        "started",
        "transfer_s",
        "wait_s",
        "workers",
    )

    def __init__(self, num_workers: int, live: Callable[[], RecorderSnapshot] | None) -> None:
        self.started = time.monotonic()
        self.ended: float | None = None
        self.batches = 0
        self.wait_s = 0.0
        self.head_wait_s = 0.0
        self.transfer_s = 0.0
        self.live = live
        self.workers: list[RecorderSnapshot | None] = [None] * num_workers
        self.skipped: collections.Counter[str] = collections.Counter()

    def snapshots(self) -> list[RecorderSnapshot]:
        """Each worker's newest counters (the engine's own, read now, in a thread pass)."""
        if self.live is not None:
            return [self.live()]
        return [s for s in self.workers if s is not None]

    def stats(self) -> LoaderStats:
        snaps = self.snapshots()
        return merge(
            snaps,
            started=self.started,
            batches=self.batches,
            wait_s=self.wait_s,
            ended=self.ended,
            head_wait_s=self.head_wait_s,
            skipped=dict(self.skipped),
            transfer_s=self.transfer_s,
        )
