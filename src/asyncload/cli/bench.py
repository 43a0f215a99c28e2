"""``asyncload bench``: which ``max_concurrency`` and ``num_workers`` a store wants.

``max_concurrency`` values are ints or ``None`` ("auto", the DataLoader's default: each worker
finds its limit itself); for those the bench shows where the limit went over time. Any setting
the store throttled (``503 SlowDown``, ``429``) is named after the table.

Each setting reads objects through ``asyncload.RemoteFiles`` for at most ``samples``
samples or ``seconds`` seconds, whichever comes first, cycling through the objects when there
are fewer of them. Samples are decoded to their length in the worker, so what is measured is
fetching, not shipping bytes to the main process. Throughput counts from the first batch on
(worker start-up excluded); latency percentiles, bytes, retries and errors come from
``loader.stats()``.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .._exceptions import LoadError
from .._loader.loader import DataLoader
from .._stats.loader_stats import LoaderStats
from ..datasets import RemoteFiles
from .console import Progress, UsageError, render_table

__all__ = [
    "OBJECTIVES",
    "BenchConfig",
    "Setting",
    "backlog_suspects",
    "check_plotting",
    "fmt_ms",
    "plot",
    "recommend",
    "run_bench",
]

# A setting within this fraction of the best throughput counts as "as good": the recommendation
# is then the cheapest such setting (fewest workers, then lowest concurrency).
TOLERANCE = 0.05

# What `--objective` can ask for, and the one sentence that says how each picks.
OBJECTIVES = {
    "balanced": "most samples/s per ms of p50 latency, of settings with ≥ ½ the best samples/s",
    "throughput": "the cheapest setting within 5% of the best samples/s, whatever its latency",
}
# Below this share of the best throughput, "balanced" does not consider a setting.
BALANCED_FLOOR = 0.5

# Linux retransmits an unanswered SYN after 1 s, then 2, 4, 8, 16 s more: a connection that the
# server's full listen queue dropped shows up as a fetch about 1, 3, 7, 15 or 31 s slower.
SYN_RETRY_MARKS = (1.0, 3.0, 7.0, 15.0, 31.0)


@dataclasses.dataclass(frozen=True, slots=True)
class BenchConfig:
    """What ``asyncload bench`` was asked to do."""

    concurrency: tuple[int | None, ...] = (8, 32, 128, 256, None)
    """``max_concurrency`` values to try (``None``: the default, a limit found while reading)."""
    workers: tuple[int, ...] = (1, 2)
    """``num_workers`` values to try."""
    batch_size: int = 32
    samples: int = 2000
    """Samples per setting, at most."""
    seconds: float = 10.0
    """Seconds per setting, at most (start-up not included)."""
    progress: bool | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Setting:
    """One measured setting."""

    workers: int
    concurrency: int | None
    """``max_concurrency``; ``None``: the default (auto)."""
    samples: int = 0
    """Samples delivered to the loop."""
    samples_per_s: float = 0.0
    """From the first batch to the last."""
    bytes_per_s: float = 0.0
    startup_s: float = 0.0
    """From creating the iterator to the first batch."""
    stats: LoaderStats | None = None
    error: str | None = None
    limits: tuple[tuple[float, int], ...] = ()
    """(seconds since the first batch, samples in flight allowed over all workers), about every
    ``LIMIT_EVERY`` seconds: where an automatic limit went."""


# How often the bench notes where an automatic limit is.
LIMIT_EVERY = 0.5


def label(concurrency: int | None) -> str:
    """How a ``max_concurrency`` value is shown: the int, or ``auto``."""
    return "auto" if concurrency is None else str(concurrency)


def _order(concurrency: int | None) -> tuple[int, int]:
    # Fixed values in order, then the default; also the tie-break of `recommend`, where the
    # default comes first (it adapts to what the bench could not see).
    return (1, 0) if concurrency is None else (0, concurrency)


def _run_one(urls: RemoteFiles, workers: int, concurrency: int | None, cfg: BenchConfig) -> Setting:
    n = len(urls)
    # Cycle through the objects: a small store still gives every setting the same load.
    order = np.arange(cfg.samples, dtype=np.int64) % n
    loader = DataLoader(
        urls,
        batch_size=cfg.batch_size,
        sampler=order.tolist(),
        num_workers=workers,
        max_concurrency=concurrency,
    )
    bar = Progress(
        f"workers={workers} concurrency={label(concurrency):<4}", cfg.samples, enabled=cfg.progress
    )
    limits: list[tuple[float, int]] = []
    delivered = 0
    first_at = first_samples = 0.0
    t0 = time.perf_counter()
    stats: LoaderStats | None = None
    end = t0
    it = iter(loader)
    try:
        for batch in it:
            now = time.perf_counter()
            delivered += len(batch)
            if first_at == 0.0:
                first_at, first_samples = now, delivered
            stats = loader.stats()
            end = now
            if concurrency is None and (
                not limits or now - first_at >= limits[-1][0] + LIMIT_EVERY
            ):
                limits.append((now - first_at, sum(stats.concurrency)))
            rate = (delivered - first_samples) / (now - first_at) if now > first_at else 0.0
            bar.update(
                delivered,
                f"{rate:8,.0f} samples/s · p50 {stats.latency_p50 * 1e3:.0f} ms"
                f" · in flight {sum(stats.in_flight)}",
            )
            if now - first_at >= cfg.seconds:
                break
    except LoadError as exc:
        error = f"{type(exc).__name__}: {exc}"
        return Setting(workers, concurrency, delivered, stats=loader.stats(), error=error)
    finally:
        bar.close()
        del it
    if delivered > first_samples and end > first_at:
        rate = (delivered - first_samples) / (end - first_at)
    else:  # a single batch: nothing to measure but it, start-up included
        rate = delivered / (end - t0) if end > t0 else 0.0
    per_sample = stats.bytes / stats.samples if stats is not None and stats.samples else 0.0
    return Setting(
        workers=workers,
        concurrency=concurrency,
        samples=delivered,
        samples_per_s=rate,
        bytes_per_s=rate * per_sample,
        startup_s=first_at - t0,
        stats=stats,
        limits=tuple(limits),
    )


def run_bench(urls: list[str], cfg: BenchConfig) -> list[Setting]:
    """Measure every ``(workers, concurrency)`` pair in *cfg*, fewest workers first."""
    # decode=len: the worker reduces each object to its size (a picklable builtin).
    dataset = RemoteFiles(urls, decode=len)
    return [
        _run_one(dataset, w, c, cfg)
        for w in sorted(set(cfg.workers))
        for c in sorted(set(cfg.concurrency), key=_order)
    ]


def recommend(results: Sequence[Setting], objective: str = "balanced") -> Setting | None:
    """The setting *objective* (a key of ``OBJECTIVES``) picks; ``None`` when all failed."""
    ok = [r for r in results if r.error is None and r.samples_per_s > 0 and r.stats is not None]
    if not ok:
        return None
    best = max(r.samples_per_s for r in ok)
    if objective == "throughput":
        good = [r for r in ok if r.samples_per_s >= (1 - TOLERANCE) * best]
        return min(good, key=_cost)
    if objective != "balanced":
        raise UsageError(f"unknown objective {objective!r}: one of {', '.join(OBJECTIVES)}")
    fair = [r for r in ok if r.samples_per_s >= BALANCED_FLOOR * best]

    def power(r: Setting) -> float:
        assert r.stats is not None
        return r.samples_per_s / max(r.stats.latency_p50, 1e-6)

    top = max(power(r) for r in fair)
    # Settings whose "power" is within TOLERANCE of the top are a tie: take the cheapest.
    good = [r for r in fair if power(r) >= (1 - TOLERANCE) * top]
    return min(good, key=_cost)


def _cost(r: Setting) -> tuple[int, int, int]:
    # Fewest workers first; then the default if it is as good (it follows the store when it
    # changes, a fixed value does not), then the lowest fixed value.
    return (r.workers, *(_order(r.concurrency)[::-1]))


def throttle_notes(results: Sequence[Setting]) -> list[str]:
    """One line per setting the store throttled: how often, and what the default did."""
    notes = []
    for r in results:
        s = r.stats
        if s is None or not s.throttled:
            continue
        requests = s.samples + sum(s.retries.values())
        if r.concurrency is None:
            what = "the workers cut their limits and retried within them"
        else:
            what = "a fixed limit keeps asking as fast; the default (auto) backs off"
            if r.error is not None:
                what = "the setting failed: " + what
        notes.append(
            f"note: the store throttled {s.throttled:,} of ~{requests:,} requests "
            f"({s.throttled / max(requests, 1):.1%}) at num_workers={r.workers}, "
            f"max_concurrency={label(r.concurrency)} (503 SlowDown / 429): {what}."
        )
    return notes


def limit_lines(results: Sequence[Setting]) -> list[str]:
    """Where each automatic limit went over time (all workers together)."""
    lines = []
    for r in results:
        if r.concurrency is None and r.limits:
            points = " · ".join(f"{t:.1f} s {n}" for t, n in r.limits[:12])
            more = " ..." if len(r.limits) > 12 else ""
            lines.append(
                f"auto at num_workers={r.workers}: samples in flight allowed over time: "
                f"{points}{more}"
            )
    return lines


def backlog_suspects(results: Sequence[Setting]) -> list[Setting]:
    """Settings with a latency percentile at a SYN-retry mark above the store's own latency.

    The store's own latency is the lowest p50 of the sweep; it must be well under a second, or
    a slow store could not be told from dropped connections.
    """
    ok = [r for r in results if r.error is None and r.stats is not None and r.stats.samples]
    if not ok:
        return []
    base = min(r.stats.latency_p50 for r in ok if r.stats is not None)
    if base >= 0.3:
        return []
    out = []
    for r in ok:
        assert r.stats is not None
        tails = (r.stats.latency_p50, r.stats.latency_p95, r.stats.latency_p99)
        # Histogram buckets are ±9% wide; the retry waits themselves are exact.
        if any(0.9 * m <= t - base <= 1.3 * m for t in tails for m in SYN_RETRY_MARKS):
            out.append(r)
    return out


def fmt_ms(seconds: float) -> str:
    """Milliseconds to 2 significant digits: the latency histogram's buckets are ±9% wide."""
    ms = seconds * 1e3
    if ms >= 10:
        return f"{float(f'{ms:.2g}'):,.0f}"
    return f"{ms:.2g}" if ms >= 1 else f"{ms:.1g}"


def bench_table(results: Sequence[Setting]) -> str:
    rows = []
    for r in results:
        s = r.stats
        if r.error is not None or s is None:
            rows.append(
                [str(r.workers), label(r.concurrency), "failed"] + [""] * 6 + [r.error or ""]
            )
            continue
        extra = ", ".join(f"{k} ×{v}" for k, v in sorted({**s.retries, **s.errors}.items()))
        rows.append(
            [
                str(r.workers),
                label(r.concurrency),
                f"{r.samples_per_s:,.0f}",
                f"{r.bytes_per_s / 1e6:,.2f}",
                fmt_ms(s.latency_p50),
                fmt_ms(s.latency_p95),
                fmt_ms(s.latency_p99),
                f"{r.startup_s:.2f}",
                ",".join(str(c) for c in s.concurrency),
                extra,
            ]
        )
    header = ["workers", "concurrency", "samples/s", "MB/s", "p50 ms", "p95 ms", "p99 ms"]
    header += ["start s", "limit", "retries/errors"]
    return render_table(header, rows)


def check_plotting(path: str) -> None:
    """Raise ``UsageError`` now, not after the sweep, when *path* can't be plotted to."""
    try:
        import matplotlib  # noqa: F401 - first: a stubbed-out matplotlib must fail here
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'asyncload-torch[plot]'") from None
    target = Path(path)
    kinds = FigureCanvasBase.get_supported_filetypes()
    suffix = target.suffix.lstrip(".").lower()
    if suffix not in kinds:
        raise UsageError(
            f"--plot {path}: can't tell the image format from the name; end it in one of "
            + ", ".join(f".{k}" for k in sorted(kinds))
        )
    parent = target.parent
    if target.is_dir():
        raise UsageError(f"--plot {path}: is a directory; give a file name such as sweep.png")
    if not parent.is_dir():
        raise UsageError(f"--plot {path}: no such directory {parent}")
    if not os.access(parent, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise UsageError(f"--plot {path}: not writable")


def plot(results: Sequence[Setting], path: str) -> None:
    """Throughput against concurrency, one line per worker count, saved to *path*."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for workers in sorted({r.workers for r in results}):
        ok = [r for r in results if r.workers == workers and r.error is None]
        pts = [(r.concurrency, r.samples_per_s) for r in ok if r.concurrency is not None]
        line = ax.plot(
            [c for c, _ in pts],
            [rate for _, rate in pts],
            marker="o",
            label=f"num_workers={workers}",
        )
        for r in ok:
            if r.concurrency is None:  # the default: one level, not a point on the axis
                color = line[0].get_color()
                ax.axhline(r.samples_per_s, ls="--", color=color, label=f"{workers}: auto")
    concurrencies = sorted({r.concurrency for r in results if r.concurrency is not None})
    if len(concurrencies) > 1 and concurrencies[0] > 0:
        ax.set_xscale("log", base=2)
    ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
    ax.set_xlabel("max_concurrency (samples in flight per worker)")
    ax.set_ylabel("samples/s")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title("asyncload bench")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as exc:
        raise UsageError(f"can't write {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
