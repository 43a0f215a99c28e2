"""A real aiohttp object server on 127.0.0.1 for tests, with latency and faults injected.

It runs in a background thread with its own event loop so that both the test process and the
loader's worker processes reach it over loopback TCP.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import random
import ssl
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

from aiohttp import web

# Faults a test can queue per path; each request to that path takes the next one:
#   "503", "500", "502", "504", "429", "404", "403", "401": respond with that status
#   "retry-after:S": 503 with a Retry-After header of S seconds
#   "short": announce the full Content-Length, send half the body, close the connection
#   "reset": send headers and a little body, then abort the TCP connection
#   "stall:S": send headers, then sleep S seconds before the body (the handler ends when the
#              client closes the connection: handler_cancellation)
#   "trickle:S": send headers, then the body in 25 pieces spread over S seconds
#   "redirect:URL": 302 to URL (relative or absolute)
#   "short-replace": like "short", then the object becomes ``replacements[path]`` (a new ETag)
#   "s3-403": 403 with an S3 SignatureDoesNotMatch XML body that echoes fake credentials
FAULTS = ("500", "502", "503", "504", "429", "404", "403", "401", "short", "reset")


@dataclass
class ObjectServer:
    """State shared between the test and the server's handlers."""

    host: str = "127.0.0.1"
    port: int = 0
    scheme: str = "http"
    objects: dict[str, bytes] = field(default_factory=dict)
    latency: float = 0.0
    jitter: float = 0.0
    faults: dict[str, collections.deque[str]] = field(default_factory=dict)
    hits: collections.Counter[str] = field(default_factory=collections.Counter)
    active: int = 0
    peak_active: int = 0  # most requests in the handler at once since reset()
    finished: int = 0  # requests that have left the handler since reset() (rounds, not clocks)
    headers_seen: list[dict[str, str]] = field(default_factory=list)
    raw_paths: list[str] = field(default_factory=list)  # request targets exactly as received
    replacements: dict[str, bytes] = field(default_factory=dict)
    conditionals: bool = True  # honour If-Match (412) and If-Range (200 when it differs)

    # Per-path delays (seconds) taken one per request, after the global latency: a path with
    # delays queued gets its next request held that long (a straggler); empty: no extra delay.
    delays: dict[str, collections.deque[float]] = field(default_factory=dict)
    cancelled: int = 0  # requests whose client went away before the response was sent

    # A store that pushes back, per prefix (a path's directory), off by default.
    # throttle_rate: a token bucket of that many requests per second (bursts of throttle_burst);
    # a request without a token is answered at once with throttle_status: 503 and S3's
    # SlowDown body, or 429; with Retry-After when throttle_retry_after is set.
    throttle_rate: float | None = None
    throttle_burst: float = 1.0
    throttle_status: int = 503
    throttle_retry_after: float | None = None
    throttled: int = 0  # requests answered with a throttle since reset()
    # queue_slots: at most that many requests served at once per prefix, each for
    # queue_service seconds after the latency; the rest wait in line (latency grows with load).
    queue_slots: int | None = None
    queue_service: float = 0.0
    _buckets: dict[str, list[float]] = field(default_factory=dict)  # prefix: [tokens, when]
    _lines: dict[str, asyncio.Semaphore] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    def url_for(self, path: str) -> str:
        return f"{self.url}/{path.lstrip('/')}"

    def put(self, path: str, data: bytes) -> str:
        self.objects[path.lstrip("/")] = data
        return self.url_for(path)

    def fail(self, path: str, *faults: str) -> None:
        self.faults.setdefault(path.lstrip("/"), collections.deque()).extend(faults)

    def delay(self, path: str, *seconds: float) -> None:
        """Hold the next requests to *path* for these many seconds, one value per request."""
        self.delays.setdefault(path.lstrip("/"), collections.deque()).extend(seconds)

    def reset(self) -> None:
        self.delays.clear()
        self.cancelled = 0
        self.objects.clear()
        self.faults.clear()
        self.hits.clear()
        self.peak_active = 0
        self.finished = 0
        self.headers_seen.clear()
        self.raw_paths.clear()
        self.replacements.clear()
        self.conditionals = True
        self.latency = 0.0
        self.jitter = 0.0
        self.throttle_rate = None
        self.throttle_burst = 1.0
        self.throttle_status = 503
        self.throttle_retry_after = None
        self.throttled = 0
        self.queue_slots = None
        self.queue_service = 0.0
        self._buckets.clear()
        self._lines.clear()

    def take_token(self, prefix: str, now: float) -> bool:
        """Whether the token bucket of *prefix* lets a request through at *now*."""
        assert self.throttle_rate is not None
        tokens, last = self._buckets.get(prefix, [self.throttle_burst, now])
        tokens = min(self.throttle_burst, tokens + (now - last) * self.throttle_rate)
        ok = tokens >= 1.0
        self._buckets[prefix] = [tokens - 1.0 if ok else tokens, now]
        return ok


# What S3 answers a request whose signature does not match; the secrets are fake but distinct.
S3_SIGNATURE_ERROR = (
    '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SignatureDoesNotMatch</Code>'
    "<Message>The request signature we calculated does not match the signature you provided."
    "</Message><AWSAccessKeyId>AKIAFAKEACCESSKEY01</AWSAccessKeyId>"
    "<StringToSign>AWS4-HMAC-SHA256\n20260101T000000Z\nfake-string-to-sign-77</StringToSign>"
    "<SignatureProvided>fakesignatureprovided99</SignatureProvided>"
    "<RequestId>4442587FB7D0A2F9</RequestId></Error>"
)

# What S3 answers a request over its prefix's request rate.
S3_SLOWDOWN = (
    '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    "<Message>Please reduce your request rate.</Message>"
    "<RequestId>7A5FC1D2E3B4A596</RequestId><HostId>loopback</HostId></Error>"
)


def _throttle_response(state: ObjectServer) -> web.Response:
    state.throttled += 1
    headers = {}
    if state.throttle_retry_after is not None:
        headers["Retry-After"] = f"{state.throttle_retry_after:g}"
    if state.throttle_status == 503:
        return web.Response(
            status=503, text=S3_SLOWDOWN, content_type="application/xml", headers=headers
        )
    return web.Response(status=state.throttle_status, text="too many requests", headers=headers)


def _parse_range(header: str, size: int) -> tuple[int, int] | None:
    # "bytes=START-END" (END inclusive) or "bytes=START-" or "bytes=-SUFFIX".
    if not header.startswith("bytes="):
        return None
    spec = header[len("bytes=") :].split(",")[0].strip()
    start_s, _, end_s = spec.partition("-")
    if start_s == "":
        n = int(end_s)
        return max(0, size - n), size
    start = int(start_s)
    end = int(end_s) + 1 if end_s else size
    return start, min(end, size)


def _make_app(state: ObjectServer) -> web.Application:
    async def handle(request: web.Request) -> web.StreamResponse:
        path = request.match_info["path"]
        state.hits[path] += 1
        state.raw_paths.append(request.raw_path)
        state.headers_seen.append(dict(request.headers))
        prefix = path.rpartition("/")[0]
        if state.throttle_rate is not None:
            if not state.take_token(prefix, asyncio.get_running_loop().time()):
                return _throttle_response(state)  # at once, as S3 does
        if state.latency or state.jitter:
            await asyncio.sleep(state.latency + random.uniform(0, state.jitter))
        if state.queue_slots is not None:
            line = state._lines.get(prefix)
            if line is None:
                line = state._lines[prefix] = asyncio.Semaphore(state.queue_slots)
            async with line:  # FIFO: asyncio's semaphore wakes waiters in order
                await asyncio.sleep(state.queue_service)
        held = state.delays.get(path)
        if held:
            await asyncio.sleep(held.popleft())
        queue = state.faults.get(path)
        fault = queue.popleft() if queue else None
        if fault is not None:
            if fault.isdigit():
                return web.Response(status=int(fault), text=f"injected {fault}")
            if fault.startswith("redirect:"):
                raise web.HTTPFound(fault.split(":", 1)[1])
            if fault == "s3-403":
                return web.Response(
                    status=403, text=S3_SIGNATURE_ERROR, content_type="application/xml"
                )
            if fault.startswith("retry-after:"):
                return web.Response(
                    status=503, headers={"Retry-After": fault.split(":", 1)[1]}, text="slow down"
                )
        data = state.objects.get(path)
        if data is None:
            return web.Response(status=404, text="no such object")
        status, body = 200, data
        rng = request.headers.get("Range")
        etag = f'"{hash(data) & 0xFFFFFFFF:x}"'
        headers = {"Accept-Ranges": "bytes", "ETag": etag}
        if state.conditionals:
            if request.headers.get("If-Match", etag) != etag:
                return web.Response(status=412, text="precondition failed")
            if request.headers.get("If-Range", etag) != etag:
                rng = None  # a different version: the whole new one, as RFC 9110 says
        if rng:
            span = _parse_range(rng, len(data))
            if span is not None:
                start, end = span
                status, body = 206, data[start:end]
                headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
        if request.method == "HEAD":
            return web.Response(
                status=status, headers={**headers, "Content-Length": str(len(body))}
            )
        if fault in ("short", "reset", "short-replace") or (fault or "").startswith(
            ("stall:", "trickle:")
        ):
            resp = web.StreamResponse(status=status, headers=headers)
            resp.content_length = len(body)
            await resp.prepare(request)
            if fault.startswith("trickle:"):
                size = -(-len(body) // 25)
                for at in range(0, len(body), size):
                    await asyncio.sleep(float(fault.split(":", 1)[1]) / 25)
                    await resp.write(body[at : at + size])
                await resp.write_eof()
                return resp
            if fault.startswith("stall:"):
                await asyncio.sleep(float(fault.split(":", 1)[1]))
                await resp.write(body)
                await resp.write_eof()
                return resp
            await resp.write(body[: len(body) // 2])
            transport = request.transport
            if fault == "short-replace":
                state.objects[path] = state.replacements.pop(path)
            if transport is not None:
                if fault == "reset":
                    transport.abort()
                else:
                    transport.close()
            return resp
        return web.Response(status=status, body=body, headers=headers)

    async def counted(request: web.Request) -> web.StreamResponse:
        state.active += 1
        state.peak_active = max(state.peak_active, state.active)
        try:
            return await handle(request)
        except asyncio.CancelledError:
            state.cancelled += 1  # handler_cancellation: the client closed the connection
            raise
        finally:
            state.active -= 1
            state.finished += 1

    app = web.Application()
    app.router.add_route("GET", "/{path:.*}", counted)
    app.router.add_route("HEAD", "/{path:.*}", counted)
    return app


@dataclass
class _Running:
    state: ObjectServer
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread
    stop: asyncio.Event | None = None


def serve_in_thread(
    state: ObjectServer | None = None, ssl_context: ssl.SSLContext | None = None
) -> _Running:
    """Start the server on an ephemeral loopback port; returns once it accepts connections.

    With *ssl_context* it serves HTTPS (``state.scheme`` becomes ``"https"``).
    """
    state = state or ObjectServer()
    if ssl_context is not None:
        state.scheme = "https"
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    running = _Running(state, loop, threading.Thread())

    async def main() -> None:
        runner = web.AppRunner(_make_app(state), access_log=None, handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, state.host, state.port, backlog=1024, ssl_context=ssl_context)
        await site.start()
        server = site._server
        assert server is not None
        state.port = server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        running.stop = asyncio.Event()
        ready.set()
        await running.stop.wait()
        await runner.cleanup()

    running.thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    running.thread.start()
    if not ready.wait(10):
        raise RuntimeError("loopback HTTP server did not start")
    return running


def stop(running: _Running) -> None:
    assert running.stop is not None
    running.loop.call_soon_threadsafe(running.stop.set)
    running.thread.join(10)
    running.loop.close()
    if running.state.scheme == "https":
        # A TLS handshake the client refused (the private-CA tests) leaves its server-side
        # transport to the collector; collect it here rather than in whichever test runs next.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            gc.collect()


def http_server_context() -> Iterator[ObjectServer]:
    running = serve_in_thread()
    try:
        yield running.state
    finally:
        stop(running)
