"""Read over HTTP with retries: a tiny local web server that fails now and then.

Starts an aiohttp server on 127.0.0.1 (in a thread) whose every third answer is a 503, then
reads from it with ``asyncload.read``, a byte range and ``asyncload.stream``.

    python examples/read_http.py
"""

from __future__ import annotations

import asyncio
import itertools
import threading

from aiohttp import web

import asyncload

OBJECTS = {f"img/{i:03d}.bin": bytes([i]) * 2048 for i in range(16)}


def start_server() -> tuple[str, asyncio.AbstractEventLoop, asyncio.Event]:
    counter = itertools.count()

    async def handle(request: web.Request) -> web.Response:
        if next(counter) % 3 == 2:
            return web.Response(status=503, headers={"Retry-After": "0"})
        body = OBJECTS.get(request.match_info["path"])
        if body is None:
            return web.Response(status=404)
        rng = request.headers.get("Range")
        if rng:
            start, _, end = rng.removeprefix("bytes=").partition("-")
            return web.Response(status=206, body=body[int(start) : int(end) + 1])
        return web.Response(body=body)

    loop = asyncio.new_event_loop()
    ready = threading.Event()
    box: dict[str, object] = {}

    async def serve() -> None:
        app = web.Application()
        app.router.add_get("/{path:.*}", handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        box["port"] = runner.addresses[0][1]
        box["stop"] = stop = asyncio.Event()
        ready.set()
        await stop.wait()
        await runner.cleanup()

    threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True).start()
    ready.wait(10)
    return f"http://127.0.0.1:{box['port']}", loop, box["stop"]  # type: ignore[return-value]


async def main(base: str) -> None:
    asyncload.configure(base, retry=asyncload.Retry(attempts=5, backoff=0.05), read_timeout=5)
    urls = [f"{base}/{key}" for key in OBJECTS]
    blobs = await asyncio.gather(*(asyncload.read(u) for u in urls))
    assert blobs == list(OBJECTS.values())
    print(f"read {len(blobs)} objects concurrently; every third answer was a 503, retried")
    assert await asyncload.read(urls[5], start=10, end=20) == bytes([5]) * 10
    total = 0
    async for chunk in asyncload.stream(urls[7], chunk_size=512):
        total += len(chunk)
    print(f"streamed {total} bytes")
    try:
        await asyncload.read(f"{base}/no/such/object")
    except asyncload.NotFound as exc:
        print("missing object:", exc)
    # The aiohttp session of this loop is closed when asyncio.run() shuts the loop down.


if __name__ == "__main__":
    base, loop, stop = start_server()
    asyncio.run(main(base))
    loop.call_soon_threadsafe(stop.set)
