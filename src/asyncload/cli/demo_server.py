"""The demo's embedded object store: a loopback aiohttp server with a synthetic image dataset.

``asyncload demo`` runs this file as a *script* in a child process (``python _demo_server.py``),
not through the package: the child then imports aiohttp and NumPy only, starts in a fraction of
a second, and its request handling never competes for the GIL with the training loop whose data
wait the demo measures. The child prints its port on one line and serves until its stdin closes,
so it also goes away when the parent dies.

The dataset is CIFAR-10's binary record layout, one record per object: one label byte, then
3×32×32 ``uint8`` pixels (all red, then green, then blue), 3,073 bytes. Record *i* depends only
on ``(seed, i)``; each class has its own mean colour, so a small model learns it in a few steps.
Objects are served as ``/<prefix>/<i:05d>.bin`` with ``/<prefix>/manifest.txt`` listing them,
since plain HTTP has no way to list a prefix.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
from aiohttp import web

RECORD_SIZE = 1 + 3 * 32 * 32
NUM_CLASSES = 10
PREFIX = "cifar"
MANIFEST = "manifest.txt"


def make_record(index: int, seed: int) -> bytes:
    """Record *index* of the synthetic dataset: a label byte and 3×32×32 pixels."""
    rng = np.random.default_rng([seed, index])
    label = int(rng.integers(NUM_CLASSES))
    # Distinct, fixed mean colours per class; noise makes it a (small) learning problem.
    mean = np.array([(label * 73) % 256, (label * 151 + 60) % 256, (label * 199 + 120) % 256])
    pixels = mean[:, None, None] + rng.normal(0.0, 48.0, size=(3, 32, 32))
    return bytes([label]) + np.clip(pixels, 0, 255).astype(np.uint8).tobytes()


def object_name(index: int) -> str:
    return f"{index:05d}.bin"


def make_objects(count: int, seed: int) -> dict[str, bytes]:
    """Every object the store serves, keyed by path (the manifest included)."""
    objects = {f"{PREFIX}/{object_name(i)}": make_record(i, seed) for i in range(count)}
    manifest = "".join(f"{object_name(i)}\n" for i in range(count)).encode()
    objects[f"{PREFIX}/{MANIFEST}"] = manifest
    return objects


def make_app(objects: Mapping[str, bytes], latency: float) -> web.Application:
    """GET and HEAD of *objects* by path, each after *latency* seconds."""

    async def handle(request: web.Request) -> web.StreamResponse:
        if latency > 0:
            await asyncio.sleep(latency)  # a storage round trip
        data = objects.get(request.match_info["path"])
        if data is None:
            return web.Response(status=404, text="no such object")
        if request.method == "HEAD":
            return web.Response(headers={"Content-Length": str(len(data))})
        return web.Response(body=data, content_type="application/octet-stream")

    app = web.Application()
    app.router.add_route("GET", "/{path:.*}", handle)
    app.router.add_route("HEAD", "/{path:.*}", handle)
    return app


async def serve(*, objects: dict[str, bytes], latency: float, port: int) -> None:
    """Serve until stdin reaches end of file; print the bound port first."""
    runner = web.AppRunner(make_app(objects, latency), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port, backlog=2048)
    await site.start()
    server: Any = site._server
    print(server.sockets[0].getsockname()[1], flush=True)

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def wait_for_eof() -> None:
        # A closed stdin means the parent is done with us (or died): either way, exit.
        sys.stdin.buffer.read()
        loop.call_soon_threadsafe(stop.set)

    threading.Thread(target=wait_for_eof, daemon=True).start()
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--objects", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--latency", type=float, default=0.05)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    run: Any = asyncio.run
    try:
        import uvloop

        run = uvloop.run
    except ImportError:  # pragma: no cover - Windows
        pass
    run(serve(objects=make_objects(args.objects, args.seed), latency=args.latency, port=args.port))


if __name__ == "__main__":
    main()
