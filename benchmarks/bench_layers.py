"""Where a request's CPU goes: the same GETs through each layer of asyncload's read path.

Issue 32 asks for a loader that costs less CPU per sample than torch's. A worker's own cost per
100 KB sample (0.5-0.7 ms on the 2-core machine) is about twice a raw client's; this shows which
layer adds what. Each row reads the same objects (100 KB at 50 ms from the loopback object
server, ``_server.py``, its own process) with 128 requests in flight, in a fresh interpreter, and
prints the CPU of that process per request (``time.process_time``: its threads, obstore's too):

* ``aiohttp``: an ``aiohttp.ClientSession`` with aiohttp's own connector and the backend's
  settings (no total timeout, no decompression), as ``bench_wholerun``'s raw loop but at 128
  in flight;
* ``asyncload's session``: the session the HTTP backend builds (its paced connector);
* ``HttpBackend.read``: the backend's read (each request's headers, connect and read timeouts,
  URL encoding, redirects, status and length checks), no retry or hedge;
* ``asyncload.read, no hedging``: the public read with ``hedge=None`` (options, cache lookup,
  retries, stats);
* ``asyncload.read``: the same with hedged reads (the default: a timer per request, and the
  signs of life that the backend reports to it);
* ``DataLoader, num_workers=0``: a whole loader (``RemoteFiles``, batch 32, ``max_concurrency``
  128) whose engine runs in this process (sampler, slots, batches), its start included: at
  8,192 objects that start is over half of what this row adds over ``asyncload.read`` (runs
  of 2,048 and 16,384 objects: 563-677 and 531-557 µs per request, against 473 for
  ``asyncload.read``);
* over S3, when obstore is installed: ``obstore.get_range_async`` as the backend calls it
  (the whole object as one range, copied to ``bytes``), and ``asyncload.read`` of ``s3://``
  URLs.

Rows run in rounds, each row once per round (the machine's load drifts), and the median is
shown with the range. On a machine whose cores are shared, one row's CPU per request moves by
10-20% from round to round: compare rows of the same run, and differences of 50 µs or more.

    python benchmarks/bench_layers.py            # about three minutes
    python benchmarks/bench_layers.py --quick    # smoke run, 512 objects, 1 round
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _children import result, spawn
from _peers import BUCKET, CREDS, installed
from _server import ObjectServerProcess
from bench_wholerun import LATENCY_MS, SIZE, _s3_store, _urls  # the same objects and store

IN_FLIGHT = 128

ROWS = {
    "aiohttp": ("http", "aiohttp"),
    "session": ("http", "asyncload's session"),
    "backend": ("http", "HttpBackend.read"),
    "nohedge": ("http", "asyncload.read, no hedging"),
    "read": ("http", "asyncload.read"),
    "loader": ("http", "DataLoader, num_workers=0"),
    "obstore": ("s3", "obstore.get_range_async"),
    "read-s3": ("s3", "asyncload.read"),
}


async def _drive(get: Callable[[str], Awaitable[Any]], urls: list[str]) -> None:
    todo = iter(urls)

    async def task() -> None:
        for url in todo:
            if len(await get(url)) != SIZE:
                raise AssertionError(f"{url}: wrong size")

    await asyncio.gather(*(task() for _ in range(IN_FLIGHT)))


async def _row(row: str, base: str, urls: list[str]) -> None:
    import aiohttp

    if row in ("aiohttp", "session"):
        if row == "aiohttp":
            session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=IN_FLIGHT),
                auto_decompress=False,
                timeout=aiohttp.ClientTimeout(total=None),
            )
        else:
            from asyncload._storage.backends.http import _new_client_session

            session = _new_client_session(IN_FLIGHT)

        async def get(url: str) -> bytes:
            async with session.get(url) as resp:
                resp.raise_for_status()
                return await resp.read()

        try:
            await _drive(get, urls)
        finally:
            await session.close()
        return
    if row == "obstore":
        import obstore

        store = _s3_store(base)
        prefix = len(f"s3://{BUCKET}/")

        async def get_s3(url: str) -> bytes:
            return bytes(await obstore.get_range_async(store, url[prefix:], start=0, end=2**62))

        await _drive(get_s3, urls)
        return
    import asyncload
    from asyncload._storage.state import set_pool_size

    set_pool_size(IN_FLIGHT)  # a worker's pool is sized for its in-flight limit
    if row == "read-s3":
        asyncload.configure(f"s3://{BUCKET}", endpoint=base, region="us-east-1", credentials=CREDS)
    if row == "nohedge":
        asyncload.configure(base, hedge=None)
    if row == "backend":
        from asyncload._storage.api import _backend
        from asyncload._storage.config import options_for

        backend, options = _backend(urls[0]), options_for(urls[0])

        async def get_backend(url: str) -> bytes:
            return await backend.read(url, None, None, options)

        await _drive(get_backend, urls)
        return
    await _drive(asyncload.read, urls)


def _loader_row(urls: list[str]) -> None:
    import asyncload

    loader = asyncload.DataLoader(
        asyncload.RemoteFiles(urls),
        batch_size=32,
        num_workers=0,
        collate_fn=list,
        max_concurrency=IN_FLIGHT,
    )
    seen = sum(len(batch) for batch in loader)
    if seen != len(urls):
        raise AssertionError(f"{seen} samples of {len(urls)}")


def _child(row: str, base: str, n: int) -> None:
    # The modules a row needs are imported before its clock starts (asyncload brings torch);
    # what a loader imports when it starts is part of its start.
    import aiohttp  # noqa: F401

    import asyncload  # noqa: F401

    transport, _ = ROWS[row]
    if transport == "s3":
        import obstore  # noqa: F401
    urls = _urls(transport, base, n)
    c0, t0 = time.process_time(), time.perf_counter()
    if row == "loader":
        _loader_row(urls)
    else:
        uvloop.run(_row(row, base, urls))
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    result(cpu_us=cpu / n * 1e6, rate=n / wall)


def _spawn(row: str, base: str, n: int) -> dict[str, float]:
    return spawn(__file__, row, base, str(n), what=row)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 512 objects, 1 round")
    parser.add_argument("--samples", type=int, help="objects per row (default 8,192)")
    parser.add_argument("--repeat", type=int, help="rounds of every row (default 3, --quick 1)")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        row, base, n = args.child
        _child(row, base, int(n))
        return 0
    n = args.samples or (512 if args.quick else 8192)
    rounds = args.repeat or (1 if args.quick else 3)
    rows = [r for r, (transport, _) in ROWS.items() if transport == "http"]
    if installed("obstore"):
        rows += [r for r, (transport, _) in ROWS.items() if transport == "s3"]
    else:
        print("s3:// rows skipped: obstore is not installed (the `s3` extra)")
    got: dict[str, list[dict[str, float]]] = {row: [] for row in rows}
    with ObjectServerProcess() as server:
        _spawn("aiohttp", server.base_url, min(n, 512))  # the server's first requests: a warm-up
        for k in range(rounds):
            for row in rows if k % 2 == 0 else rows[::-1]:
                got[row].append(_spawn(row, server.base_url, n))
    print(
        f"\n{n:,} GETs of {SIZE // 1000} KB at {LATENCY_MS} ms, {IN_FLIGHT} in flight, a fresh "
        f"interpreter per row, median of {rounds} round(s)\n"
    )
    print("| transport | layer | CPU µs per request | range | over the first row | requests/s |")
    print("|---|---|---|---|---|---|")
    first: dict[str, float] = {}
    for row in rows:
        transport, label = ROWS[row]
        cpus = [r["cpu_us"] for r in got[row]]
        cpu = statistics.median(cpus)
        floor = first.setdefault(transport, cpu)
        print(
            f"| {transport} | {label} | {cpu:.0f} | {min(cpus):.0f}-{max(cpus):.0f} "
            f"| {cpu - floor:+.0f} | {statistics.median(r['rate'] for r in got[row]):,.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
