"""asyncload.DataLoader against torch's DataLoader and a raw aiohttp ceiling, over loopback HTTP.

One run prints one table:

* Scenario A (I/O-bound): 50 ms latency, 100 KB objects, 4,096 samples, batch 32, 2 workers.
  Rows: asyncload (max_concurrency=128); torch with a blocking GET per ``__getitem__``; torch
  with a 32-thread pool in ``__getitems__``; one aiohttp event loop with 256 requests in flight
  (the ceiling). Targets: asyncload ≥ 4× threaded torch and ≥ 0.8× the ceiling.
* Scenario B (pure overhead): no latency, 1 KB objects, same rows. Target: asyncload ≥ 1.0×
  blocking torch.
* Peak memory (PSS of this process plus its loader workers and helpers) for every loader row,
  sampled in an untimed epoch after the timed one.
* Memory growth: 10 epochs over 1,000,000 indices with 2 persistent workers; the workers'
  private memory after epoch 1 vs after epoch 10 (target: < 5 % growth), with a contrast row
  holding the same keys in a Python list under ``fork`` (copy-on-read).

The object server runs in its own process (``_server.py``), so its CPU time is not the client's.
Every loader row runs one warm-up epoch with persistent workers first and then times three
epochs, reporting the median, so worker start-up (forkserver importing torch) and connection
set-up are not counted: what is compared is steady-state throughput. The raw ceiling is also
the median of three runs. On a shared 2-core machine absolute numbers are noisy; the ratios,
measured in the same run, are what the targets check.

Usage::

    .venv/bin/python benchmarks/bench_loader.py            # full run, about 2-3 minutes
    .venv/bin/python benchmarks/bench_loader.py --quick    # smoke run, about 20 seconds
    .venv/bin/python benchmarks/bench_loader.py --samples 8192 --latency 20 --json out.json

Profiling: with ``ASYNCLOAD_BENCH_PROFILE=DIR`` set, each asyncload worker runs under cProfile
(started by ``worker_init_fn``, on the worker thread's CPU clock) and writes
``DIR/worker-<pid>.prof`` when it exits; the main process's timed epochs go to
``DIR/main-<scenario>-<row>.prof`` (wall clock). Read them with ``python -m pstats``;
``--only B`` profiles one scenario.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import cProfile
import gc
import http.client
import json
import math
import multiprocessing.util
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import numpy.typing as npt
import psutil
import torch
import torch.utils.data
from _server import ObjectServerProcess, object_bytes

import asyncload

PROFILE_ENV = "ASYNCLOAD_BENCH_PROFILE"
MEMORY_EPOCH = 1024
"""Samples in the epoch that measures a row's peak memory (after its timed epochs)."""
REPEATS = 3
"""Timed epochs per row; the median counts (one epoch of 4,096 samples lasts ~1 s here)."""

# ── what every loader row fetches ─────────────────────────────────────────────────────────────


def collate_bytes(batch: list[bytes]) -> torch.Tensor:
    """Stack equal-sized objects into one ``uint8`` tensor, in shared memory inside a worker.

    Every loader row uses this collate_fn, so they all hand the training loop the same thing
    and pay the same collation cost; shared memory is what default_collate would use too, so
    the batch crosses to the main process without being pickled byte by byte.
    """
    shape = (len(batch), len(batch[0]) if batch else 0)
    if torch.utils.data.get_worker_info() is None:
        out = torch.empty(shape, dtype=torch.uint8)
    else:
        # Allocated in shared memory from the start, as default_collate does: share_memory_()
        # on an ordinary tensor would copy it there (3 MB per batch in scenario A).
        storage = torch.UntypedStorage._new_shared(shape[0] * shape[1])
        out = torch.empty(0, dtype=torch.uint8).set_(storage).view(shape)
    view = out.numpy()
    for k, body in enumerate(batch):
        view[k] = np.frombuffer(body, dtype=np.uint8)
    return out


class AsyncBlobs(asyncload.Dataset[bytes]):
    """asyncload's way: ``await asyncload.read(url)`` on the worker's event loop."""

    def __init__(self, prefix: str, n: int) -> None:
        self.prefix = prefix
        self.n = n

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, index: int) -> bytes:
        return await asyncload.read(f"{self.prefix}/{index}")


# One keep-alive connection per thread (per process after fork: the parent never opens one).
_local = threading.local()


def _blocking_get(host: str, port: int, path: str) -> bytes:
    conn: http.client.HTTPConnection | None = getattr(_local, "conn", None)
    for _attempt in range(2):  # bounded: one reconnect when the server closed a kept-alive socket
        if conn is None:
            conn = _local.conn = http.client.HTTPConnection(host, port, timeout=30)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            body = resp.read()
        except (http.client.HTTPException, ConnectionError):
            conn.close()
            conn = _local.conn = None
            continue
        if resp.status != 200:
            raise RuntimeError(f"GET {path}: HTTP {resp.status}")
        return body
    raise RuntimeError(f"GET {path}: connection failed twice")


class BlockingBlobs(torch.utils.data.Dataset[bytes]):
    """The plain torch way: one blocking GET per ``__getitem__`` (http.client, keep-alive)."""

    def __init__(self, host: str, port: int, path_prefix: str, n: int) -> None:
        self.host, self.port, self.path_prefix, self.n = host, port, path_prefix, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> bytes:
        return _blocking_get(self.host, self.port, f"{self.path_prefix}/{index}")


class ThreadedBlobs(BlockingBlobs):
    """The best plain-torch workaround: a thread pool in ``__getitems__``, one batch at a time."""

    threads = 32

    def __init__(self, host: str, port: int, path_prefix: str, n: int) -> None:
        super().__init__(host, port, path_prefix, n)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pool_pid = 0

    def __getitems__(self, indices: list[int]) -> list[bytes]:
        # Created lazily in each worker: a thread pool does not survive fork.
        if self._pool is None or self._pool_pid != os.getpid():
            self._pool = concurrent.futures.ThreadPoolExecutor(self.threads)
            self._pool_pid = os.getpid()
        return list(self._pool.map(self.__getitem__, indices))

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_pool"] = None
        return state


class EpochSampler(torch.utils.data.Sampler[int]):
    """``range(n)`` with *n* settable between epochs: a short warm-up epoch, then the timed one,
    on the same persistent workers."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))


# ── profiling hook ────────────────────────────────────────────────────────────────────────────


def profile_worker(worker_id: int) -> None:
    """``worker_init_fn`` that profiles the worker's main thread (its event loop) until exit.

    It uses that thread's CPU clock, so time the process spends descheduled (other processes on
    a busy 2-core machine) or waiting for the GIL is not charged to whatever function was running.
    """
    out = os.environ.get(PROFILE_ENV)
    if not out:
        return
    prof = cProfile.Profile(time.thread_time)

    def dump() -> None:
        prof.disable()
        prof.dump_stats(os.path.join(out, f"worker-{os.getpid()}.prof"))

    # Worker processes end through multiprocessing's exit hook, not atexit.
    multiprocessing.util.Finalize(None, dump, exitpriority=100)
    prof.enable()


@contextlib.contextmanager
def profile_main(name: str) -> Iterator[None]:
    """Profile the main thread's timed epoch on the wall clock: its waits are what matter."""
    out = os.environ.get(PROFILE_ENV)
    if not out:
        yield
        return
    prof = cProfile.Profile()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        prof.dump_stats(os.path.join(out, f"main-{name}.prof"))


# ── memory ────────────────────────────────────────────────────────────────────────────────────


def smaps(pid: int) -> dict[str, int]:
    """``/proc/PID/smaps_rollup`` in bytes (Rss, Pss, Uss); RSS alone where that file is missing.

    PSS splits shared pages between the processes sharing them, so summing it over processes
    gives a true total; USS (private pages) is where copy-on-read shows up.
    """
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            fields = {}
            for line in f:
                parts = line.split()
                if len(parts) == 3 and parts[2] == "kB":
                    fields[parts[0].rstrip(":")] = int(parts[1]) * 1024
        uss = fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0)
        return {"rss": fields["Rss"], "pss": fields["Pss"], "uss": uss}
    except (OSError, KeyError):
        try:
            rss = psutil.Process(pid).memory_info().rss
        except psutil.Error:
            return {"rss": 0, "pss": 0, "uss": 0}
        return {"rss": rss, "pss": rss, "uss": rss}


class PeakMemory:
    """Samples the summed PSS of this process and its descendants (but not the HTTP server)."""

    def __init__(self, exclude: set[int], interval: float = 0.5) -> None:
        # Reading smaps_rollup of a process that imported torch costs ~10 ms of kernel time:
        # sample often only where nothing is being timed.
        self.exclude = exclude
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-memory", daemon=True)

    def sample(self) -> int:
        me = psutil.Process()
        pids = [me.pid]
        with contextlib.suppress(psutil.Error):
            pids += [p.pid for p in me.children(recursive=True) if p.pid not in self.exclude]
        total = sum(smaps(pid)["pss"] for pid in pids)
        self.peak = max(self.peak, total)
        return total

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> PeakMemory:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sample()


def client_cpu_seconds(exclude: set[int]) -> dict[int, float]:
    """user+system CPU seconds of this process and each descendant (not the HTTP server).

    Throughput on a shared 2-core machine depends on who else is running; CPU time spent per
    sample does much less, so the table reports both.
    """
    me = psutil.Process()
    procs = [me]
    with contextlib.suppress(psutil.Error):
        procs += [p for p in me.children(recursive=True) if p.pid not in exclude]
    out: dict[int, float] = {}
    for p in procs:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            out[p.pid] = t.user + t.system
    return out


def cpu_delta(before: dict[int, float], after: dict[int, float]) -> float:
    # Only processes alive at both ends: persistent workers are, so a timed epoch is covered.
    return sum(after[pid] - before[pid] for pid in after if pid in before)


# ── throughput rows ───────────────────────────────────────────────────────────────────────────


@dataclass
class Row:
    name: str
    samples: int
    seconds: float
    peak_pss_mib: float | None = None
    note: str = ""
    cpu_seconds: float = float("nan")
    """Client CPU (this process and its loader workers) during the timed epoch."""

    @property
    def cpu_ms_per_1k(self) -> float:
        return self.cpu_seconds / self.samples * 1e6 if self.samples else float("nan")

    @property
    def rate(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else float("nan")


@dataclass
class Scenario:
    title: str
    latency: float
    size: int
    samples: int
    rows: dict[str, Row] = field(default_factory=dict)
    targets: list[dict[str, Any]] = field(default_factory=list)


def _check_first(batch: torch.Tensor, size: int) -> None:
    # Cheap end-to-end check that rows move the real bytes: sample 0 of the epoch is object 0.
    if bytes(batch[0].numpy().tobytes()) != object_bytes(0, size):
        raise AssertionError("loader returned wrong bytes for object 0")


def time_loader(
    make: Callable[[EpochSampler], torch.utils.data.DataLoader[Any]],
    *,
    warmup: int,
    samples: int,
    size: int,
    server_pid: int,
    profile_name: str | None = None,
    repeats: int = REPEATS,
) -> tuple[float, float, float]:
    """Warm-up epoch, *repeats* timed epochs, then a memory epoch, all on the same persistent
    workers; the timed epoch of median length counts.

    Peak memory is sampled in its own epoch (up to :data:`MEMORY_EPOCH` samples, enough to fill
    every pipeline) rather than in the timed one: reading ``smaps_rollup`` walks every mapping
    of every process, ~40 ms of CPU per round on this machine, which the CPU-bound rows would
    pay and the latency-bound ones would not.

    Returns (seconds, peak PSS in MiB, client CPU seconds) of that epoch.
    """
    sampler = EpochSampler(warmup)
    loader = make(sampler)
    try:
        for _ in loader:  # warm-up: workers started, connections open
            pass
        sampler.n = samples
        epochs: list[tuple[float, float]] = []
        ctx = profile_main(profile_name) if profile_name else contextlib.nullcontext()
        with ctx:
            for _ in range(repeats):
                got = 0
                cpu0 = client_cpu_seconds({server_pid})
                t0 = time.perf_counter()
                for k, batch in enumerate(loader):
                    if k == 0:
                        _check_first(batch, size)
                    got += int(batch.shape[0])
                epochs.append(
                    (time.perf_counter() - t0, cpu_delta(cpu0, client_cpu_seconds({server_pid})))
                )
                if got != samples:
                    raise AssertionError(f"expected {samples} samples, got {got}")
        seconds, cpu = sorted(epochs)[len(epochs) // 2]
        sampler.n = min(samples, MEMORY_EPOCH)
        with PeakMemory(exclude={server_pid}, interval=0.05) as mem:
            for _ in loader:
                pass
        return seconds, mem.peak / 2**20, cpu
    finally:
        # Persistent workers stop when the loader (and its iterator) go away.
        del loader
        gc.collect()


async def _raw_ceiling(
    prefix: str, samples: int, warmup: int, in_flight: int
) -> tuple[float, float]:
    connector = aiohttp.TCPConnector(limit=in_flight)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def run(n: int) -> int:
            indices = iter(range(n))
            received = 0

            async def fetcher() -> None:
                nonlocal received
                for i in indices:  # a shared iterator: each coroutine takes the next index
                    async with session.get(f"{prefix}/{i}") as resp:
                        resp.raise_for_status()
                        received += len(await resp.read())

            await asyncio.gather(*(fetcher() for _ in range(in_flight)))
            return received

        await run(warmup)
        runs = []
        for _ in range(REPEATS):
            cpu0 = time.process_time()
            t0 = time.perf_counter()
            await run(samples)
            runs.append((time.perf_counter() - t0, time.process_time() - cpu0))
        return sorted(runs)[len(runs) // 2]


def raw_ceiling(prefix: str, samples: int, in_flight: int = 256) -> tuple[float, float]:
    """Seconds and CPU seconds for *samples* GETs from one event loop in this process."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop missing
        return asyncio.run(_raw_ceiling(prefix, samples, in_flight, in_flight))
    # uvloop, as asyncload's workers use: the ceiling should not be held back by the loop.
    return uvloop.run(_raw_ceiling(prefix, samples, in_flight, in_flight))


def run_scenario(
    sc: Scenario,
    server: ObjectServerProcess,
    *,
    batch_size: int,
    workers: int,
    blocking_seconds: float,
    key: str,
) -> None:
    prefix = server.prefix(sc.size, sc.latency)
    path_prefix = prefix[len(server.base_url) :]
    n = sc.samples

    def rounded(k: int) -> int:
        return max(batch_size, k // batch_size * batch_size)

    common: dict[str, Any] = {
        "batch_size": batch_size,
        "num_workers": workers,
        "collate_fn": collate_bytes,
        "persistent_workers": True,
    }
    timing: dict[str, Any] = {"size": sc.size, "server_pid": server.pid}

    # Ceiling first: it only needs this process.
    sec, cpu = raw_ceiling(prefix, n)
    sc.rows["raw"] = Row("raw aiohttp, 1 loop, 256 in flight", n, sec, cpu_seconds=cpu)

    conc = 128
    sec, peak, cpu = time_loader(
        lambda s: asyncload.DataLoader(
            AsyncBlobs(prefix, n),
            sampler=s,
            max_concurrency=conc,
            worker_init_fn=profile_worker,
            **common,
        ),
        warmup=rounded(workers * conc),
        samples=n,
        profile_name=f"{key}-asyncload",
        **timing,
    )
    sc.rows["asyncload"] = Row(f"asyncload (max_concurrency={conc})", n, sec, peak, cpu_seconds=cpu)

    sec, peak, cpu = time_loader(
        lambda s: torch.utils.data.DataLoader(
            ThreadedBlobs(server.host, server.port, path_prefix, n), sampler=s, **common
        ),
        warmup=rounded(workers * batch_size),
        samples=n,
        profile_name=f"{key}-threaded",
        **timing,
    )
    sc.rows["threaded"] = Row(
        "torch, 32-thread pool in __getitems__", n, sec, peak, cpu_seconds=cpu
    )

    # One request at a time per worker: at 50 ms that is ~40 samples/s, so 4,096 samples would
    # take 100 s. Time fewer (rate is what is compared), once, and say so.
    nb = n
    note = ""
    repeats = REPEATS
    if sc.latency > 0:
        nb = min(n, rounded(int(blocking_seconds * workers / sc.latency)))
        if nb < n:
            note = f"{nb} samples (~{blocking_seconds:g} s at 1 request per worker), 1 epoch"
            repeats = 1
    sec, peak, cpu = time_loader(
        lambda s: torch.utils.data.DataLoader(
            BlockingBlobs(server.host, server.port, path_prefix, n), sampler=s, **common
        ),
        warmup=rounded(workers * batch_size),
        samples=nb,
        profile_name=f"{key}-blocking",
        repeats=repeats,
        **timing,
    )
    sc.rows["blocking"] = Row(
        "torch, blocking GET per __getitem__", nb, sec, peak, note, cpu_seconds=cpu
    )


# ── memory growth ─────────────────────────────────────────────────────────────────────────────


class NumpyKeys(asyncload.RemoteFiles):
    """``RemoteFiles`` (URLs in two NumPy arrays) whose item is a whole index batch.

    Per index it builds the URL from the arrays, as ``RemoteFiles.__getitem__`` does per sample
    (the per-index metadata access that copy-on-read would punish); it reads one tiny object per
    batch, so 10 epochs of 1M indices stay fast while every batch still goes through
    ``asyncload.read``.
    """

    async def __getitem__(self, indices: npt.NDArray[np.int64]) -> tuple[int, int]:  # type: ignore[override]
        total = 0
        for i in indices.tolist():
            total += len(self.url(i))
        await asyncload.read(self.url(int(indices[0])))
        return os.getpid(), total


class ListKeys(asyncload.Dataset[tuple[int, int]]):
    """The same keys in a Python list: reading ``urls[i]`` writes the str's reference count,
    which copies its page in a forked worker (copy-on-read)."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls

    def __len__(self) -> int:
        return len(self.urls)

    async def __getitem__(self, indices: npt.NDArray[np.int64]) -> tuple[int, int]:  # type: ignore[override]
        urls = self.urls
        total = 0
        for i in indices.tolist():
            total += len(urls[i])
        await asyncload.read(urls[int(indices[0])])
        return os.getpid(), total


class GrowthSampler(torch.utils.data.Sampler[npt.NDArray[np.int64]]):
    """Shuffled index batches (NumPy arrays, one ``__getitem__`` each), after a probe epoch.

    The probe epoch hands each worker one single-index batch, so the workers exist, are
    known by pid and have touched (almost) no keys: their memory then is the baseline.
    """

    def __init__(self, n: int, batch: int, workers: int, seed: int = 0) -> None:
        self.n, self.batch, self.workers = n, batch, workers
        self.probe = True
        self.gen = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return self.workers if self.probe else math.ceil(self.n / self.batch)

    def __iter__(self) -> Iterator[npt.NDArray[np.int64]]:
        if self.probe:
            # Batches go to workers round-robin: one each.
            yield from (np.array([w], dtype=np.int64) for w in range(self.workers))
            return
        # Shuffled, as training is: each epoch a worker touches a different random half.
        perm = torch.randperm(self.n, generator=self.gen).numpy()
        for k in range(0, self.n, self.batch):
            yield perm[k : k + self.batch]


@dataclass
class GrowthRow:
    name: str
    context: str
    seconds: float = 0.0
    # Summed over the workers, in bytes: {"rss", "pss", "uss"} at each point.
    start: dict[str, int] = field(default_factory=dict)
    epoch1: dict[str, int] = field(default_factory=dict)
    last: dict[str, int] = field(default_factory=dict)

    def growth(self, since: str = "epoch1", metric: str = "uss") -> float:
        base = getattr(self, since)[metric]
        return (self.last[metric] - base) / base * 100 if base else float("nan")


def _sum_mem(pids: set[int]) -> dict[str, int]:
    total = {"rss": 0, "pss": 0, "uss": 0}
    for pid in pids:
        for k, v in smaps(pid).items():
            total[k] += v
    return total


def measure_growth(
    name: str,
    dataset: torch.utils.data.Dataset[Any],
    *,
    context: str,
    epochs: int,
    batch_indices: int,
    workers: int,
    expect_total: int,
) -> GrowthRow:
    row = GrowthRow(name, context)
    n = len(dataset)  # type: ignore[arg-type]
    sampler = GrowthSampler(n, batch_indices, workers)
    loader = asyncload.DataLoader(
        dataset,
        sampler=sampler,
        batch_size=None,  # each "sample" is a whole index batch: one __getitem__ per batch
        num_workers=workers,
        persistent_workers=True,
        multiprocessing_context=context,
    )
    t0 = time.perf_counter()
    try:
        pids = {pid for pid, _ in loader}  # the probe epoch
        if len(pids) != workers:
            raise AssertionError(f"{name}: probe epoch reached {len(pids)} of {workers} workers")
        row.start = _sum_mem(pids)
        sampler.probe = False
        for epoch in range(1, epochs + 1):
            total = 0
            for _, chars in loader:
                total += chars
            if total != expect_total:
                raise AssertionError(f"{name}: epoch {epoch} touched {total} chars")
            # Persistent workers sit idle between epochs: a stable moment to read them.
            mem = _sum_mem(pids)
            if epoch == 1:
                row.epoch1 = mem
            row.last = mem
    finally:
        del loader
        gc.collect()
    row.seconds = time.perf_counter() - t0
    return row


# ── output ────────────────────────────────────────────────────────────────────────────────────


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def evaluate_targets(a: Scenario, b: Scenario) -> None:
    ra, rb = a.rows, b.rows
    checks: list[tuple[Scenario, str, float, float]] = []
    if ra:
        checks += [
            (a, "asyncload / torch threaded", ra["asyncload"].rate / ra["threaded"].rate, 4.0),
            (a, "asyncload / raw ceiling", ra["asyncload"].rate / ra["raw"].rate, 0.8),
        ]
    if rb:
        checks.append(
            (b, "asyncload / torch blocking", rb["asyncload"].rate / rb["blocking"].rate, 1.0)
        )
    for sc, what, value, target in checks:
        sc.targets.append(
            {"target": f"{what} >= {target:g}x", "value": value, "pass": value >= target}
        )


def print_scenario(sc: Scenario, batch_size: int, workers: int) -> None:
    print(
        f"\n{sc.title}: latency {sc.latency * 1000:g} ms, {sc.size:,} B objects, "
        f"{sc.samples:,} samples, batch {batch_size}, {workers} workers"
    )
    head = f"  {'loader':<40} {'samples':>8} {'seconds':>8} {'samples/s':>10} "
    head += f"{'asyncload÷row':>14} {'CPU ms/1k':>10} {'peak PSS MiB':>13}"
    print(head)
    ours = sc.rows["asyncload"].rate
    for key in ("asyncload", "threaded", "blocking", "raw"):
        r = sc.rows[key]
        peak = f"{r.peak_pss_mib:13.0f}" if r.peak_pss_mib is not None else f"{'(this proc)':>13}"
        line = f"  {r.name:<40} {r.samples:>8,} {r.seconds:>8.2f} {r.rate:>10,.0f} "
        line += f"{ours / r.rate:>13.2f}x {r.cpu_ms_per_1k:>10.0f} {peak}"
        if r.note:
            line += f"  [{r.note}]"
        print(line)
    for t in sc.targets:
        print(f"  target {t['target']:<40} {t['value']:>6.2f}x  {_verdict(t['pass'])}")


def print_growth(
    rows: list[GrowthRow], indices: int, epochs: int, batch: int, workers: int
) -> None:
    print(
        f"\nMemory growth: {epochs} epochs over {indices:,} indices (shuffled), {workers} "
        f"persistent workers; workers' memory summed, MiB"
    )
    print(
        f"  (fast path: batch_size=None with {batch:,}-index batches, one async __getitem__ per "
        "batch touching every index's key, one tiny HTTP read per batch; 'start' = after a "
        "probe epoch of one index per worker)"
    )
    print(
        f"  {'dataset':<38} {'start via':>10} {'USS start':>9} {'USS ep1':>8} "
        f"{'USS ep' + str(epochs):>8} {'PSS ep' + str(epochs):>8} {'ep1→last':>9} "
        f"{'start→last':>10} {'sec':>6}"
    )
    mib = 2**20
    for r in rows:
        line = f"  {r.name:<38} {r.context:>10} {r.start['uss'] / mib:>9.1f} "
        line += f"{r.epoch1['uss'] / mib:>8.1f} {r.last['uss'] / mib:>8.1f} "
        line += f"{r.last['pss'] / mib:>8.1f} {r.growth():>+8.1f}% "
        line += f"{r.growth('start'):>+9.1f}% {r.seconds:>6.1f}"
        print(line)
    target = rows[0]
    print(
        f"  target asyncload workers' USS growth epoch 1→{epochs} < 5%: "
        f"{target.growth():+.1f}%  {_verdict(target.growth() < 5.0)}"
    )


# ── main ──────────────────────────────────────────────────────────────────────────────────────


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small, fast smoke run (~20 s)")
    parser.add_argument("--samples", type=int, help="scenario A samples (default 4096)")
    parser.add_argument("--samples-b", type=int, help="scenario B samples (default 2× A's)")
    parser.add_argument("--latency", type=float, help="scenario A latency in ms (default 50)")
    parser.add_argument("--size", type=int, default=100_000, help="scenario A object bytes")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--indices", type=int, help="memory-growth dataset size (default 1M)")
    parser.add_argument("--epochs", type=int, help="memory-growth epochs (default 10)")
    parser.add_argument("--no-contrast", action="store_true", help="skip the fork contrast rows")
    parser.add_argument(
        "--only",
        default="A,B,memory",
        help="comma-separated parts to run: A, B, memory (default: all; for profiling)",
    )
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    args = parser.parse_args(argv)

    quick = args.quick
    samples = args.samples or (512 if quick else 4096)
    samples_b = args.samples_b or 2 * samples
    latency = (args.latency if args.latency is not None else (20.0 if quick else 50.0)) / 1000
    indices = args.indices or (100_000 if quick else 1_000_000)
    epochs = args.epochs or (3 if quick else 10)
    batch_indices = 10_000
    blocking_seconds = 2.0 if quick else 8.0
    workers, batch_size = args.workers, args.batch_size

    t_start = time.perf_counter()
    cpus = os.cpu_count()
    print(f"asyncload {asyncload.__version__}, torch {torch.__version__}, {cpus} CPUs")
    print(
        f"timed: median of {REPEATS} epochs on persistent workers after a warm-up epoch "
        "(start-up, connections)"
    )

    a = Scenario("A (I/O-bound)", latency, args.size, samples)
    b = Scenario("B (overhead)", 0.0, 1000, samples_b)
    growth: list[GrowthRow] = []
    parts = {p.strip() for p in args.only.split(",")}
    with ObjectServerProcess() as server:
        for sc, key in ((a, "A"), (b, "B")):
            if key not in parts:
                continue
            run_scenario(
                sc,
                server,
                batch_size=batch_size,
                workers=workers,
                blocking_seconds=blocking_seconds,
                key=key,
            )
        evaluate_targets(a, b)
        print(
            "\n(CPU ms/1k = client CPU — this process and its loader workers — per 1,000 samples"
            " in the timed epoch: less sensitive than samples/s to other load on the machine)"
        )
        for sc in (a, b):
            if sc.rows:
                print_scenario(sc, batch_size, workers)
        if "memory" not in parts:
            print(f"\ntotal {time.perf_counter() - t_start:.0f} s")
            return 0

        prefix = server.prefix(1, 0.0)
        urls = [f"{prefix}/{i}" for i in range(indices)]
        expect = sum(map(len, urls))
        kw: dict[str, Any] = {
            "epochs": epochs,
            "batch_indices": batch_indices,
            "workers": workers,
            "expect_total": expect,
        }
        growth.append(
            measure_growth(
                "asyncload.RemoteFiles (NumPy arrays)",
                NumpyKeys(urls),
                context="forkserver",
                **kw,
            )
        )
        if not args.no_contrast:
            # The same NumPy-backed keys shared with forked workers: isolates the storage from
            # the start method.
            growth.append(
                measure_growth(
                    "asyncload.RemoteFiles (NumPy arrays)", NumpyKeys(urls), context="fork", **kw
                )
            )
            # `urls` was built in this process before the workers fork: the children share
            # its pages until they touch them.
            growth.append(
                measure_growth("Python list[str] keys", ListKeys(urls), context="fork", **kw)
            )
        del urls
        print_growth(growth, indices, epochs, batch_indices, workers)

    elapsed = time.perf_counter() - t_start
    print(f"\ntotal {elapsed:.0f} s")
    if args.json:
        out = {
            "scenarios": {
                key: {
                    **{k: v for k, v in asdict(sc).items() if k != "rows"},
                    "rows": {
                        rk: {**asdict(r), "samples_per_s": r.rate} for rk, r in sc.rows.items()
                    },
                }
                for key, sc in (("A", a), ("B", b))
            },
            "memory_growth": [
                {
                    **asdict(r),
                    "growth_epoch1_pct": r.growth(),
                    "growth_start_pct": r.growth("start"),
                }
                for r in growth
            ],
            "growth_target_pass": bool(growth and growth[0].growth() < 5.0),
            "seconds": elapsed,
            "argv": sys.argv[1:],
        }
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
