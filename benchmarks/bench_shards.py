"""TarShards against the ``webdataset`` package on the same tar shards over loopback HTTP.

One run, one table. The shards are written once with ``asyncload.datasets.write_shards`` and
served by the loopback object store (``asyncload.cli.loopback``) in a *separate process* that
holds every response for 50 ms before the first byte, like an object store. Both loaders use
torch-style batching with the same ``num_workers`` and ``batch_size`` and the default collate;
webdataset fetches ``http://`` shards through ``curl`` as it does by default (or urllib when
curl is missing).

Three shapes of shard: many small ones (the per-shard round trip dominates; webdataset reads one
shard at a time per worker, TarShards streams several), a few large ones (parsing and
collating dominate), and the small ones again gzip-compressed as ``.tar.gz`` (inflating adds
CPU; the payloads are random bytes, like JPEGs, so they hardly shrink). Samples/s are
measured from the first batch to the last, so worker start-up is left out of both; the whole
run takes about a minute and a half.

    python benchmarks/bench_shards.py
"""

from __future__ import annotations

import argparse
import gzip
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

LATENCY = 0.050
WORKERS = 2
BATCH = 32
REPEATS = 3
# (label, shards, samples per shard, payload bytes per sample, shard suffix)
SHAPES = [
    ("64 shards × 100 × 10 KB", 64, 100, 10_000, ".tar"),
    ("48 shards × 1,000 × 10 KB", 48, 1000, 10_000, ".tar"),
    ("64 × 100 × 10 KB, .tar.gz", 64, 100, 10_000, ".tar.gz"),
]


# ── the loaders ───────────────────────────────────────────────────────────────────────────────


def timed(loader: Any, expected: int) -> float:
    """Samples/s from the first batch to the last; checks every sample arrived."""
    it = iter(loader)
    first = next(it)
    seen = len(first["__key__"])
    t0 = time.perf_counter()
    n = 0
    for batch in it:
        n += len(batch["__key__"])
    elapsed = time.perf_counter() - t0
    seen += n
    if seen != expected:
        raise RuntimeError(f"expected {expected} samples, got {seen}")
    return n / elapsed


def run_asyncload(urls: list[str], expected: int) -> float:
    import asyncload
    from asyncload.datasets import TarShards

    ds = TarShards(urls, shuffle_shards=False)
    return timed(asyncload.DataLoader(ds, batch_size=BATCH, num_workers=WORKERS), expected)


def _urllib_opener(url: str, mode: str = "rb", bufsize: int = 8192, **kw: Any) -> Any:
    import urllib.request

    return urllib.request.urlopen(url, timeout=60)


def run_webdataset(urls: list[str], expected: int) -> float:
    import torch.utils.data
    import webdataset as wds

    if shutil.which("curl") is None:  # webdataset's http:// goes through curl by default
        wds.gopen.gopen_schemes["http"] = _urllib_opener
    ds = wds.WebDataset(urls, shardshuffle=False, empty_check=False)
    loader = torch.utils.data.DataLoader(ds, batch_size=BATCH, num_workers=WORKERS)
    return timed(loader, expected)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.parse_args()

    from asyncload.cli.loopback import ServerProcess
    from asyncload.datasets import write_shards

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-shards-") as tmp:
        root = Path(tmp)
        for s, (_, n_shards, per_shard, size, suffix) in enumerate(SHAPES):
            payload = os.urandom(size)
            gz = suffix == ".tar.gz"
            paths = write_shards(
                (
                    # One payload repeated would compress to nothing: fresh bytes for gzip.
                    {"__key__": f"{i:07d}", "bin": os.urandom(size) if gz else payload}
                    | {"cls": i % 10}
                    for i in range(n_shards * per_shard)
                ),
                root / f"shape{s}",
                samples_per_shard=per_shard,
            )
            for path in paths if gz else ():
                with open(path, "rb") as src, gzip.open(path + ".gz", "wb", compresslevel=6) as dst:
                    shutil.copyfileobj(src, dst)
                os.unlink(path)
        # The loopback store in a child, every file in its memory, each response held LATENCY.
        with ServerProcess(["--folder", str(root), "--latency", str(LATENCY)], fast=True) as server:
            for s, (label, n_shards, per_shard, _, suffix) in enumerate(SHAPES):
                url = server.base_url
                urls = [f"{url}/shape{s}/shard-{i:06d}{suffix}" for i in range(n_shards)]
                total = n_shards * per_shard
                # A pass over the large shards lasts about a second: alternate the two loaders
                # and keep each one's median, so one noisy second decides nothing.
                ours_runs, theirs_runs = [], []
                for _ in range(REPEATS):
                    ours_runs.append(run_asyncload(urls, total))
                    theirs_runs.append(run_webdataset(urls, total))
                rows.append((label, statistics.median(ours_runs), statistics.median(theirs_runs)))

    print(
        f"\nTar shards over loopback HTTP, {LATENCY * 1000:.0f} ms to first byte, "
        f"{WORKERS} workers, batch {BATCH}, curl={'yes' if shutil.which('curl') else 'no'}, "
        f"median of {REPEATS} alternating runs each\n"
    )
    print(f"{'shards':<28}{'TarShards/s':>14}{'webdataset/s':>15}{'ratio':>8}")
    for label, ours, theirs in rows:
        print(f"{label:<28}{ours:>14,.0f}{theirs:>15,.0f}{ours / theirs:>7.1f}×")
    print("\ntarget: TarShards ≥ 2× webdataset samples/s")


if __name__ == "__main__":
    main()
