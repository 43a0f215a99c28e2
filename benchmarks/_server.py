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

Usage from a benchmark::

    with ObjectServerProcess() as server:
        url = server.url_for(index=7, size=100_000, latency=0.05)
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import math
import os
import random
import subprocess
import sys
import threading
from pathlib import Path
from types import TracebackType

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
        global _requests
        if target == "/count":  # how many object requests were served (hedges included)
            self._ready(index, _reply(200, [], str(_requests).encode()))
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
        loop.call_later(
            latency_ms / 1000, self._respond, index, method, size, i, headers.get("range")
        )

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


_REASONS = {200: "OK", 206: "Partial Content", 400: "Bad Request", 416: "Range Not Satisfiable"}


def _reply(
    status: int, extra: list[str], body: bytes | memoryview, length: int | None = None
) -> list[bytes | memoryview]:
    lines = [f"HTTP/1.1 {status} {_REASONS[status]}", *extra]
    lines.append(f"Content-Length: {len(body) if length is None else length}")
    return [("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"), body]


def _serve(host: str, port: int) -> None:
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


class ObjectServerProcess:
    """Starts ``_server.py`` as a child process on an ephemeral loopback port.

    Use as a context manager; the child exits when the context closes or when this process
    dies (it watches its stdin).
    """

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None

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

    def start(self) -> ObjectServerProcess:
        self._proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--host", self.host],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        assert self._proc.stdout is not None
        # Bounded: a server that fails to start must not hang the benchmark.
        line = _readline_with_timeout(self._proc, 30.0)
        if not line.startswith(b"PORT "):
            self.stop()
            raise RuntimeError(f"benchmark server did not start (said {line!r})")
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

    def __enter__(self) -> ObjectServerProcess:
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
    args = parser.parse_args()
    _serve(args.host, args.port)
