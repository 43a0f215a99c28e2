"""Throughput under long-tailed latency: asyncload with and without hedged reads vs a raw loop.

One run, one table. The loopback object server (``_server.py``, its own process) draws each
request's latency from a distribution: constant 50 ms, 1% of requests x10 or x40, and a
log-normal with p50 40 ms / p99 400 ms. Per distribution:

* ``asyncload.read`` in a raw asyncio loop, 256 in flight, hedging on (the default) and off,
  on the default pool of 64 connections per loop (a DataLoader sizes it to ``max_concurrency``),
  so these rows compare hedging on and off, and are capped near 64 / latency;
* a raw aiohttp loop, 256 in flight, the same distribution (the ceiling);
* ``asyncload.DataLoader`` (2 workers, batch 32, ``max_concurrency=128``), hedging on and off:
  steady samples/s (first batch to last) and whole run (``iter()`` included).

Hedges are counted by the server (requests minus samples), so the loader's workers need no
instrumentation. Every row runs three times, in rounds, and the table shows each row's median
run: ratios come from this one run of the script. Loader rows also give the first-batch time
(``iter()`` to the first batch, workers started from a warm forkserver).

``--concurrency 64,128,256`` adds a table of the loader at constant 50 ms per
``max_concurrency`` (the default's trade-off). ``--startup`` prints only first-batch times of a
loader built 2 s before ``iter()`` in a fresh interpreter, then of its next 8 epochs (new
workers each, started during the epoch before: standby workers) with what ``iter()`` itself
took, for the default start method and for ``multiprocessing_context="forkserver"``; and, as
the floor of this machine, when a new aiohttp client that asks for the same 256 objects at
once has its 32nd (median of 8, in the same process, against the same server).

    .venv/bin/python benchmarks/bench_tails.py            # about 4 minutes
    .venv/bin/python benchmarks/bench_tails.py --quick    # smoke run, two distributions, 1 round
    .venv/bin/python benchmarks/bench_tails.py --startup  # start-up only, about 20 seconds
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import aiohttp
from _server import ObjectServerProcess, object_bytes

import asyncload
from asyncload._storage import api as _storage

SIZE = 100_000
IN_FLIGHT = 256
DISTRIBUTIONS = [
    ("constant 50 ms", "50"),
    ("1% x10 (500 ms)", "50x10p1"),
    ("1% x40 (2 s)", "50x40p1"),
    ("log-normal p50 40 / p99 400 ms", "ln40-400"),
]


@dataclass
class Row:
    label: str
    rate: float  # samples/s
    whole: float | None = None  # samples/s including start-up (loader rows)
    hedges: int | None = None
    first: float | None = None  # seconds from iter() to the first batch (loader rows)


def _run(coro: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop missing
        return asyncio.run(coro())
    return uvloop.run(coro())


async def _read_loop(prefix: str, n: int, warm: int) -> float:
    async def fetcher(indices: Iterator[int]) -> None:
        for i in indices:
            data = await asyncload.read(f"{prefix}/{i}")
            if len(data) != SIZE:
                raise AssertionError(f"object {i}: {len(data)} bytes")

    try:
        # Warm-up on other objects in the same loop: connections opened, latencies learned.
        warm_up = iter(range(10**6, 10**6 + warm))
        await asyncio.gather(*(fetcher(warm_up) for _ in range(IN_FLIGHT)))
        indices = iter(range(n))
        t0 = time.perf_counter()
        await asyncio.gather(*(fetcher(indices) for _ in range(IN_FLIGHT)))
        return n / (time.perf_counter() - t0)
    finally:
        await asyncload.aclose()


async def _raw_loop(prefix: str, n: int, warm: int) -> float:
    connector = aiohttp.TCPConnector(limit=IN_FLIGHT)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def fetcher(indices: Iterator[int]) -> None:
            for i in indices:
                async with session.get(f"{prefix}/{i}") as resp:
                    resp.raise_for_status()
                    await resp.read()

        warm_up = iter(range(10**6, 10**6 + warm))
        await asyncio.gather(*(fetcher(warm_up) for _ in range(IN_FLIGHT)))
        indices = iter(range(n))
        t0 = time.perf_counter()
        await asyncio.gather(*(fetcher(indices) for _ in range(IN_FLIGHT)))
        return n / (time.perf_counter() - t0)


def _loader(
    prefix: str, n: int, check: bool, max_concurrency: int = 128
) -> tuple[float, float, float]:
    """(steady, whole-run) samples/s and first-batch seconds of one epoch of a fresh loader."""
    urls = [f"{prefix}/{i}" for i in range(n)]
    t0 = time.perf_counter()
    loader = asyncload.DataLoader(
        asyncload.RemoteFiles(urls),
        batch_size=32,
        num_workers=2,
        max_concurrency=max_concurrency,
        collate_fn=list,
    )
    first = 0.0
    seen = 0
    for k, batch in enumerate(loader):
        if k == 0:
            first = time.perf_counter()
        if check and k == 0:
            assert batch[0] == object_bytes(0, SIZE), "wrong bytes delivered"
        seen += len(batch)
    end = time.perf_counter()
    assert seen == n, f"{seen} samples of {n}"
    del loader
    return (n - 32) / (end - first), n / (end - t0), first - t0


def measure(server: ObjectServerProcess, spec: str, n: int, loader: bool) -> dict[str, Row]:
    prefix = server.prefix_spec(SIZE, spec)
    rows: dict[str, Row] = {}
    for hedged in (True, False):
        _storage.configure(server.base_url, hedge=asyncload.Hedge() if hedged else None)
        before = server.requests()
        rate = _run(lambda: _read_loop(prefix, n, IN_FLIGHT))
        name = "read, hedged" if hedged else "read, no hedge"
        rows[name] = Row(f"asyncload.read loop, {name.split(', ')[1]}", rate)
        rows[name].hedges = server.requests() - before - n - IN_FLIGHT
    rows["raw"] = Row("raw aiohttp loop", _run(lambda: _raw_loop(prefix, n, IN_FLIGHT)))
    if loader:
        for hedged in (True, False):
            _storage.configure(server.base_url, hedge=asyncload.Hedge() if hedged else None)
            before = server.requests()
            steady, whole, first = _loader(prefix, n, check=hedged)
            name = "loader, hedged" if hedged else "loader, no hedge"
            rows[name] = Row(f"DataLoader, {name.split(', ')[1]}", steady, whole, first=first)
            rows[name].hedges = server.requests() - before - n
    _storage.reset()
    return rows


def _medians(runs: list[dict[str, Row]]) -> dict[str, Row]:
    """Per row, the round with the median rate (its other figures with it)."""
    return {
        name: sorted((r[name] for r in runs), key=lambda row: row.rate)[len(runs) // 2]
        for name in runs[0]
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    parser.add_argument("--samples", type=int, default=None)
    parser.add_argument("--no-loader", action="store_true", help="skip the DataLoader rows")
    parser.add_argument(
        "--concurrency", default="", help="e.g. 64,128,256: loader per max_concurrency at 50 ms"
    )
    parser.add_argument(
        "--startup", action="store_true", help="only first-batch times, in fresh interpreters"
    )
    parser.add_argument(
        "--repeat", type=int, default=None, help="rounds of every row (default 3, --quick 1)"
    )
    args = parser.parse_args(argv)
    if args.startup:
        _print_startup()
        return 0
    n = args.samples or (256 if args.quick else 4096)
    # The smoke run keeps two distributions: the 2 s stragglers alone would take most of it.
    distributions = DISTRIBUTIONS[:2] if args.quick else DISTRIBUTIONS
    swept: list[tuple[int, tuple[float, float, float]]] = []
    with ObjectServerProcess() as server:
        # One unmeasured epoch first: the forkserver's one-time start-up is not any row's.
        _loader(server.prefix_spec(SIZE, "1"), 64, check=False)
        # Rounds of every distribution in turn, each row's median kept: one run of 4,096
        # requests with a log-normal tail varies by 1.5x with its few slowest draws (and the
        # machine's load drifts), the raw loop's as much as the loader's.
        rounds: dict[str, list[dict[str, Row]]] = {label: [] for label, _ in distributions}
        for _ in range(args.repeat or (1 if args.quick else 3)):
            for label, spec in distributions:
                rounds[label].append(measure(server, spec, n, loader=not args.no_loader))
        results: dict[str, dict[str, Row]] = {label: _medians(got) for label, got in rounds.items()}
        sweep = [int(c) for c in args.concurrency.split(",") if c]
        swept = [(c, _loader(server.prefix_spec(SIZE, "50"), n, False, c)) for c in sweep]
    if swept:
        print(
            f"\nmax_concurrency at constant 50 ms ({n} x {SIZE // 1000} KB, 2 workers, batch 32)\n"
        )
        print("| max_concurrency | steady samples/s | whole run/s | first batch s |")
        print("|---|---|---|---|")
        for c, (steady, whole, first) in swept:
            print(f"| {c} | {steady:,.0f} | {whole:,.0f} | {first:.3f} |")
    print(f"\n{n} x {SIZE // 1000} KB per row, {IN_FLIGHT} in flight (loader: 2 workers, batch 32,")
    print("max_concurrency=128); samples/s; hedges = extra requests seen by the server\n")
    print(f"| latency | row | samples/s | whole run/s | first batch s | hedges (% of {n}) |")
    print("|---|---|---|---|---|---|")
    for label, rows in results.items():
        for row in rows.values():
            whole = f"{row.whole:,.0f}" if row.whole is not None else ""
            first = f"{row.first:.3f}" if row.first is not None else ""
            hedges = "" if row.hedges is None else f"{row.hedges} ({100 * row.hedges / n:.1f}%)"
            print(f"| {label} | {row.label} | {row.rate:,.0f} | {whole} | {first} | {hedges} |")
    print("\nRatios (this run)\n")
    print(
        "| latency | read hedged / raw | read no-hedge / raw | loader hedged / no-hedge "
        "| loader hedged / loader at constant | loader hedged / raw |"
    )
    print("|---|---|---|---|---|---|")
    base = results[DISTRIBUTIONS[0][0]].get("loader, hedged")
    for label, rows in results.items():
        raw = rows["raw"].rate
        cells = [
            f"{rows['read, hedged'].rate / raw:.2f}",
            f"{rows['read, no hedge'].rate / raw:.2f}",
        ]
        if "loader, hedged" in rows and base is not None:
            lh, ln = rows["loader, hedged"].rate, rows["loader, no hedge"].rate
            cells += [f"{lh / ln:.2f}", f"{lh / base.rate:.2f}", f"{lh / raw:.2f}"]
        else:
            cells += ["", "", ""]
        print(f"| {label} | " + " | ".join(cells) + " |")
    budget_ok = all(
        row.hedges is None or row.hedges <= 0.05 * (n + IN_FLIGHT) + 10
        for runs in rounds.values()
        for rows in runs
        for row in rows.values()
    )
    verdict = "yes" if budget_ok else "NO"
    print(f"\nHedges within the 5% budget in every row of every round: {verdict}")
    return 0


_STARTUP = """
import asyncio, sys, time
sys.path.insert(0, {bench!r})
from _server import ObjectServerProcess
import aiohttp
import asyncload

LATER = 8  # later epochs timed, and raw clients: one epoch's first batch is a noisy figure


async def raw_first_batch(urls):
    # A new client, every object requested at once: when its 32nd object is in.
    t0, done = time.perf_counter(), []
    connector = aiohttp.TCPConnector(limit=len(urls))
    async with aiohttp.ClientSession(connector=connector) as session:
        async def one(url):
            async with session.get(url) as resp:
                await resp.read()
            done.append(time.perf_counter() - t0)
        await asyncio.gather(*(one(u) for u in urls))
    return sorted(done)[31]


def main(ctx):
    with ObjectServerProcess() as server:
        urls = [server.url_for(index=i, size=100_000, latency=0.05) for i in range(256)]
        loader = asyncload.DataLoader(
            asyncload.RemoteFiles(urls), batch_size=32, num_workers=2, collate_fn=list,
            multiprocessing_context=ctx,
        )
        time.sleep(2.0)  # the user builds the model
        firsts, iters = [], []
        for epoch in range(1 + LATER):
            t0 = time.perf_counter()
            it = iter(loader)
            iters.append(time.perf_counter() - t0)
            next(it)
            firsts.append(time.perf_counter() - t0)
            for _ in it:
                pass
        later, later_iters = sorted(firsts[1:]), sorted(iters[1:])
        raw = sorted(asyncio.run(raw_first_batch(urls)) for _ in range(LATER))
        medians = [sum(x[LATER // 2 - 1 : LATER // 2 + 1]) / 2 for x in (later, later_iters, raw)]
        print("RESULT", firsts[0], *medians)


if __name__ == "__main__":  # the forkserver imports this module
    main(sys.argv[1] or None)
"""


def _print_startup() -> None:
    """First batch of a loader built 2 s before iter(), in a fresh interpreter, and of its
    later epochs (new workers each epoch), per way of naming the start method."""
    code = _STARTUP.format(bench=str(Path(__file__).resolve().parent))
    print("\nStart-up: loader built 2 s before iter(), 2 workers, 50 ms objects; seconds")
    print("(later epochs: median of epochs 2-9)\n")
    print(
        "| multiprocessing_context | first batch, first epoch | first batch, later epochs "
        "| iter(), later epochs | raw aiohttp: 32nd of 256 objects, new client |"
    )
    print("|---|---|---|---|---|")
    # A script file, not ``-c``: without a file __main__ would make the loader fall back to fork.
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "startup.py"
        script.write_text(code)
        for ctx in ("", "forkserver"):
            _startup_row(script, ctx)


def _startup_row(script: Path, ctx: str) -> None:
    out = subprocess.run(
        [sys.executable, str(script), ctx],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ),
        check=False,
    )
    if out.returncode != 0:
        raise SystemExit(f"start-up run failed:\n{out.stderr}")
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT"))
    first, later, iter_s, raw = (float(x) for x in line.split()[1:])
    print(f"| {json.dumps(ctx or None)} | {first:.3f} | {later:.3f} | {iter_s:.3f} | {raw:.3f} |")


if __name__ == "__main__":
    sys.exit(main())
