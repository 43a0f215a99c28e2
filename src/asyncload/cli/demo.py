"""``asyncload demo``: the same training steps fed by asyncload and by torch's DataLoader.

Both runs train the same small CNN from the same initial weights on the same sample order, with
the same number of worker processes started the same way (``forkserver``). The only difference
is the dataset's ``__getitem__``:

* asyncload: ``async def``, awaited on the worker's event loop, ``max_concurrency`` at a time;
* torch: a plain ``def`` making one blocking GET (through the same client, with keep-alive and
  retries, on a private event loop per worker), so each worker has one request in flight.

Every sample is returned with its index and the CRC-32 of its bytes; the demo checks that each
loader delivered exactly the indices it was asked for and that both saw the same bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing.context
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.utils.data
from torch import nn

from .._loader.loader import DataLoader
from .._redact import redact_url
from .._stats.loader_stats import LoaderStats
from .._workers.start_method.context import resolve_context
from . import demo_server as _demo_server
from .bench import fmt_ms
from .console import Progress, UsageError, find_objects, read_sync, render_table
from .demo_data import AsyncRecords, BlockingRecords, decode_record, embedded_store, sample_order

__all__ = ["DemoConfig", "RunResult", "embedded_store", "run_demo"]

NUM_CLASSES = _demo_server.NUM_CLASSES


@dataclasses.dataclass(frozen=True, slots=True)
class DemoConfig:
    """What ``asyncload demo`` was asked to do."""

    url: str | None = None
    """A prefix or manifest of CIFAR-10 binary records; ``None`` for the embedded store."""
    steps: int = 20
    """Training steps per loader."""
    batch_size: int = 32
    """Samples per step."""
    workers: int = 2
    """Worker processes, the same for both loaders."""
    max_concurrency: int = 64
    """Samples in flight per asyncload worker."""
    latency: float = 0.05
    """Seconds the embedded store waits before answering each request."""
    objects: int = 1024
    """Records in the embedded store."""
    seed: int = 0
    """Seeds the data, the sample order and the model's initial weights."""
    progress: bool | None = None
    """Draw progress bars: ``None`` when stderr is a terminal."""


@dataclasses.dataclass(frozen=True, slots=True)
class RunResult:
    """What one loader did for the training loop."""

    name: str
    requested: int
    """Samples the sampler asked for (``steps × batch_size``)."""
    delivered: int
    """Samples that reached the training loop."""
    exact: bool
    """The delivered indices are exactly the requested ones (as a multiset)."""
    checksums: dict[int, int]
    """CRC-32 of each delivered sample's bytes, by index."""
    wall_s: float
    """From creating the iterator to the end of the last step."""
    first_batch_s: float
    """From creating the iterator to the first batch (worker start-up included)."""
    wait_s: float
    """Time the training loop spent in ``next()`` waiting for a batch."""
    final_loss: float
    stats: LoaderStats | None = None
    """``loader.stats()`` after the last step (asyncload only)."""

    @property
    def samples_per_s(self) -> float:
        return self.delivered / self.wall_s if self.wall_s > 0 else 0.0


# ── training ───────────────────────────────────────────────────────────────────────────────


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, NUM_CLASSES),
    )


def start_context() -> multiprocessing.context.BaseContext:
    """asyncload's default (forkserver, torch preloaded), used for both loaders: equal start-up
    costs, and safe after the main process has used obstore to list the objects."""
    ctx = resolve_context(None)
    # Start the fork server (and let it import torch) now, so neither run pays for it.
    proc = ctx.Process(target=_noop, daemon=True)  # type: ignore[attr-defined]
    proc.start()
    proc.join()
    return ctx


def _noop() -> None:
    pass


def train(
    loader: torch.utils.data.DataLoader[Any],
    *,
    name: str,
    order: list[int],
    steps: int,
    seed: int,
    progress: bool | None,
) -> RunResult:
    """Run *steps* training steps from *loader*; check what it delivered."""
    torch.manual_seed(seed)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    bar = Progress(f"{name:>9}", len(order), enabled=progress)
    seen: list[np.ndarray[Any, Any]] = []
    checksums: dict[int, int] = {}
    wait = 0.0
    first = 0.0
    wall = 0.0
    loss = torch.tensor(float("nan"))
    delivered = 0
    stats: LoaderStats | None = None
    if loader.num_workers:
        # The first batch waits for the workers to start: say so rather than sit silent.
        print(
            f"{name:>9}: starting {_workers(loader.num_workers)}, then training…",
            file=sys.stderr,
            flush=True,
        )
    t0 = time.perf_counter()
    it = iter(loader)  # starts the workers: part of the wait, as in `for batch in loader`
    tw = t0
    try:
        for step in range(steps + 1):
            batch = next(it, None)
            if batch is None:
                break
            if step == steps:
                raise RuntimeError(f"{name} yielded more than the {steps} batches asked for")
            wait += time.perf_counter() - tw
            if step == 0:
                first = time.perf_counter() - t0
            images, labels, indices, crcs = batch
            x = images.float().div_(255.0).sub_(0.5)
            loss = loss_fn(model(x), labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            delivered += len(indices)
            seen.append(indices.numpy().copy())
            checksums.update(zip(indices.tolist(), crcs.tolist(), strict=True))
            if isinstance(loader, DataLoader):
                stats = loader.stats()
            elapsed = time.perf_counter() - t0
            text = f"{delivered / elapsed:,.0f} samples/s · waited {wait:.2f} s"
            if stats is not None:
                p50, flying = stats.latency_p50 * 1e3, sum(stats.in_flight)
                text += f" · p50 {p50:.0f} ms · {flying} in flight"
            bar.update(delivered, text, force=step == steps - 1)
            wall = elapsed
            tw = time.perf_counter()
    finally:
        bar.close()
        del it  # shuts the workers down if the loop ended early
    got = np.sort(np.concatenate(seen)) if seen else np.empty(0, dtype=np.int64)
    exact = bool(np.array_equal(got, np.sort(np.asarray(order, dtype=np.int64))))
    return RunResult(
        name=name,
        requested=len(order),
        delivered=delivered,
        exact=exact,
        checksums=checksums,
        wall_s=wall,
        first_batch_s=first,
        wait_s=wait,
        final_loss=float(loss.item()),
        stats=stats,
    )


def run_demo(cfg: DemoConfig) -> tuple[RunResult, RunResult, str]:
    """Run both loaders and return their results and the table (printed by the caller)."""
    threads = torch.get_num_threads()
    # One compute thread: the cores are shared with the workers and the embedded store, and
    # intra-op threads that wait for a busy core make every step slow for both loaders.
    torch.set_num_threads(1)
    try:
        return _run_demo(cfg)
    finally:
        torch.set_num_threads(threads)


def _run_demo(cfg: DemoConfig) -> tuple[RunResult, RunResult, str]:
    with contextlib.ExitStack() as stack:
        if cfg.url is None:
            url = stack.enter_context(
                embedded_store(objects=cfg.objects, latency=cfg.latency, seed=cfg.seed)
            )
            where = (
                f"embedded store {url} ({cfg.objects} records, {cfg.latency * 1e3:g} ms latency)"
            )
        else:
            url = cfg.url
            where = redact_url(url)
        urls = find_objects(url)
        try:
            decode_record(0, read_sync(urls[0]))
        except ValueError as exc:
            raise UsageError(f"{redact_url(urls[0])}: {exc}") from None
        order = sample_order(len(urls), cfg.steps * cfg.batch_size, cfg.seed)
        print(
            f"asyncload demo: {cfg.steps} steps × {cfg.batch_size} samples from {where}, "
            f"{_workers(cfg.workers)}",
            file=sys.stderr,
        )
        if cfg.workers > 0:
            print(
                "asyncload demo: starting the fork server, which imports torch once for both "
                "loaders' workers (a few seconds)…",
                file=sys.stderr,
                flush=True,
            )
        common: dict[str, Any] = {
            "batch_size": cfg.batch_size,
            "sampler": order,
            "num_workers": cfg.workers,
            "multiprocessing_context": start_context() if cfg.workers > 0 else None,
        }
        fast = train(
            DataLoader(AsyncRecords(urls), max_concurrency=cfg.max_concurrency, **common),
            name="asyncload",
            order=order,
            steps=cfg.steps,
            seed=cfg.seed,
            progress=cfg.progress,
        )
        blocking = BlockingRecords(urls)
        try:
            slow = train(
                torch.utils.data.DataLoader(blocking, **common),
                name="torch",
                order=order,
                steps=cfg.steps,
                seed=cfg.seed,
                progress=cfg.progress,
            )
        finally:
            blocking.close()  # only used in this process when workers == 0
    return fast, slow, demo_table(fast, slow, cfg)


def demo_table(fast: RunResult, slow: RunResult, cfg: DemoConfig) -> str:
    """The side-by-side table: asyncload, torch and asyncload ÷ torch."""

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}×" if b > 0 else "—"

    same = fast.checksums == slow.checksums
    f, t = fast, slow
    rows = [
        ["samples delivered", f"{f.delivered}/{f.requested}", f"{t.delivered}/{t.requested}", ""],
        ["exactly the requested samples", _yes(f.exact), _yes(t.exact), ""],
        ["samples/s", f"{f.samples_per_s:,.1f}", f"{t.samples_per_s:,.1f}",
         ratio(f.samples_per_s, t.samples_per_s)],
        ["waiting for data (s)", f"{f.wait_s:.2f}", f"{t.wait_s:.2f}", ratio(f.wait_s, t.wait_s)],
        ["training steps (s)", f"{f.wall_s - f.wait_s:.2f}", f"{t.wall_s - t.wait_s:.2f}", ""],
        ["wall time (s)", f"{f.wall_s:.2f}", f"{t.wall_s:.2f}", ratio(f.wall_s, t.wall_s)],
        ["first batch (s)", f"{f.first_batch_s:.2f}", f"{t.first_batch_s:.2f}", ""],
        ["final loss", f"{f.final_loss:.4f}", f"{t.final_loss:.4f}", ""],
    ]  # fmt: skip
    s = f.stats
    if s is not None:
        latency = f"{fmt_ms(s.latency_p50)}/{fmt_ms(s.latency_p99)}"
        rows.append(["fetch latency p50/p99 (ms)", latency, "—", ""])
    table = render_table(["", "asyncload", "torch", "asyncload ÷ torch"], rows)
    notes = [
        f"same bytes in both runs: {_yes(same)} (CRC-32 of every sample)",
        f"{_workers(cfg.workers)} each; asyncload max_concurrency={cfg.max_concurrency}, "
        "torch one blocking GET per __getitem__",
    ]
    return table + "\n" + "\n".join(notes)


def _workers(n: int) -> str:
    return "no worker processes" if n == 0 else f"{n} worker{'s' if n > 1 else ''}"


def _yes(flag: bool) -> str:
    return "yes" if flag else "NO"
