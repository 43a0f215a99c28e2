"""The local cache: epoch 2 from the cache vs epoch 1 from a 50 ms store vs the local disk.

One run, one table. N x 100 KB objects behind the loopback object server (``_server.py``, its
own process) at 50 ms per request. Rows:

* ``asyncload.read`` loop (256 in flight) without a cache: what every epoch costs today;
* the same with ``cache_dir`` set: epoch 1 (cold: fetch and store) and epoch 2 (warm);
* the same objects as files on the local disk, read by a plain Python loop (the ceiling);
* ``asyncload.DataLoader`` (2 workers, batch 32) over ``RemoteFiles`` with the cache, epoch 1
  and epoch 2 (steady samples/s: first batch to last; and whole epochs, start-up included);
* the same loader over the local files (no store, no cache; asyncload's file backend): what
  the loader moves when no store is involved;
* when litdata is installed (the ``benchmarks`` extra): its ``StreamingRawDataset`` with
  ``cache_files=True`` under torch's DataLoader (2 persistent workers, batch 32) over the same
  server as an S3 endpoint, epoch 1 and epoch 2, in a fresh interpreter.

Before each warm epoch the entries are made to look a minute old, so every hit pays its LRU
touch as in a real epoch 2 (entries used within the last 10 s are not touched again).

Both the cache and the local files were just written, so both are in the page cache: the
comparison is of the code paths, not of the disk.

    .venv/bin/python benchmarks/bench_cache.py            # about a minute
    .venv/bin/python benchmarks/bench_cache.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _peers import BUCKET, installed, litdata_dataset
from _server import ObjectServerProcess, object_bytes

import asyncload
from asyncload._storage import api as _storage
from asyncload._storage import cache as _cache

SIZE = 100_000
LATENCY = 0.05
IN_FLIGHT = 256


def _run(coro: Callable[[], Coroutine[Any, Any, float]]) -> float:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop missing
        return asyncio.run(coro())
    return uvloop.run(coro())


async def _read_loop(urls: list[str], check: bool) -> float:
    async def fetcher(items: Iterator[tuple[int, str]]) -> None:
        for i, url in items:
            data = await asyncload.read(url)
            if check and data != object_bytes(i, SIZE):
                raise AssertionError(f"object {i}: wrong bytes")
            if len(data) != SIZE:  # (checked without a compare in the timed rows)
                raise AssertionError(f"object {i}: {len(data)} bytes")

    items = iter(enumerate(urls))
    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(fetcher(items) for _ in range(IN_FLIGHT)))
    finally:
        await asyncload.aclose()
    return len(urls) / (time.perf_counter() - t0)


def _local_loop(paths: list[str]) -> float:
    t0 = time.perf_counter()
    for path in paths:
        with open(path, "rb") as f:
            if len(f.read()) != SIZE:
                raise AssertionError(path)
    return len(paths) / (time.perf_counter() - t0)


def _age(root: Path) -> None:
    """Make every entry look last used a minute ago, as entries are when epoch 2 comes: each
    hit then pays its LRU touch (an ``os.utime``) as it would in a real epoch. The process
    also forgets which entries it touched lately (it would not touch them again)."""
    _cache.reset()
    past = time.time() - 60
    for sub in (root / "objects").iterdir():
        for entry in sub.iterdir():
            os.utime(entry, (past, past))


def _loader_epochs(urls: list[str]) -> list[tuple[float, float]]:
    """(steady samples/s from the first batch to the last, whole epoch samples/s) per epoch."""
    loader = asyncload.DataLoader(
        asyncload.RemoteFiles(urls),
        batch_size=32,
        num_workers=2,
        max_concurrency=128,
        collate_fn=list,
        persistent_workers=True,
    )
    rates = []
    for _ in range(2):
        first = 0.0
        seen = 0
        start = time.perf_counter()
        for k, batch in enumerate(loader):
            if k == 0:
                first = time.perf_counter()
            seen += len(batch)
        assert seen == len(urls), f"{seen} samples of {len(urls)}"
        end = time.perf_counter()
        rates.append(((len(urls) - 32) / (end - first), len(urls) / (end - start)))
    del loader
    return rates


def _litdata_child(base: str, n: int, cache: str) -> None:
    """litdata's cached raw dataset, two epochs: prints their steady samples/s and requests."""
    import torch

    urls = [f"s3://{BUCKET}/{SIZE}/{LATENCY * 1000:g}/{i + 2 * 10**6}" for i in range(n)]
    dataset = litdata_dataset(base, urls, SIZE, cache_dir=cache, cache_files=True)
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=32, num_workers=2, collate_fn=list, persistent_workers=True
    )
    rates = []
    for _ in range(2):
        first, seen = 0.0, 0
        for k, batch in enumerate(loader):
            if k == 0:
                first = time.perf_counter()
            seen += len(batch)
        assert seen == n, f"{seen} samples of {n}"
        rates.append((n - 32) / (time.perf_counter() - first))
    print("RESULT " + json.dumps(rates), flush=True)


def _litdata_epochs(base: str, n: int, cache: Path) -> list[float]:
    out = subprocess.run(
        [sys.executable, __file__, "--litdata-child", base, str(n), str(cache)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if out.returncode != 0:
        raise SystemExit(f"the litdata row failed:\n{out.stderr}")
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))
    rates: list[float] = json.loads(line.removeprefix("RESULT "))
    return rates


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    parser.add_argument("--samples", type=int, default=None)
    parser.add_argument("--dir", default=None, help="where the cache and files go (a temp dir)")
    parser.add_argument("--litdata-child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.litdata_child:
        base, count, cache = args.litdata_child
        _litdata_child(base, int(count), cache)
        return 0
    n = args.samples or (256 if args.quick else 4096)
    work = Path(tempfile.mkdtemp(prefix="asyncload-bench-cache-", dir=args.dir))
    rows: dict[str, float] = {}
    try:
        files = work / "files"
        files.mkdir()
        paths = []
        for i in range(n):
            path = files / f"{i}"
            path.write_bytes(object_bytes(i, SIZE))
            paths.append(str(path))
        with ObjectServerProcess() as server:
            prefix = server.prefix(SIZE, LATENCY)
            urls = [f"{prefix}/{i}" for i in range(n)]
            rows["no cache"] = _run(lambda: _read_loop(urls, check=True))
            _storage.configure(server.base_url, cache_dir=str(work / "cache"))
            rows["cache, epoch 1"] = _run(lambda: _read_loop(urls, check=True))
            # Epoch 2 and the local files take turns (median of 3 each): on a shared machine
            # the load changes from second to second, and the ratio should not see that.
            warm, local = [], []
            for _ in range(3):
                _age(work / "cache")
                before = _cache.counts()
                warm.append(_run(lambda: _read_loop(urls, check=False)))
                after = _cache.counts()
                assert after.hits - before.hits == n, "epoch 2 was not served from the cache"
                local.append(_local_loop(paths))
            rows["cache, epoch 2 (median of 3)"] = sorted(warm)[1]
            rows["local files, plain loop (median of 3)"] = sorted(local)[1]
            # The loader's workers get the same cache through configure(); a fresh directory.
            _storage.configure(server.base_url, cache_dir=str(work / "cache-loader"))
            urls = [f"{prefix}/{i + 10**6}" for i in range(n)]
            (l1, w1), (l2, w2) = _loader_epochs(urls)
            rows["DataLoader, epoch 1"], rows["DataLoader, epoch 2"] = l1, l2
            rows["DataLoader, epoch 1, whole epoch"] = w1
            rows["DataLoader, epoch 2, whole epoch"] = w2
            # What the loader moves without a store: the same loader over the local files
            # (asyncload's file backend, no cache), its second epoch.
            _, (rows["DataLoader over the local files, epoch 2"], _) = _loader_epochs(paths)
            if installed("litdata"):
                rates = _litdata_epochs(server.base_url, n, work / "cache-litdata")
                rows["litdata StreamingRawDataset, cache_files, epoch 1"] = rates[0]
                rows["litdata StreamingRawDataset, cache_files, epoch 2"] = rates[1]
            else:
                print("litdata rows skipped: not installed (the `benchmarks` extra)")
    finally:
        _storage.reset()
        shutil.rmtree(work, ignore_errors=True)
    print(f"\n{n} x {SIZE // 1000} KB at {LATENCY * 1000:g} ms, {IN_FLIGHT} in flight (loader:")
    print("2 workers, batch 32, max_concurrency=128, steady samples/s)\n")
    print("| row | samples/s |")
    print("|---|---|")
    for label, rate in rows.items():
        print(f"| {label} | {rate:,.0f} |")
    e1 = rows["cache, epoch 1"]
    e2 = rows["cache, epoch 2 (median of 3)"]
    local = rows["local files, plain loop (median of 3)"]
    l1, l2 = rows["DataLoader, epoch 1"], rows["DataLoader, epoch 2"]
    print("\nRatios (this run)\n")
    print("| ratio | value | target |")
    print("|---|---|---|")
    print(f"| read loop: epoch 2 / epoch 1 | {e2 / e1:.1f}x | >= 5x |")
    print(f"| read loop: epoch 2 / local files | {e2 / local:.2f} | >= 0.8 |")
    print(f"| read loop: epoch 1 with cache / no cache | {e1 / rows['no cache']:.2f} | ~1 |")
    print(f"| DataLoader: epoch 2 / epoch 1 | {l2 / l1:.1f}x | >= 5x |")
    w1, w2 = rows["DataLoader, epoch 1, whole epoch"], rows["DataLoader, epoch 2, whole epoch"]
    print(f"| DataLoader: epoch 2 / epoch 1, whole epochs | {w2 / w1:.1f}x | |")
    ceiling = rows["DataLoader over the local files, epoch 2"]
    print(f"| DataLoader epoch 2 / the same loader over the local files | {l2 / ceiling:.2f} | |")
    print(f"| DataLoader epoch 2 / local files | {l2 / local:.2f} | |")
    lit = "litdata StreamingRawDataset, cache_files, epoch {}"
    if lit.format(2) in rows:
        lit1, lit2 = rows[lit.format(1)], rows[lit.format(2)]
        print(f"| litdata: epoch 2 / epoch 1 | {lit2 / lit1:.1f}x | |")
        print(f"| asyncload DataLoader epoch 2 / litdata's epoch 2 | {l2 / lit2:.2f} | |")
    print(f"\n(cache and files under {work}, removed; pid {os.getpid()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
