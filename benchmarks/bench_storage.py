"""Client CPU per GET: asyncload.read (HTTP and S3) against a raw aiohttp loop.

One run, no arguments. Starts the loopback object server (aiohttp) in a separate process, so
only the client's CPU is counted (``time.process_time()`` covers every thread of this process,
obstore's Tokio threads included). The same server doubles as an S3-compatible endpoint for
``s3://`` (path-style ``/bucket/key``; obstore still signs every request with SigV4). A second
S3 row uses moto's S3 server, also in its own process, for a real S3 implementation. The
``gs://`` and ``az://`` rows read from the emulators the tests use (fake-gcs-server, Azurite;
separate processes too), each next to a raw obstore loop over the same objects on the same
emulator: the reference for what asyncload adds per GET.

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
from typing import Any

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


def _on_slow_server(case: str) -> bool:
    # moto's server is ~20x slower than the loopback server, the emulators a few times: fewer
    # GETs there, and no target (their rows compare with raw obstore on the same emulator).
    return any(name in case for name in ("moto", "fake-gcs-server", "Azurite"))


def _start_emulators() -> tuple[list[Any], dict[str, str], list[str]]:
    """Start fake-gcs-server and Azurite with OBJECTS objects each: (processes, urls, notes)."""
    procs: list[Any] = []
    urls: dict[str, str] = {}
    notes: list[str] = []
    objects = {f"obj/{i}": os.urandom(SIZE) for i in range(OBJECTS)}
    try:
        from tests._emulator import free_port, start
        from tests._gcs_server import GcsServer, binary

        port = free_port()
        url = f"http://127.0.0.1:{port}"
        argv = [str(binary()), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1"]
        argv += ["-port", str(port), "-public-host", f"127.0.0.1:{port}", "-log-level", "error"]
        procs.append(start("fake-gcs-server", argv, f"{url}/storage/v1/b"))
        GcsServer(endpoint=url, proxy=None).bucket(BUCKET, objects)  # type: ignore[arg-type]
        urls["gs"] = url
    except BaseException as exc:  # pytest.fail raises a BaseException
        notes.append(f"gs:// rows skipped: {exc}")
    try:
        import tempfile

        from tests._azurite import ACCOUNT, BINARY, AzuriteServer
        from tests._emulator import free_port, start

        port = free_port()
        url = f"http://127.0.0.1:{port}"
        argv = [str(BINARY), "--blobHost", "127.0.0.1", "--blobPort", str(port)]
        argv += ["--inMemoryPersistence", "--silent", "--skipApiVersionCheck", "--disableTelemetry"]
        workdir = tempfile.mkdtemp(prefix="asyncload-bench-azurite-")
        procs.append(start("Azurite", argv, f"{url}/{ACCOUNT}?comp=list", timeout=60, cwd=workdir))
        AzuriteServer(url=url, proxy=None).bucket(BUCKET, objects)  # type: ignore[arg-type]
        urls["az"] = url
    except BaseException as exc:
        notes.append(f"az:// rows skipped: {exc}")
    return procs, urls, notes


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


async def _bench(
    http_port: int, moto_port: int | None, emulators: dict[str, str]
) -> dict[str, list[float]]:
    import aiohttp

    import asyncload
    from asyncload._storage import api as _storage

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

    for scheme, url in emulators.items():
        cases.update(_emulator_cases(scheme, url))

    results: dict[str, list[float]] = {name: [] for name in cases}
    try:
        for _ in range(ROUNDS):
            for name, get in cases.items():
                n = GETS // 4 if _on_slow_server(name) else GETS
                results[name].append(await _drive(get, n))
    finally:
        await session.close()
        await _storage.aclose()
    return results


def _emulator_cases(scheme: str, url: str) -> dict[str, Callable[[int], Awaitable[bytes]]]:
    """A raw obstore loop and asyncload.read over the same objects on one emulator."""
    import obstore
    from obstore.store import from_url
    from tests._azurite import ACCOUNT, KEY

    import asyncload

    name = {"gs": "fake-gcs-server", "az": "Azurite"}[scheme]
    if scheme == "gs":
        options: dict[str, Any] = {"endpoint": url}
        config: dict[str, Any] = {"base_url": url, "skip_signature": True}
    else:
        creds = {"account_name": ACCOUNT, "account_key": KEY}
        options = {"endpoint": f"{url}/{ACCOUNT}", "credentials": creds}
        config = {**creds, "endpoint": f"{url}/{ACCOUNT}"}
    asyncload.configure(f"{scheme}://{BUCKET}", **options)
    build: Any = from_url
    store = build(
        f"{scheme}://{BUCKET}",
        config=config,
        client_options={"allow_http": True, "pool_max_idle_per_host": str(CONCURRENCY)},
        retry_config={"max_retries": 0},
    )

    async def raw(i: int) -> bytes:
        result = await obstore.get_async(store, f"obj/{i}")
        return bytes(await result.bytes_async())

    async def ours(i: int) -> bytes:
        return await asyncload.read(f"{scheme}://{BUCKET}/obj/{i}")

    return {f"raw obstore {scheme} ({name})": raw, f"asyncload {scheme} ({name})": ours}


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
        emulator_procs, emulators, notes = _start_emulators()
        try:
            t0 = time.monotonic()
            results = runner(_bench(http_port, moto_port, emulators))
            wall = time.monotonic() - t0
        finally:
            from tests._emulator import stop as stop_emulator

            for proc in emulator_procs:
                stop_emulator(proc)
    finally:
        stop.set()
        for p in servers:
            p.join(10)

    raw = statistics.median(results["raw aiohttp"])
    print(
        f"\nclient CPU per GET, {SIZE} B objects, {CONCURRENCY} in flight, {loop_name}, "
        f"median of {ROUNDS} rounds ({wall:.0f} s)\n"
    )
    print(f"{'client':<34}{'µs CPU/GET':>12}{'GETs/s/core':>14}{'vs raw':>9}")
    ok = True
    for name, values in results.items():
        per_get = statistics.median(values)
        ratio = per_get / raw
        print(f"{name:<34}{per_get * 1e6:>12.0f}{1 / per_get:>14,.0f}{ratio:>8.2f}x")
        if name.startswith("asyncload") and not _on_slow_server(name):
            ok = ok and ratio <= 1.3
    for scheme in emulators:
        raw_emu = next(v for k, v in results.items() if k.startswith(f"raw obstore {scheme}"))
        ours = next(v for k, v in results.items() if k.startswith(f"asyncload {scheme}"))
        print(
            f"  asyncload {scheme} vs raw obstore on the same emulator: "
            f"{statistics.median(ours) / statistics.median(raw_emu):.2f}x"
        )
    for note in notes:
        print(note)
    print(
        f"\ntarget: asyncload http and s3 within 1.30x of raw aiohttp: {'met' if ok else 'MISSED'}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
