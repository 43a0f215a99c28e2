"""Client CPU per GET: asyncload.read (HTTP and S3) against a raw aiohttp loop.

One run, no arguments. Starts the loopback object server (aiohttp) in a separate process, so
only the client's CPU is counted (``time.process_time()`` covers every thread of this process,
obstore's Tokio threads included). The same server doubles as an S3-compatible endpoint for
``s3://`` (path-style ``/bucket/key``; obstore still signs every request with SigV4). A second
S3 row uses moto's S3 server, also in its own process, for a real S3 implementation.

    .venv/bin/python benchmarks/bench_storage.py

Target: asyncload within 1.3x of raw aiohttp per GET.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

OBJECTS = 256
SIZE = 1024
CONCURRENCY = 32
GETS = 3000
ROUNDS = 5
BUCKET = "bench"


def _serve(port_queue: mp.Queue[int], stop: mp.Event) -> None:  # type: ignore[type-arg]
    from tests._http_server import ObjectServer, serve_in_thread

    state = ObjectServer()
    running = serve_in_thread(state)
    for i in range(OBJECTS):
        body = os.urandom(SIZE)
        state.put(f"obj/{i}", body)
        state.put(f"{BUCKET}/obj/{i}", body)
    port_queue.put(state.port)
    stop.wait()
    from tests._http_server import stop as stop_server

    stop_server(running)


def _serve_moto(port_queue: mp.Queue[int], stop: mp.Event) -> None:  # type: ignore[type-arg]
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    port_queue.put(server.get_host_and_port()[1])
    stop.wait()
    server.stop()


async def _drive(get: Callable[[int], Awaitable[bytes]], n: int) -> float:
    """CPU seconds per GET over *n* GETs, CONCURRENCY at a time."""
    sem = asyncio.Semaphore(CONCURRENCY)

    async def one(i: int) -> None:
        async with sem:
            data = await get(i % OBJECTS)
            assert len(data) == SIZE

    await asyncio.gather(*(one(i) for i in range(CONCURRENCY * 2)))  # warm connections
    cpu0 = time.process_time()
    await asyncio.gather(*(one(i) for i in range(n)))
    return (time.process_time() - cpu0) / n


async def _bench(http_port: int, moto_port: int | None) -> dict[str, list[float]]:
    import aiohttp

    import asyncload
    from asyncload import _storage

    base = f"http://127.0.0.1:{http_port}"
    _storage.set_pool_size(CONCURRENCY)
    creds = {"access_key_id": "bench", "secret_access_key": "bench"}
    _storage.configure(f"s3://{BUCKET}", endpoint=base, region="us-east-1", credentials=creds)

    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=CONCURRENCY))

    async def raw(i: int) -> bytes:
        async with session.get(f"{base}/obj/{i}") as resp:
            return await resp.read()

    async def http(i: int) -> bytes:
        return await asyncload.read(f"{base}/obj/{i}")

    async def s3(i: int) -> bytes:
        return await asyncload.read(f"s3://{BUCKET}/obj/{i}")

    import obstore
    from obstore.store import S3Store

    raw_store = S3Store(
        BUCKET,
        endpoint=base,
        region="us-east-1",
        client_options={"allow_http": True},
        retry_config={"max_retries": 0},
        access_key_id="bench",
        secret_access_key="bench",
    )

    async def raw_obstore(i: int) -> bytes:
        result = await obstore.get_async(raw_store, f"obj/{i}")
        return bytes(await result.bytes_async())

    cases: dict[str, Callable[[int], Awaitable[bytes]]] = {
        "raw aiohttp": raw,
        "asyncload http": http,
        "raw obstore (same GETs)": raw_obstore,
        "asyncload s3 (obstore)": s3,
    }
    if moto_port is not None:
        moto = f"http://127.0.0.1:{moto_port}"
        _storage.configure("s3://bench-moto", endpoint=moto, region="us-east-1", credentials=creds)

        store = S3Store(
            "bench-moto",
            endpoint=moto,
            region="us-east-1",
            client_options={"allow_http": True},
            access_key_id="bench",
            secret_access_key="bench",
        )
        async with aiohttp.ClientSession() as s:
            async with s.put(f"{moto}/bench-moto") as r:
                assert r.status == 200, await r.text()
        await asyncio.gather(
            *(obstore.put_async(store, f"obj/{i}", os.urandom(SIZE)) for i in range(OBJECTS))
        )

        async def s3_moto(i: int) -> bytes:
            return await asyncload.read(f"s3://bench-moto/obj/{i}")

        cases["asyncload s3 (moto server)"] = s3_moto

    results: dict[str, list[float]] = {name: [] for name in cases}
    try:
        for _ in range(ROUNDS):
            for name, get in cases.items():
                n = GETS if "moto" not in name else GETS // 4  # moto's server is ~20x slower
                results[name].append(await _drive(get, n))
    finally:
        await session.close()
        await _storage.aclose()
    return results


def main() -> int:
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    ports: mp.Queue[int] = ctx.Queue()
    servers = [ctx.Process(target=_serve, args=(ports, stop), daemon=True)]
    have_moto = True
    try:
        import moto.server  # noqa: F401
    except ImportError:
        have_moto = False
    if have_moto:
        servers.append(ctx.Process(target=_serve_moto, args=(ports, stop), daemon=True))
    servers[0].start()
    http_port = ports.get(timeout=60)
    moto_port = None
    if have_moto:
        servers[1].start()
        moto_port = ports.get(timeout=60)
    try:
        try:
            import uvloop

            runner = uvloop.run
            loop_name = "uvloop"
        except ImportError:
            runner = asyncio.run
            loop_name = "asyncio"
        t0 = time.monotonic()
        results = runner(_bench(http_port, moto_port))
        wall = time.monotonic() - t0
    finally:
        stop.set()
        for p in servers:
            p.join(10)

    raw = statistics.median(results["raw aiohttp"])
    print(
        f"\nclient CPU per GET, {SIZE} B objects, {CONCURRENCY} in flight, {loop_name}, "
        f"median of {ROUNDS} rounds ({wall:.0f} s)\n"
    )
    print(f"{'client':<30}{'µs CPU/GET':>12}{'GETs/s/core':>14}{'vs raw':>9}")
    ok = True
    for name, values in results.items():
        per_get = statistics.median(values)
        ratio = per_get / raw
        print(f"{name:<30}{per_get * 1e6:>12.0f}{1 / per_get:>14,.0f}{ratio:>8.2f}x")
        if name.startswith("asyncload") and "moto" not in name:
            ok = ok and ratio <= 1.3
    print(
        f"\ntarget: asyncload http and s3 within 1.30x of raw aiohttp: {'met' if ok else 'MISSED'}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
