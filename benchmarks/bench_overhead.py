"""The loader's own CPU per sample, without a network: an in-memory store.

Issue 32 counts the CPU a loader spends per sample. Over the loopback store that figure moves
by 10-20% from run to run (the store's CPU shares the machine's cores), which hides changes of
a few percent. Here every row reads from a backend registered as ``mem://`` whose read
suspends once, as a network read does, and then answers with the same 100 KB object: what is
left is asyncload's own work. Rows, each in a fresh interpreter, in rounds (median and range):

* ``backend.read``: the bare backend, 128 tasks reading at once;
* ``asyncload.read``: the public read (options, retries, stats, hedged rounds), 128 tasks;
* ``DataLoader, default``: ``RemoteFiles`` of the ``mem://`` URLs, 2 workers, batch 32,
  ``collate_fn=list``, the default (adaptive) ``max_concurrency``: the workers' CPU per sample
  (``stats().worker_cpu_s``), the main process's, and where the limits ended;
* ``DataLoader, max_concurrency=32``: the same with a fixed 32 per worker.

A store that answers at once leaves each worker bound by its own CPU, as local files and a warm
cache do: the adaptive limit then shrinks to a few in flight (its own queue is the only latency
it sees), where each turn of a worker's loop reads few answers. The last two rows differ by
that and by what the controller costs per sample.

    .venv/bin/python benchmarks/bench_overhead.py            # about a minute
    .venv/bin/python benchmarks/bench_overhead.py --quick    # smoke run, 2,048 objects, 1 round
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _children import result, spawn

import asyncload
from asyncload.sources import Backend, ObjectInfo, register

SIZE = 100_000
IN_FLIGHT = 128
BATCH = 32
FIXED = 32
_BLOB = bytes(SIZE)

ROWS = {
    "backend": "backend.read",
    "read": "asyncload.read",
    "loader": "DataLoader, default",
    "fixed": f"DataLoader, max_concurrency={FIXED}",
}


class Memory(Backend):
    """Every object is the same 100 KB; a read suspends once, as a network read does."""

    async def read(self, url: str, start: int | None, end: int | None, options: Any) -> bytes:
        await asyncio.sleep(0)
        return _BLOB[start or 0 : end]

    async def stream(self, url: str, start: int, chunk_size: int, options: Any) -> Any:
        yield _BLOB[start:]

    async def stat(self, url: str, options: Any) -> ObjectInfo:
        return ObjectInfo(url, SIZE, None, None)

    async def list(self, prefix_url: str, options: Any) -> list[str]:
        return []


# At import: a worker started by the forkserver imports this module again, and reads mem://.
register("mem", Memory())


def _urls(n: int) -> list[str]:
    return [f"mem://bench/{i}" for i in range(n)]


async def _drive(urls: list[str], row: str) -> None:
    from asyncload._storage.api import _backend
    from asyncload._storage.config import options_for

    backend, options = _backend(urls[0]), options_for(urls[0])
    todo = iter(urls)

    async def task() -> None:
        for url in todo:
            data = (
                await backend.read(url, None, None, options)
                if row == "backend"
                else await asyncload.read(url)
            )
            if len(data) != SIZE:
                raise AssertionError(f"{url}: wrong size")

    await asyncio.gather(*(task() for _ in range(IN_FLIGHT)))
    await asyncload.aclose()


def _child(row: str, n: int) -> None:
    urls = _urls(n)
    if row in ("backend", "read"):
        c0, t0 = time.process_time(), time.perf_counter()
        uvloop.run(_drive(urls, row))
        cpu, wall = time.process_time() - c0, time.perf_counter() - t0
        result(cpu_us=cpu / n * 1e6, rate=n / wall)
        return
    options = {"max_concurrency": FIXED} if row == "fixed" else {}
    loader = asyncload.DataLoader(
        asyncload.RemoteFiles(urls), batch_size=BATCH, num_workers=2, collate_fn=list, **options
    )
    time.sleep(1.0)  # the workers start meanwhile, as while a user builds the model
    c0, t0 = time.process_time(), time.perf_counter()
    seen = sum(len(batch) for batch in loader)
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    if seen != n:
        raise AssertionError(f"{seen} samples of {n}")
    stats = loader.stats()
    result(
        cpu_us=stats.worker_cpu_s / n * 1e6,
        main_us=cpu / n * 1e6,
        rate=n / wall,
        limit=sum(stats.concurrency),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 2,048 objects, 1 round")
    parser.add_argument("--samples", type=int, help="objects per row (default 40,960)")
    parser.add_argument("--repeat", type=int, help="rounds of every row (default 3, --quick 1)")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child[0], int(args.child[1]))
        return 0
    n = args.samples or (2048 if args.quick else 40_960)
    rounds = args.repeat or (1 if args.quick else 3)
    got: dict[str, list[dict[str, float]]] = {row: [] for row in ROWS}
    for k in range(rounds):
        for row in ROWS if k % 2 == 0 else list(ROWS)[::-1]:
            got[row].append(spawn(__file__, row, str(n), what=row))
    print(
        f"\n{n:,} reads of {SIZE // 1000} KB from an in-memory store, a fresh interpreter per "
        f"row, median of {rounds} round(s); a loader's CPU is its workers'\n"
    )
    print("| row | CPU µs per sample | range | main process µs | samples/s | limits, summed |")
    print("|---|---|---|---|---|---|")
    for row, label in ROWS.items():
        runs = got[row]
        cpus = [r["cpu_us"] for r in runs]
        main_us = [r["main_us"] for r in runs if "main_us" in r]
        limits = [r["limit"] for r in runs if "limit" in r]
        print(
            f"| {label} | {statistics.median(cpus):.1f} | {min(cpus):.1f}-{max(cpus):.1f} "
            f"| {f'{statistics.median(main_us):.1f}' if main_us else ''} "
            f"| {statistics.median(r['rate'] for r in runs):,.0f} "
            f"| {f'{statistics.median(limits):.0f}' if limits else ''} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
