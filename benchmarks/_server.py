"""A loopback object server in its own process, for benchmarks.

The server runs in a child process (``python benchmarks/_server.py``) so that its CPU time is
not mixed into the client's: a benchmark measures the loader, and on a 2-core machine the
server competing for the client's interpreter would skew every ratio.

Objects are generated, not stored: ``GET /obj/{size}/{latency_ms}/{i}`` answers ``size`` bytes
that depend only on ``i`` after sleeping ``latency_ms`` milliseconds (or a latency drawn from a
distribution, see ``_latency_ms``). Encoding size and latency in the path keeps the server
stateless, so one server serves every scenario of a run and other benchmark scripts can reuse
it. ``GET /count`` answers how many object requests were served (hedges show up there).
``Range`` and ``HEAD`` are honoured (storage benchmarks need them).

Two stores that push back, off unless asked for (``ObjectServerProcess(throttle=..., queue=...)``
or ``--throttle``/``--queue``), each per prefix (``/obj/{size}/{latency_ms}``):

* ``throttle=(rate, burst)``: a token bucket of *rate* requests per second with bursts of
  *burst*; a request without a token is answered at once with ``503`` and S3's ``SlowDown``
  XML body, or with ``429`` and ``Retry-After`` (``throttle_status=429, retry_after=1``).
  ``GET /throttled`` answers how many were.
* ``queue=(slots, service_ms)``: after the path's latency, at most *slots* requests are served
  at once, each for *service_ms* more; the others wait in line, so latency grows with the
  number of requests being served once they exceed *slots* (a store with a queue in front).

Usage from a benchmark::

    with ObjectServerProcess() as server:
        url = server.url_for(index=7, size=100_000, latency=0.05)
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import math
import os
import random
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TypeVar

__all__ = ["ObjectServerProcess", "object_bytes"]

# Every object is a window into one fixed pseudo-random pool, so generating a response costs a
# slice, not a random-number draw, and bodies differ from index to index (no accidental caching).
_POOL_SIZE = 1 << 22
_STRIDE = 4099  # prime: consecutive indices start at unrelated offsets


def _pool() -> bytes:
    # A seeded generator rather than os.urandom: the same bytes in every process, so a client
    # can check what it received without asking the server.
    return random.Random(20240601).randbytes(_POOL_SIZE + (1 << 20))


_POOL: bytes | None = None


def object_bytes(index: int, size: int) -> bytes:
    """The body the server sends for object *index* of *size* bytes (for checking reads)."""
    return bytes(object_view(index, size))


def object_view(index: int, size: int) -> memoryview:
    """:func:`object_bytes` without the copy."""
    global _POOL
    if _POOL is None:
        _POOL = _pool()
    start = (index * _STRIDE) % _POOL_SIZE
    if size <= len(_POOL) - start:
        return memoryview(_POOL)[start : start + size]
    # Larger than the pool's tail: repeat it (objects that big are only used for throughput).
    reps = size // len(_POOL) + 2
    return memoryview(_POOL * reps)[start : start + size]


# ── the server process ────────────────────────────────────────────────────────────────────────


def _parse_range(header: str, size: int) -> tuple[int, int] | None:
    if not header.startswith("bytes="):
        return None
    first, _, last = header[6:].split(",")[0].strip().partition("-")
    if first == "":
        return max(0, size - int(last)), size
    start = int(first)
    end = int(last) + 1 if last else size
    return (start, min(end, size)) if start < size else None


# What S3 answers a request over its prefix's rate (the client retries it after a backoff).
SLOWDOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message>"
    b"<RequestId>7A5FC1D2E3B4A596</RequestId><HostId>loopback</HostId></Error>"
)


class _Bucket:
    """A token bucket: *rate* tokens per second, at most *burst* saved up."""

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate, self.burst, self.tokens, self.last = rate, burst, burst, now

    def take(self, now: float) -> bool:
        self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


class _Line:
    """At most *slots* requests served at once for *service* seconds each; the rest wait."""

    def __init__(self, slots: int, service: float) -> None:
        self.slots, self.service = slots, service
        self.serving = 0
        self.waiting: collections.deque[Callable[[], None]] = collections.deque()

    def enter(self, respond: Callable[[], None]) -> None:
        if self.serving < self.slots:
            self._serve(respond)
        else:
            self.waiting.append(respond)

    def _serve(self, respond: Callable[[], None]) -> None:
        self.serving += 1

        def done() -> None:
            self.serving -= 1
            respond()
            if self.waiting:
                self._serve(self.waiting.popleft())

        asyncio.get_running_loop().call_later(self.service, done)


@dataclass(frozen=True)
class _Pushback:
    """The server's throttling and queueing settings (from its command line)."""

    throttle: tuple[float, float] | None = None  # (rate per second, burst) per prefix
    throttle_status: int = 503
    retry_after: float | None = None
    queue: tuple[int, float] | None = None  # (slots, service seconds) per prefix


# Set once per server process from its command line, before it serves: the protocol instances
# (one per connection) share the buckets and lines of each prefix.
_pushback = _Pushback()
_buckets: dict[str, _Bucket] = {}
_lines: dict[str, _Line] = {}
_throttled = 0


class _ObjectProtocol(asyncio.Protocol):
    """Minimal HTTP/1.1 for ``GET``/``HEAD /obj/{size}/{latency_ms}/{index}``, keep-alive.

    Written on asyncio's Protocol rather than aiohttp.web: the benchmark measures clients, and
    on a 2-core machine every microsecond the stand-in for remote storage spends is taken from
    them (a real object store costs the client machine nothing). aiohttp.web used ~125 µs of CPU
    per 100 KB response here; this ~35 µs. Bodies are memoryviews into one pool: no copy.
    Responses leave in request order, so pipelining clients are served correctly too.
    """

    def __init__(self) -> None:
        self._buf = b""
        self._transport: asyncio.Transport | None = None
        self._replies: collections.deque[list[bytes | memoryview] | None] = collections.deque()
        self._close_after = False
        self._sent = 0  # replies already written on this connection (indexes the deque)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None

    def data_received(self, data: bytes) -> None:
        self._buf += data
        while self._transport is not None:
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buf) > 65536:
                    self._transport.close()
                return
            head, self._buf = self._buf[:end].decode("latin-1"), self._buf[end + 4 :]
            self._handle(head)

    def _handle(self, head: str) -> None:
        lines = head.split("\r\n")
        method, target, version = [*lines[0].split(" "), "", "", ""][:3]
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if headers.get("connection", "").lower() == "close" or version == "HTTP/1.0":
            self._close_after = True
        self._replies.append(None)
        index = len(self._replies) - 1 + self._sent
        parts = target.split("/")
        global _requests, _throttled
        if target == "/count":  # how many object requests were served (hedges included)
            self._ready(index, _reply(200, [], str(_requests).encode()))
            return
        if target == "/throttled":  # how many requests were answered with a throttle
            self._ready(index, _reply(200, [], str(_throttled).encode()))
            return
        _requests += 1
        try:
            if method not in ("GET", "HEAD") or len(parts) != 5 or parts[1] != "obj":
                raise ValueError
            size, latency_ms, i = int(parts[2]), _latency_ms(parts[3]), int(parts[4])
        except ValueError:
            self._ready(index, _reply(400, [], b"expected GET /obj/{size}/{latency_ms}/{index}"))
            return
        loop = asyncio.get_running_loop()
        prefix = "/".join(parts[:4])
        if _pushback.throttle is not None:
            bucket = _buckets.get(prefix)
            if bucket is None:
                bucket = _buckets[prefix] = _Bucket(*_pushback.throttle, loop.time())
            if not bucket.take(loop.time()):
                # Answered at once, as S3 does: a throttle costs the store little.
                _throttled += 1
                self._ready(index, _throttle_reply())
                return
        respond = functools.partial(self._respond, index, method, size, i, headers.get("range"))
        if _pushback.queue is not None:
            line = _lines.get(prefix)
            if line is None:
                line = _lines[prefix] = _Line(*_pushback.queue)
            loop.call_later(latency_ms / 1000, line.enter, respond)
            return
        loop.call_later(latency_ms / 1000, respond)

    def _respond(self, index: int, method: str, size: int, i: int, rng: str | None) -> None:
        body: memoryview = object_view(i, size)
        # An ETag as S3 sends one: the AWS CRT client (s3torchconnector) refuses a reply without.
        extra = ["Accept-Ranges: bytes", f'ETag: "{size:x}-{i:x}"']
        status = 200
        if rng:
            span = _parse_range(rng, size)
            if span is None:
                self._ready(index, _reply(416, [f"Content-Range: bytes */{size}"], b""))
                return
            start, end = span
            body, status = body[start:end], 206
            extra.append(f"Content-Range: bytes {start}-{end - 1}/{size}")
        if method == "HEAD":
            self._ready(index, _reply(status, extra, b"", length=len(body)))
        else:
            self._ready(index, _reply(status, extra, body))

    def _ready(self, index: int, reply: list[bytes | memoryview]) -> None:
        self._replies[index - self._sent] = reply
        transport = self._transport
        while self._replies and self._replies[0] is not None:
            out = self._replies.popleft()
            self._sent += 1
            if transport is not None and not transport.is_closing():
                assert out is not None
                transport.writelines(out)
        if transport is not None and self._close_after and not self._replies:
            transport.close()


_requests = 0
_rng = random.Random(20261123)


def _latency_ms(spec: str) -> float:
    """Milliseconds for one request, drawn from the latency spec in the path.

    ``50``: always 50 ms. ``50x10p1``: 50 ms, but 1% of requests take 10x as long.
    ``ln40-400``: log-normal with median 40 ms and 99th percentile 400 ms. Drawn per request,
    so a repeated (hedged) request of the same object gets its own latency, as on S3.
    """
    if "x" in spec:
        base, _, rest = spec.partition("x")
        factor, _, percent = rest.partition("p")
        slow = _rng.random() * 100 < float(percent)
        return float(base) * (float(factor) if slow else 1.0)
    if spec.startswith("ln"):
        median, _, p99 = spec[2:].partition("-")
        sigma = math.log(float(p99) / float(median)) / 2.3263
        return float(median) * math.exp(_rng.gauss(0.0, sigma))
    return float(spec)


_REASONS = {
    200: "OK",
    206: "Partial Content",
    400: "Bad Request",
    416: "Range Not Satisfiable",
    429: "Too Many Requests",
    503: "Service Unavailable",
}


def _throttle_reply() -> list[bytes | memoryview]:
    if _pushback.throttle_status == 503:
        extra = ["Content-Type: application/xml"]
        body = SLOWDOWN_BODY
    else:
        extra, body = [], b"too many requests"
    if _pushback.retry_after is not None:
        extra.append(f"Retry-After: {_pushback.retry_after:g}")
    return _reply(_pushback.throttle_status, extra, body)


def _reply(
    status: int, extra: list[str], body: bytes | memoryview, length: int | None = None
) -> list[bytes | memoryview]:
    lines = [f"HTTP/1.1 {status} {_REASONS[status]}", *extra]
    lines.append(f"Content-Length: {len(body) if length is None else length}")
    return [("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"), body]


def _serve(host: str, port: int, pushback: _Pushback | None = None) -> None:
    global _pushback
    _pushback = pushback or _Pushback()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(_ObjectProtocol, host, port, backlog=4096)
        bound = server.sockets[0].getsockname()[1]
        stop = asyncio.Event()

        def watch_parent() -> None:
            # The parent holds our stdin open; EOF means it exited (or closed us): stop, so a
            # crashed benchmark never leaves a server behind.
            sys.stdin.buffer.read()
            loop.call_soon_threadsafe(stop.set)

        threading.Thread(target=watch_parent, daemon=True).start()
        print(f"PORT {bound}", flush=True)
        await stop.wait()
        server.close()

    object_bytes(0, 1)  # build the pool before announcing the port: no first-request stall
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop missing
        asyncio.run(main())
    else:
        # The server should be fast so that it is not what limits the loaders being compared.
        uvloop.run(main())


_P = TypeVar("_P", bound="ObjectServerProcess")


class ObjectServerProcess:
    """Starts ``_server.py`` as a child process on an ephemeral loopback port.

    Use as a context manager; the child exits when the context closes or when this process
    dies (it watches its stdin).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        *,
        throttle: tuple[float, float] | None = None,
        throttle_status: int = 503,
        retry_after: float | None = None,
        queue: tuple[int, float] | None = None,
    ) -> None:
        """*throttle* is ``(rate per second, burst)`` per prefix, *queue* ``(slots,
        service_ms)`` per prefix (see the module doc); both off by default."""
        self.host = host
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._args: list[str] = []
        if throttle is not None:
            self._args += ["--throttle", f"{throttle[0]:g}:{throttle[1]:g}"]
            self._args += ["--throttle-status", str(throttle_status)]
            if retry_after is not None:
                self._args += ["--retry-after", f"{retry_after:g}"]
        if queue is not None:
            self._args += ["--queue", f"{queue[0]}:{queue[1]:g}"]

    @property
    def pid(self) -> int:
        assert self._proc is not None, "server not started"
        return self._proc.pid

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def prefix(self, size: int, latency: float) -> str:
        """URL prefix of objects of *size* bytes served after *latency* seconds; add ``/{i}``."""
        return f"{self.base_url}/obj/{size}/{latency * 1000:g}"

    def url_for(self, index: int, size: int, latency: float) -> str:
        return f"{self.prefix(size, latency)}/{index}"

    def prefix_spec(self, size: int, spec: str) -> str:
        """Like :meth:`prefix` with a latency distribution (see ``_latency_ms``): ``"50"``,
        ``"50x10p1"`` (1% of requests 10x slower), ``"ln40-400"`` (log-normal p50/p99)."""
        return f"{self.base_url}/obj/{size}/{spec}"

    def requests(self) -> int:
        """Object requests served so far (a blocking GET /count)."""
        import urllib.request

        with urllib.request.urlopen(f"{self.base_url}/count", timeout=10) as resp:
            return int(resp.read())

    def throttled(self) -> int:
        """Requests answered with a throttle so far (a blocking GET /throttled)."""
        import urllib.request

        with urllib.request.urlopen(f"{self.base_url}/throttled", timeout=10) as resp:
            return int(resp.read())

    # Seconds a server may take to print its port (subclasses whose server imports more wait
    # longer).
    start_timeout = 30.0

    def command(self) -> list[str]:
        """The server's command line; subclasses that serve something else say theirs."""
        return [sys.executable, str(Path(__file__).resolve()), "--host", self.host, *self._args]

    def start(self: _P) -> _P:
        self._proc = subprocess.Popen(
            self.command(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        assert self._proc.stdout is not None
        # Bounded: a server that fails to start must not hang the benchmark.
        line = _readline_with_timeout(self._proc, self.start_timeout)
        if not line.startswith(b"PORT "):
            self.stop()
            raise RuntimeError(f"{type(self).__name__} did not start (said {line!r})")
        self.port = int(line.split()[1])
        return self

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.stdin is not None:
            proc.stdin.close()  # the server's stdin watcher sees EOF and shuts down cleanly
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        if proc.stdout is not None:
            proc.stdout.close()

    def __enter__(self: _P) -> _P:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _readline_with_timeout(proc: subprocess.Popen[bytes], timeout: float) -> bytes:
    out: list[bytes] = []
    assert proc.stdout is not None
    stdout = proc.stdout
    reader = threading.Thread(target=lambda: out.append(stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not out:
        proc.kill()
        raise RuntimeError(f"benchmark server did not report its port within {timeout:g}s")
    return out[0]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument(
        "--throttle", metavar="RATE:BURST", help="a token bucket per prefix (off by default)"
    )
    parser.add_argument("--throttle-status", type=int, choices=(503, 429), default=503)
    parser.add_argument("--retry-after", type=float, help="seconds, sent with each throttle")
    parser.add_argument(
        "--queue", metavar="SLOTS:SERVICE_MS", help="requests served at once per prefix"
    )
    args = parser.parse_args()
    throttle = queue = None
    if args.throttle:
        rate, _, burst = args.throttle.partition(":")
        throttle = (float(rate), float(burst or 1))
    if args.queue:
        slots, _, service_ms = args.queue.partition(":")
        queue = (int(slots), float(service_ms or 0) / 1000)
    _serve(
        args.host,
        args.port,
        _Pushback(throttle, args.throttle_status, args.retry_after, queue),
    )
