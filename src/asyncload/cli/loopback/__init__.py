"""One loopback object store for the tests, the benchmarks, ``asyncload demo`` and ``serve``.

A :class:`Store` holds what is served and how: objects from a mapping (``/<path>``) or generated
from the path (``/obj/{size}/{latency}/{index}``, see :func:`object_view`), a latency per request
(fixed, with jitter, or drawn from a tail distribution named in the path), ``Range`` and
``HEAD``, faults queued per path (:data:`FAULTS`), and two ways to push back per prefix (a
path's directory): a token bucket answering ``503 SlowDown`` or ``429`` and a queue of a few
slots in front of the store. It counts what it did (requests, hits, throttles, requests in
flight and their peak, cancellations).

Two ways to run it:

* :class:`ServerThread`: in a thread of this process, with its own event loop; the caller reads
  and changes the :class:`Store` directly (the tests).
* :class:`ServerProcess`: this file run as a *script* in a child process, which prints
  ``PORT <n>`` and serves until its stdin closes, so it also goes away when the parent dies
  (the benchmarks and the demo). Its CPU time is then not mixed into the measured client's.
  As a script it imports the standard library only (and uvloop when installed): it starts in a
  fraction of a second, without the package (and torch) behind it.

HTTP/1.1 is spoken on asyncio's ``Protocol`` rather than aiohttp.web: a benchmark measures its
clients, and on a 2-core machine every microsecond the stand-in for remote storage spends is
taken from them (aiohttp.web used ~125 µs of CPU per 100 KB response, this ~35 µs). Bodies are
memoryviews, not copies; pipelined requests are answered in order; keep-alive by default.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import http
import math
import os
import random
import ssl
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable, Coroutine, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar
from urllib.parse import unquote

__all__ = [
    "FAULTS",
    "ServerProcess",
    "ServerThread",
    "Store",
    "build_parser",
    "object_bytes",
    "object_view",
    "run_child",
    "serve",
    "store_from_args",
]

# Faults a caller can queue per path (Store.fail); each request to that path takes the next one:
#   "503", "500", "502", "504", "429", "404", "403", "401": respond with that status
#   "retry-after:S": 503 with a Retry-After header of S seconds
#   "short": announce the full Content-Length, send half the body, close the connection
#   "reset": send headers and a little body, then abort the TCP connection
#   "stall:S": send headers, then sleep S seconds before the body (the request counts as
#              cancelled when the client closes the connection meanwhile)
#   "trickle:S": send headers, then the body in 25 pieces spread over S seconds
#   "redirect:URL": 302 to URL (relative or absolute)
#   "short-replace": like "short", then the object becomes ``replacements[path]`` (a new ETag)
#   "s3-403": 403 with an S3 SignatureDoesNotMatch XML body that echoes fake credentials
FAULTS = ("500", "502", "503", "504", "429", "404", "403", "401", "short", "reset")

# What S3 answers a request whose signature does not match; the secrets are fake but distinct.
S3_SIGNATURE_ERROR = (
    '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SignatureDoesNotMatch</Code>'
    "<Message>The request signature we calculated does not match the signature you provided."
    "</Message><AWSAccessKeyId>AKIAFAKEACCESSKEY01</AWSAccessKeyId>"
    "<StringToSign>AWS4-HMAC-SHA256\n20260101T000000Z\nfake-string-to-sign-77</StringToSign>"
    "<SignatureProvided>fakesignatureprovided99</SignatureProvided>"
    "<RequestId>4442587FB7D0A2F9</RequestId></Error>"
)

# What S3 answers a request over its prefix's request rate (the client retries after a backoff).
S3_SLOWDOWN = (
    '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    "<Message>Please reduce your request rate.</Message>"
    "<RequestId>7A5FC1D2E3B4A596</RequestId><HostId>loopback</HostId></Error>"
)

# ── generated objects ─────────────────────────────────────────────────────────────────────────

# Every generated object is a window into one fixed pseudo-random pool, so a response costs a
# slice, not a random-number draw, and bodies differ from index to index (no accidental caching).
_POOL_SIZE = 1 << 22
_STRIDE = 4099  # prime: consecutive indices start at unrelated offsets
_POOL: bytes | None = None


def object_view(index: int, size: int) -> memoryview:
    """The body of generated object *index* of *size* bytes, without a copy.

    Args:
        index: The object's index (the last field of its path).
        size: Its size in bytes.
    """
    global _POOL
    if _POOL is None:
        # Seeded rather than os.urandom: the same bytes in every process, so a client can
        # check what it received without asking the server.
        _POOL = random.Random(20240601).randbytes(_POOL_SIZE + (1 << 20))
    start = (index * _STRIDE) % _POOL_SIZE
    if size <= len(_POOL) - start:
        return memoryview(_POOL)[start : start + size]
    # Larger than the pool's tail: repeat it (objects that big are only used for throughput).
    reps = size // len(_POOL) + 2
    return memoryview(_POOL * reps)[start : start + size]


def object_bytes(index: int, size: int) -> bytes:
    """The body the store sends for generated object *index* of *size* bytes (to check reads).

    Args:
        index: The object's index.
        size: Its size in bytes.
    """
    return bytes(object_view(index, size))


def latency_seconds(spec: str, rng: random.Random) -> float:
    """Seconds for one request, drawn from the latency spec of a generated object's path.

    ``50``: always 50 ms. ``50x10p1``: 50 ms, but 1% of requests take 10x as long.
    ``ln40-400``: log-normal with median 40 ms and 99th percentile 400 ms. Drawn per request,
    so a repeated (hedged) request of the same object gets its own latency, as on S3.

    Args:
        spec: The spec, in milliseconds.
        rng: Where the draws come from.

    Raises:
        ValueError: *spec* is none of these.
    """
    if "x" in spec:
        base, _, rest = spec.partition("x")
        factor, _, percent = rest.partition("p")
        slow = rng.random() * 100 < float(percent)
        return float(base) * (float(factor) if slow else 1.0) / 1e3
    if spec.startswith("ln"):
        median, _, p99 = spec[2:].partition("-")
        sigma = math.log(float(p99) / float(median)) / 2.3263
        return float(median) * math.exp(rng.gauss(0.0, sigma)) / 1e3
    return float(spec) / 1e3


def parse_range(header: str, size: int) -> tuple[int, int] | None:
    """The ``[start, end)`` a ``Range`` header asks of *size* bytes; ``None``: unsatisfiable.

    Args:
        header: ``bytes=START-END`` (END inclusive), ``bytes=START-`` or ``bytes=-SUFFIX``;
            only the first range of a list is served.
        size: The object's size.

    Raises:
        ValueError: The header is malformed or not in bytes (served whole, as RFC 9110 says).
    """
    if not header.startswith("bytes="):
        raise ValueError(header)
    first, _, last = header[6:].split(",")[0].strip().partition("-")
    if first == "":
        suffix = int(last)
        return (max(0, size - suffix), size) if suffix > 0 and size > 0 else None
    start = int(first)
    end = int(last) + 1 if last else size
    if start < 0 or end <= start:
        raise ValueError(header)
    return (start, min(end, size)) if start < size else None


# ── the store ─────────────────────────────────────────────────────────────────────────────────


class _Line:
    """At most *slots* requests served at once for *service* seconds each; the rest wait."""

    def __init__(self, slots: int, service: float) -> None:
        self.slots, self.service = slots, service
        self.serving = 0
        self.waiting: collections.deque[tuple[_Request, Callable[[_Request], None]]]
        self.waiting = collections.deque()

    def enter(self, req: _Request, then: Callable[[_Request], None]) -> None:
        if self.serving < self.slots:
            self._serve(req, then)
        else:
            self.waiting.append((req, then))  # in order, as asyncio's semaphore wakes waiters

    def _serve(self, req: _Request, then: Callable[[_Request], None]) -> None:
        self.serving += 1

        def done() -> None:
            self.serving -= 1
            if not req.done:
                then(req)
            while self.waiting and self.serving < self.slots:
                nxt, after = self.waiting.popleft()
                if not nxt.done:  # its client went away while it waited: it takes no slot
                    self._serve(nxt, after)

        asyncio.get_running_loop().call_later(self.service, done)


@dataclass(eq=False)
class Store:
    """What the loopback server serves and how, and what it counted.

    Handlers read it on the server's event loop; a test in another thread may change it between
    requests (plain attribute writes, as the tests always did).
    """

    host: str = "127.0.0.1"
    port: int = 0
    scheme: str = "http"
    objects: Mapping[str, bytes] = field(default_factory=dict)
    """Bodies by path (without the leading ``/``); any mapping (``asyncload serve``'s folder)."""
    generated: bool = False
    """Serve ``/obj/{size}/{latency_ms}/{index}`` (:func:`object_view`, :func:`latency_seconds`)."""
    corpora: dict[int, list[bytes]] = field(default_factory=dict)
    """Generated paths whose size field is a key here serve ``corpora[size][index]`` instead."""
    control: bool = False
    """Answer ``/count``, ``/throttled`` and ``/peak`` with counters (a child's parent asks)."""
    record: bool = True
    """Keep ``hits``, ``raw_paths`` and ``headers_seen`` (off in benchmarks: they only grow)."""
    latency: float = 0.0
    jitter: float = 0.0
    faults: dict[str, collections.deque[str]] = field(default_factory=dict)
    # Per-path delays (seconds) taken one per request, after the latency and the queue: a path
    # with delays queued gets its next request held that long (a straggler).
    delays: dict[str, collections.deque[float]] = field(default_factory=dict)
    replacements: dict[str, bytes] = field(default_factory=dict)
    conditionals: bool = True  # honour If-Match (412) and If-Range (200 when it differs)

    # Pushing back, per prefix (a path's directory), off by default. throttle_rate: a token
    # bucket of that many requests per second (bursts of throttle_burst); a request without a
    # token is answered at once with throttle_status: 503 and S3's SlowDown body, or 429; with
    # Retry-After when throttle_retry_after is set. queue_slots: at most that many requests
    # served at once per prefix, each for queue_service seconds after the latency; the rest
    # wait in line (latency grows with load).
    throttle_rate: float | None = None
    throttle_burst: float = 1.0
    throttle_status: int = 503
    throttle_retry_after: float | None = None
    queue_slots: int | None = None
    queue_service: float = 0.0

    requests: int = 0  # requests received (control ones aside), hedges and throttled included
    hits: collections.Counter[str] = field(default_factory=collections.Counter)
    raw_paths: list[str] = field(default_factory=list)  # request targets exactly as received
    headers_seen: list[dict[str, str]] = field(default_factory=list)
    throttled: int = 0  # requests answered with a throttle
    active: int = 0  # requests being handled now
    peak_active: int = 0  # most requests handled at once (since reset() or the last /peak)
    finished: int = 0  # requests handled to the end (rounds, not clocks)
    cancelled: int = 0  # requests whose client went away before the response was sent

    _buckets: dict[str, list[float]] = field(default_factory=dict)  # prefix: [tokens, when]
    _lines: dict[str, _Line] = field(default_factory=dict)
    _rng: random.Random = field(default_factory=lambda: random.Random(20261123))

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    def url_for(self, path: str) -> str:
        return f"{self.url}/{path.lstrip('/')}"

    def put(self, path: str, data: bytes) -> str:
        """Store *data* at *path*; returns its URL."""
        if not isinstance(self.objects, MutableMapping):
            raise TypeError("this store's objects are read-only")
        self.objects[path.lstrip("/")] = data
        return self.url_for(path)

    def fail(self, path: str, *faults: str) -> None:
        """Answer the next requests to *path* with these :data:`FAULTS`, one per request."""
        self.faults.setdefault(path.lstrip("/"), collections.deque()).extend(faults)

    def delay(self, path: str, *seconds: float) -> None:
        """Hold the next requests to *path* for these many seconds, one value per request."""
        self.delays.setdefault(path.lstrip("/"), collections.deque()).extend(seconds)

    def reset(self) -> None:
        """Forget the objects, faults, settings and counts (not how the store is run)."""
        if isinstance(self.objects, MutableMapping):
            self.objects.clear()
        else:
            self.objects = {}
        for queue in (self.faults, self.delays, self.replacements, self._buckets, self._lines):
            queue.clear()
        self.hits.clear()
        self.raw_paths.clear()
        self.headers_seen.clear()
        self.conditionals = True
        self.latency = self.jitter = 0.0
        self.throttle_rate, self.throttle_burst = None, 1.0
        self.throttle_status, self.throttle_retry_after = 503, None
        self.queue_slots, self.queue_service = None, 0.0
        self.requests = self.throttled = self.peak_active = self.finished = self.cancelled = 0

    def take_token(self, prefix: str, now: float) -> bool:
        """Whether the token bucket of *prefix* lets a request through at *now*."""
        assert self.throttle_rate is not None
        tokens, last = self._buckets.get(prefix, (self.throttle_burst, now))
        tokens = min(self.throttle_burst, tokens + (now - last) * self.throttle_rate)
        ok = tokens >= 1.0
        self._buckets[prefix] = [tokens - 1.0 if ok else tokens, now]
        return ok

    def find(self, path: str) -> tuple[bytes | memoryview, str] | None:
        """The body and ETag served at *path*, or ``None``."""
        data = self.objects.get(path)
        if data is not None:
            return data, f'"{hash(data) & 0xFFFFFFFF:x}"'
        if self.generated and path.startswith("obj/"):
            parts = path.split("/")
            try:
                size, index = int(parts[1]), int(parts[3])
            except (IndexError, ValueError):
                return None
            # An ETag as S3 sends one: the AWS CRT client (s3torchconnector) wants one.
            etag = f'"{size:x}-{index:x}"'
            blobs = self.corpora.get(size)
            if blobs is None:
                return object_view(index, size), etag
            if 0 <= index < len(blobs):
                return memoryview(blobs[index]), etag
        return None

    def _control(self, target: str) -> int | None:
        if target == "/count":
            return self.requests
        if target == "/throttled":
            return self.throttled
        if target == "/peak":  # the most since the last time it was asked
            peak, self.peak_active = self.peak_active, self.active
            return peak
        return None


# ── HTTP/1.1 ──────────────────────────────────────────────────────────────────────────────────

_Reply = list[bytes | memoryview]
_PHRASES = {s.value: s.phrase for s in http.HTTPStatus}


def _reply(
    status: int,
    extra: Sequence[str] = (),
    body: bytes | memoryview = b"",
    *,
    length: int | None = None,
    content_type: str = "text/plain; charset=utf-8",
) -> _Reply:
    head = [f"HTTP/1.1 {status} {_PHRASES[status]}", *extra]
    head.append(f"Content-Type: {content_type}")
    head.append(f"Content-Length: {len(body) if length is None else length}")
    return [("\r\n".join(head) + "\r\n\r\n").encode("latin-1"), body]


class _Request:
    __slots__ = ("done", "handle", "headers", "method", "path", "slot")

    def __init__(self, slot: int, method: str, path: str, headers: dict[str, str]) -> None:
        self.slot, self.method, self.path, self.headers = slot, method, path, headers
        self.handle: asyncio.TimerHandle | asyncio.Task[None] | None = None
        self.done = False


@dataclass
class _Stream:
    """A reply written over time (a fault), started once the replies before it are out."""

    req: _Request
    fault: str
    head: bytes
    body: bytes | memoryview


class _Connection(asyncio.Protocol):
    """One client connection: parses requests, answers them in order."""

    def __init__(self, store: Store, conns: set[_Connection]) -> None:
        self._store = store
        self._conns = conns
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._buf = b""
        self._skip = 0  # body bytes of the last request still to read past
        # Replies in request order: None until ready; _sent of them already written.
        self._replies: collections.deque[_Reply | _Stream | None] = collections.deque()
        self._sent = 0
        self._open: dict[int, _Request] = {}  # requests not done, by slot
        self._streaming = False
        self._close_after = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass
        self._conns.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._conns.discard(self)
        self._replies.clear()
        for req in list(self._open.values()):
            if req.handle is not None:
                req.handle.cancel()
            self._store.cancelled += 1
            self._end(req)

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    def data_received(self, data: bytes) -> None:
        buf = self._buf + data if self._buf else data
        while self._transport is not None:
            if self._skip:
                taken = min(self._skip, len(buf))
                self._skip -= taken
                buf = buf[taken:]
                if self._skip:
                    break
            if buf and not 65 <= buf[0] <= 90:
                # Not a method (A-Z): say so in plain HTTP and hang up, as HTTP servers do, so
                # that a TLS client hello sent here learns this server speaks plain HTTP.
                self._close_after = True
                self._replies.append(None)
                self._ready(self._sent + len(self._replies) - 1, _reply(400, body=b"bad request"))
                buf = b""
                break
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > 65536:
                    self._transport.close()
                break
            head, buf = buf[:end].decode("latin-1"), buf[end + 4 :]
            self._handle(head)
        self._buf = buf

    def _handle(self, head: str) -> None:
        lines = head.split("\r\n")
        method, target, version = [*lines[0].split(" "), "", "", ""][:3]
        store = self._store
        seen: dict[str, str] = {}
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name, value = name.strip(), value.strip()
            headers[name.lower()] = value
            if store.record:
                seen[name] = value
        if headers.get("connection", "").lower() == "close" or version == "HTTP/1.0":
            self._close_after = True
        slot = self._sent + len(self._replies)
        self._replies.append(None)
        if "transfer-encoding" in headers:  # no request here has a body worth a parser
            self._close_after = True
            self._ready(slot, _reply(400, body=b"chunked request bodies are not read"))
            return
        try:
            self._skip = int(headers.get("content-length", 0))
        except ValueError:
            self._close_after = True
            self._ready(slot, _reply(400, body=b"bad Content-Length"))
            return
        if store.control:
            count = store._control(target)
            if count is not None:
                self._ready(slot, _reply(200, body=str(count).encode()))
                return
        path = unquote(target.partition("?")[0].lstrip("/"))
        req = _Request(slot, method, path, headers)
        store.requests += 1
        store.active += 1
        store.peak_active = max(store.peak_active, store.active)
        if store.record:
            store.hits[path] += 1
            store.raw_paths.append(target)
            store.headers_seen.append(seen)
        self._open[slot] = req
        if method not in ("GET", "HEAD"):
            self._finish(req, _reply(405, ["Allow: GET, HEAD"], b"GET and HEAD only"))
            return
        prefix = path.rpartition("/")[0]
        if store.throttle_rate is not None and not store.take_token(prefix, self._loop.time()):
            store.throttled += 1
            self._finish(req, self._throttle_reply())  # at once, as S3 does: it costs little
            return
        delay = store.latency
        if store.jitter:
            delay += store._rng.uniform(0.0, store.jitter)
        if store.generated and path.startswith("obj/"):
            parts = path.split("/")
            try:
                delay += latency_seconds(parts[2], store._rng)
            except (IndexError, ValueError):
                text = b"expected /obj/{size}/{latency_ms}/{index}"
                self._finish(req, _reply(400, body=text))
                return
        self._after(delay, self._lined, req)

    def _after(self, delay: float, then: Callable[[_Request], None], req: _Request) -> None:
        if delay > 0:
            req.handle = self._loop.call_later(delay, then, req)
        else:
            then(req)

    def _lined(self, req: _Request) -> None:
        store = self._store
        if store.queue_slots is None:
            self._held(req)
            return
        prefix = req.path.rpartition("/")[0]
        line = store._lines.get(prefix)
        if line is None:
            line = store._lines[prefix] = _Line(store.queue_slots, store.queue_service)
        line.enter(req, self._held)

    def _held(self, req: _Request) -> None:
        held = self._store.delays.get(req.path)
        if held:
            self._after(held.popleft(), self._serve, req)
        else:
            self._serve(req)

    def _serve(self, req: _Request) -> None:
        req.handle = None
        store, path = self._store, req.path
        queue = store.faults.get(path)
        fault = queue.popleft() if queue else None
        if fault is not None:
            if fault.isdigit():
                self._finish(req, _reply(int(fault), body=f"injected {fault}".encode()))
                return
            if fault.startswith("redirect:"):
                where = fault.split(":", 1)[1]
                self._finish(req, _reply(302, [f"Location: {where}"], b"302: Found"))
                return
            if fault == "s3-403":
                xml = S3_SIGNATURE_ERROR.encode()
                self._finish(req, _reply(403, body=xml, content_type="application/xml"))
                return
            if fault.startswith("retry-after:"):
                extra = [f"Retry-After: {fault.split(':', 1)[1]}"]
                self._finish(req, _reply(503, extra, b"slow down"))
                return
        found = store.find(path)
        if found is None:
            self._finish(req, _reply(404, body=b"no such object"))
            return
        data, etag = found
        body: bytes | memoryview = data
        size = len(data)
        extra = ["Accept-Ranges: bytes", f"ETag: {etag}"]
        status = 200
        rng = req.headers.get("range")
        if store.conditionals:
            if req.headers.get("if-match", etag) != etag:
                self._finish(req, _reply(412, body=b"precondition failed"))
                return
            if req.headers.get("if-range", etag) != etag:
                rng = None  # a different version: the whole new one, as RFC 9110 says
        if rng:
            try:
                span = parse_range(rng, size)
            except ValueError:
                pass
            else:
                if span is None:
                    self._finish(req, _reply(416, [f"Content-Range: bytes */{size}"]))
                    return
                start, end = span
                status, body = 206, data[start:end]
                extra.append(f"Content-Range: bytes {start}-{end - 1}/{size}")
        octets = "application/octet-stream"
        if req.method == "HEAD":
            self._finish(req, _reply(status, extra, length=len(body), content_type=octets))
        elif fault in ("short", "reset", "short-replace") or (fault or "").startswith(
            ("stall:", "trickle:")
        ):
            assert fault is not None
            head = _reply(status, extra, length=len(body), content_type=octets)[0]
            assert isinstance(head, bytes)
            self._replies[req.slot - self._sent] = _Stream(req, fault, head, body)
            self._flush()
        else:
            self._finish(req, _reply(status, extra, body, content_type=octets))

    def _throttle_reply(self) -> _Reply:
        store = self._store
        extra = []
        if store.throttle_retry_after is not None:
            extra.append(f"Retry-After: {store.throttle_retry_after:g}")
        if store.throttle_status == 503:
            body = S3_SLOWDOWN.encode()
            return _reply(503, extra, body, content_type="application/xml")
        return _reply(store.throttle_status, extra, b"too many requests")

    def _end(self, req: _Request) -> None:
        if req.done:
            return
        req.done = True
        self._open.pop(req.slot, None)
        self._store.active -= 1
        self._store.finished += 1

    def _finish(self, req: _Request, reply: _Reply) -> None:
        self._end(req)
        self._ready(req.slot, reply)

    def _ready(self, slot: int, reply: _Reply) -> None:
        if self._transport is None:
            return
        self._replies[slot - self._sent] = reply
        self._flush()

    def _flush(self) -> None:
        transport = self._transport
        replies = self._replies
        while transport is not None and replies and not self._streaming:
            out = replies[0]
            if out is None:
                return
            if isinstance(out, _Stream):
                self._streaming = True
                task = self._loop.create_task(self._stream(out))
                out.req.handle = task
                task.add_done_callback(self._streamed)
                return
            replies.popleft()
            self._sent += 1
            if not transport.is_closing():
                transport.writelines(out)
        if transport is not None and self._close_after and not replies and not self._streaming:
            transport.close()

    async def _stream(self, out: _Stream) -> None:
        transport = self._transport
        assert transport is not None
        req, fault, body = out.req, out.fault, out.body
        transport.write(out.head)
        if fault.startswith("trickle:"):
            step = max(1, -(-len(body) // 25))
            for at in range(0, len(body), step):
                await asyncio.sleep(float(fault.split(":", 1)[1]) / 25)
                transport.write(body[at : at + step])
            self._end(req)
            return
        if fault.startswith("stall:"):
            await asyncio.sleep(float(fault.split(":", 1)[1]))
            transport.write(body)
            self._end(req)
            return
        transport.write(body[: len(body) // 2])
        if fault == "short-replace":
            objects = self._store.objects
            assert isinstance(objects, MutableMapping)
            objects[req.path] = self._store.replacements.pop(req.path)
        # Ended before the connection goes: a fault that was served, not a client that left.
        self._end(req)
        if fault == "reset":
            transport.abort()
        else:
            transport.close()

    def _streamed(self, task: asyncio.Task[None]) -> None:
        self._streaming = False
        if self._transport is None:
            return  # connection_lost cleared the replies
        self._replies.popleft()
        self._sent += 1
        self._flush()


# ── running it ────────────────────────────────────────────────────────────────────────────────


async def _listen(
    store: Store, conns: set[_Connection], *, backlog: int, ssl_context: ssl.SSLContext | None
) -> asyncio.AbstractServer:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: _Connection(store, conns), store.host, store.port, backlog=backlog, ssl=ssl_context
    )
    store.port = server.sockets[0].getsockname()[1]
    if ssl_context is not None:
        store.scheme = "https"
    return server


async def serve(
    store: Store,
    *,
    backlog: int = 4096,
    announce: Callable[[Store], None] | None = None,
    until_stdin_closes: bool = False,
) -> None:
    """Serve *store* on ``store.host:store.port`` until cancelled (or stdin closes).

    Args:
        store: What to serve; its ``port`` becomes the bound one (0: an ephemeral port).
        backlog: The listen backlog: large, so a burst of connections from many workers is
            not dropped (``python -m http.server`` has 5).
        announce: Called once the server accepts connections.
        until_stdin_closes: Also stop at end of file on stdin: a parent holds it open, so the
            server never outlives it.

    Raises:
        OSError: The address cannot be bound.
    """
    conns: set[_Connection] = set()
    server = await _listen(store, conns, backlog=backlog, ssl_context=None)
    stop = asyncio.Event()
    if until_stdin_closes:
        loop = asyncio.get_running_loop()

        def wait_for_eof() -> None:
            sys.stdin.buffer.read()
            loop.call_soon_threadsafe(stop.set)

        threading.Thread(target=wait_for_eof, daemon=True).start()
    if announce is not None:
        announce(store)
    try:
        await stop.wait()
    finally:
        server.close()
        for conn in list(conns):
            conn.abort()


def run_child(store: Store) -> None:
    """Serve *store* as a child process does: print ``PORT <n>``, stop when stdin closes."""
    if store.generated:
        object_view(0, 1)  # build the pool before announcing the port: no first-request stall
    main = serve(
        store,
        announce=lambda s: print(f"PORT {s.port}", flush=True),
        until_stdin_closes=True,
    )
    run: Callable[[Coroutine[Any, Any, None]], None] = asyncio.run
    try:
        import uvloop

        # The server should be fast so that it is not what limits the clients being measured.
        run = uvloop.run
    except ImportError:  # pragma: no cover - uvloop missing (Windows)
        pass
    run(main)


_T = TypeVar("_T", bound="ServerThread")


class ServerThread:
    """A :class:`Store` served from a background thread with its own event loop.

    The caller's process and its worker processes both reach it over loopback TCP; the caller
    changes the store directly. Use as a context manager, or :meth:`start` and :meth:`stop`.
    """

    def __init__(
        self, store: Store | None = None, *, ssl_context: ssl.SSLContext | None = None
    ) -> None:
        """Args:
        store: What to serve (a new, empty :class:`Store` when ``None``).
        ssl_context: Serve HTTPS with it (``store.scheme`` becomes ``"https"``).
        """
        self.store = store if store is not None else Store()
        self.ssl_context = ssl_context
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self: _T) -> _T:
        """Start serving; returns once the server accepts connections.

        Raises:
            RuntimeError: It did not start within 10 seconds.
        """
        ready = threading.Event()
        failed: list[BaseException] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, args=(ready, failed), daemon=True)
        self._thread.start()
        if not ready.wait(10) or failed:
            raise RuntimeError("loopback object server did not start") from (
                failed[0] if failed else None
            )
        return self

    def _run(self, ready: threading.Event, failed: list[BaseException]) -> None:
        loop = self._loop
        assert loop is not None
        asyncio.set_event_loop(loop)
        conns: set[_Connection] = set()
        try:
            server = loop.run_until_complete(
                _listen(self.store, conns, backlog=1024, ssl_context=self.ssl_context)
            )
        except BaseException as exc:
            failed.append(exc)
            ready.set()
            return
        ready.set()
        loop.run_forever()
        server.close()
        for conn in list(conns):
            conn.abort()
        for _ in range(3):  # connection_lost, then the stream tasks it cancelled, finish
            loop.run_until_complete(asyncio.sleep(0))
        loop.run_until_complete(server.wait_closed())

    def stop(self) -> None:
        """Stop serving: close every connection and the event loop."""
        thread, self._thread = self._thread, None
        loop, self._loop = self._loop, None
        if thread is None or loop is None:
            return
        if thread.is_alive():
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
        loop.close()
        if self.ssl_context is not None:
            # A TLS handshake the client refused leaves its server-side transport to the
            # collector; collect it here rather than in whatever runs next.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ResourceWarning)
                gc.collect()

    def __enter__(self: _T) -> _T:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


_P = TypeVar("_P", bound="ServerProcess")


class ServerProcess:
    """This file (or another script that calls :func:`run_child`) run in a child process.

    Use as a context manager; the child exits when the context closes or when this process
    dies (it watches its stdin).
    """

    start_timeout = 30.0
    """Seconds the child may take to print its port (a script that imports more, longer)."""

    def __init__(self, args: Sequence[str] = (), *, host: str = "127.0.0.1") -> None:
        """Args:
        args: This script's options (see :func:`build_parser`), ``--host`` aside.
        host: The address to listen on.
        """
        self.host = host
        self.port = 0
        self._args = list(args)
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self._proc is not None, "server not started"
        return self._proc.pid

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        """The child's command line; subclasses that run another script say theirs."""
        return [sys.executable, str(Path(__file__).resolve()), "--host", self.host, *self._args]

    def count(self, name: str) -> int:
        """A counter of a store with ``--control`` (``count``, ``throttled``, ``peak``)."""
        import urllib.request

        with urllib.request.urlopen(f"{self.base_url}/{name}", timeout=10) as resp:
            return int(resp.read())

    def start(self: _P) -> _P:
        """Start the child; returns once it accepts connections.

        Raises:
            RuntimeError: It did not print its port within :attr:`start_timeout`.
        """
        self._proc = subprocess.Popen(
            self.command(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        line = self._first_line()
        if not line.startswith(b"PORT "):
            code = self._proc.poll()
            self.stop()
            raise RuntimeError(f"{type(self).__name__} did not start (exit {code}, said {line!r})")
        self.port = int(line.split()[1])
        return self

    def _first_line(self) -> bytes:
        proc = self._proc
        assert proc is not None
        assert proc.stdout is not None
        stdout = proc.stdout
        out: list[bytes] = []
        # A thread, bounded: a child that fails to start must not hang its parent.
        reader = threading.Thread(target=lambda: out.append(stdout.readline()), daemon=True)
        reader.start()
        reader.join(self.start_timeout)
        return out[0] if out else b""

    def stop(self) -> None:
        """Close the child's stdin and wait for it to exit (kill it after 10 seconds)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.stdin is not None:
            proc.stdin.close()  # the child sees end of file and shuts down cleanly
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


# ── the script ────────────────────────────────────────────────────────────────────────────────


def build_parser() -> argparse.ArgumentParser:
    """The script's options; a benchmark that serves more adds its own to it."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument(
        "--generated", action="store_true", help="serve /obj/{size}/{latency_ms}/{index}"
    )
    parser.add_argument("--folder", help="serve the files under this folder (read at start)")
    parser.add_argument("--latency", type=float, default=0.0, help="seconds per request")
    parser.add_argument("--control", action="store_true", help="answer /count, /throttled, /peak")
    parser.add_argument(
        "--throttle", metavar="RATE:BURST", help="a token bucket per prefix (off by default)"
    )
    parser.add_argument("--throttle-status", type=int, choices=(503, 429), default=503)
    parser.add_argument("--retry-after", type=float, help="seconds, sent with each throttle")
    parser.add_argument(
        "--queue", metavar="SLOTS:SERVICE_MS", help="requests served at once per prefix"
    )
    return parser


def store_from_args(args: argparse.Namespace) -> Store:
    """The :class:`Store` that :func:`build_parser`'s options describe."""
    store = Store(
        host=args.host,
        port=args.port,
        generated=args.generated,
        control=args.control,
        record=False,  # a child serves for long; nobody reads these lists there
        latency=args.latency,
        throttle_status=args.throttle_status,
        throttle_retry_after=args.retry_after,
    )
    if args.folder:
        root = Path(args.folder)
        files = (p for p in sorted(root.rglob("*")) if p.is_file())
        store.objects = {p.relative_to(root).as_posix(): p.read_bytes() for p in files}
    if args.throttle:
        rate, _, burst = args.throttle.partition(":")
        store.throttle_rate, store.throttle_burst = float(rate), float(burst or 1)
    if args.queue:
        slots, _, service_ms = args.queue.partition(":")
        store.queue_slots, store.queue_service = int(slots), float(service_ms or 0) / 1e3
    return store


if __name__ == "__main__":
    run_child(store_from_args(build_parser().parse_args()))
