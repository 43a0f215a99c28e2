"""The loopback store and its decisions, whatever speaks HTTP in front of it.

A :class:`Store` holds what is served and how, and what it counted. A front end (``web.py``,
``fast.py``) parses a request into a :class:`Ticket` and walks it through the store's steps,
doing only the I/O and the waiting itself:

1. :meth:`Store.control`: a counter asked by a child's parent (``/count``), answered at once.
2. :meth:`Store.admit`: counted; a :class:`Reply` to send at once (405, a throttle, a bad
   generated path) or the seconds to wait first (latency, jitter, the path's latency spec).
3. :meth:`Store.line`: the prefix's queue, when there is one (calls back when served).
4. :meth:`Store.hold`: seconds more for a straggler queued with :meth:`Store.delay`.
5. :meth:`Store.respond`: the reply, after popping the path's next fault; its
   :attr:`Reply.fault` says how to send it wrongly (short, reset, stall, trickle).
6. :meth:`Store.end` once sent, or :meth:`Store.cancel` when the client went away first.
"""

from __future__ import annotations

import asyncio
import collections
import random
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field

from .generated import latency_seconds, object_view
from .messages import OCTETS, S3_SIGNATURE_ERROR, S3_SLOWDOWN, XML, Reply, Ticket, parse_range

__all__ = ["FAULTS", "Store"]

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
#   "no-content-range": a 206 without its Content-Range header (a gateway that drops it)
FAULTS = ("500", "502", "503", "504", "429", "404", "403", "401", "short", "reset")

# Faults acted out while the body is sent, by the front end (Reply.fault).
_SENT_WRONG = ("short", "reset", "short-replace", "stall:", "trickle:")


class _Line:
    """At most *slots* requests served at once for *service* seconds each; the rest wait."""

    def __init__(self, slots: int, service: float) -> None:
        self.slots, self.service = slots, service
        self.serving = 0
        self.waiting: collections.deque[tuple[Ticket, Callable[[Ticket], None]]]
        self.waiting = collections.deque()

    def enter(self, req: Ticket, then: Callable[[Ticket], None]) -> None:
        if self.serving < self.slots:
            self._serve(req, then)
        else:
            self.waiting.append((req, then))  # in order, as asyncio's semaphore wakes waiters

    def _serve(self, req: Ticket, then: Callable[[Ticket], None]) -> None:
        self.serving += 1

        def done() -> None:
            self.serving -= 1
            if not req.done:
                then(req)
            while self.waiting and self.serving < self.slots:
                nxt, after = self.waiting.popleft()
                if not nxt.done:  # its client went away while it waited: it takes no slot
                    self._serve(nxt, after)

        # Timers rather than a task per request: the benchmark front end has no tasks.
        asyncio.get_running_loop().call_later(self.service, done)


@dataclass(eq=False)
class Store:
    """What the loopback server serves and how, and what it counted.

    Front ends read it on the server's event loop; a test in another thread may change it
    between requests (plain attribute writes, as the tests always did).
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
    ranges: bool = True  # honour Range; off: every object whole, as a server without ranges

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
        """Store *data* at *path*; returns its URL.

        Raises:
            TypeError: The store's objects are a read-only mapping.
        """
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
        self.conditionals = self.ranges = True
        self.latency = self.jitter = 0.0
        self.throttle_rate, self.throttle_burst = None, 1.0
        self.throttle_status, self.throttle_retry_after = 503, None
        self.queue_slots, self.queue_service = None, 0.0
        self.requests = self.throttled = self.peak_active = self.finished = self.cancelled = 0

    def take_token(self, prefix: str, now: float) -> bool:
        """Whether the token bucket of *prefix* lets a request through at *now* (seconds)."""
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

    # ── the steps of a request, in order ────────────────────────────────────────────────────

    def answer_control(self, target: str) -> Reply | None:
        """The reply to a counter request (``/count``, ``/throttled``, ``/peak``) or to
        ``/throttle-rate/<per second>`` (a new rate for the token buckets, answered with
        itself; a change of the store's allowance while a loader reads), or ``None``.

        Not counted as a request; only with :attr:`control` on.
        """
        if not self.control:
            return None
        if target.startswith("/throttle-rate/") and self.throttle_rate is not None:
            try:
                self.throttle_rate = float(target.rpartition("/")[2])
            except ValueError:
                return Reply(400, body=b"throttle-rate takes a number of requests per second")
            return Reply(200, body=f"{self.throttle_rate:g}".encode())
        if target == "/count":
            count = self.requests
        elif target == "/throttled":
            count = self.throttled
        elif target == "/peak":  # the most since the last time it was asked
            count, self.peak_active = self.peak_active, self.active
        else:
            return None
        return Reply(200, body=str(count).encode())

    def admit(self, req: Ticket, seen: dict[str, str] | None = None) -> Reply | float:
        """Count *req*; what to answer at once, or the seconds to wait before :meth:`line`.

        Args:
            req: The request. A :class:`Reply` returned here ends it (call :meth:`end`).
            seen: Its headers as received (names as spelled), kept when :attr:`record` is on.
        """
        self.requests += 1
        self.active += 1
        if self.active > self.peak_active:
            self.peak_active = self.active
        path = req.path
        if self.record:
            self.hits[path] += 1
            self.raw_paths.append(req.target)
            self.headers_seen.append(seen if seen is not None else dict(req.headers))
        if req.method not in ("GET", "HEAD"):
            return Reply(405, [("Allow", "GET, HEAD")], b"GET and HEAD only")
        if self.throttle_rate is not None:
            if not self.take_token(path.rpartition("/")[0], time.monotonic()):
                self.throttled += 1
                return self._throttle_reply()  # at once, as S3 does: it costs little
        delay = self.latency
        if self.jitter:
            delay += self._rng.uniform(0.0, self.jitter)
        if self.generated and path.startswith("obj/"):
            try:
                delay += latency_seconds(path.split("/")[2], self._rng)
            except (IndexError, ValueError):
                return Reply(400, body=b"expected /obj/{size}/{latency_ms}/{index}")
        return delay

    def _throttle_reply(self) -> Reply:
        headers = []
        if self.throttle_retry_after is not None:
            headers.append(("Retry-After", f"{self.throttle_retry_after:g}"))
        if self.throttle_status == 503:
            return Reply(503, headers, S3_SLOWDOWN.encode(), XML)
        return Reply(self.throttle_status, headers, b"too many requests")

    def line(self, req: Ticket, then: Callable[[Ticket], None]) -> None:
        """Call ``then(req)`` once the prefix's line has served *req* (at once without one)."""
        if self.queue_slots is None:
            then(req)
            return
        prefix = req.path.rpartition("/")[0]
        line = self._lines.get(prefix)
        if line is None:
            line = self._lines[prefix] = _Line(self.queue_slots, self.queue_service)
        line.enter(req, then)

    def hold(self, req: Ticket) -> float:
        """Seconds more to hold *req*: the next of its path's :meth:`delay` values, or 0."""
        held = self.delays.get(req.path)
        return held.popleft() if held else 0.0

    def respond(self, req: Ticket) -> Reply:
        """The reply to *req*, taking its path's next fault (one per request)."""
        queue = self.faults.get(req.path)
        fault = queue.popleft() if queue else None
        if fault is not None:
            if fault.isdigit():
                return Reply(int(fault), body=f"injected {fault}".encode())
            if fault.startswith("redirect:"):
                return Reply(302, [("Location", fault.split(":", 1)[1])], b"302: Found")
            if fault == "s3-403":
                return Reply(403, body=S3_SIGNATURE_ERROR.encode(), content_type=XML)
            if fault.startswith("retry-after:"):
                return Reply(503, [("Retry-After", fault.split(":", 1)[1])], b"slow down")
        found = self.find(req.path)
        if found is None:
            return Reply(404, body=b"no such object")
        data, etag = found
        size = len(data)
        reply = Reply(200, [("Accept-Ranges", "bytes"), ("ETag", etag)], data, OCTETS)
        headers = req.headers
        rng = headers.get("range") if self.ranges else None
        if self.conditionals:
            if headers.get("if-match", etag) != etag:
                return Reply(412, body=b"precondition failed")
            if headers.get("if-range", etag) != etag:
                rng = None  # a different version: the whole new one, as RFC 9110 says
        if rng:
            try:
                span = parse_range(rng, size)
            except ValueError:
                pass  # served whole
            else:
                if span is None:
                    return Reply(416, [("Content-Range", f"bytes */{size}")])
                start, end = span
                reply.status, reply.body = 206, data[start:end]
                if fault != "no-content-range":
                    reply.headers.append(("Content-Range", f"bytes {start}-{end - 1}/{size}"))
        if fault is not None and req.method != "HEAD" and fault.startswith(_SENT_WRONG):
            reply.fault = fault
        return reply

    def replace(self, req: Ticket) -> None:
        """Act out ``short-replace`` once half the body is out: the object gets a new version."""
        objects = self.objects
        assert isinstance(objects, MutableMapping)
        objects[req.path] = self.replacements.pop(req.path)

    def end(self, req: Ticket) -> None:
        """*req* was answered (or its fault acted out); no-op when already ended."""
        if req.done:
            return
        req.done = True
        self.active -= 1
        self.finished += 1

    def cancel(self, req: Ticket) -> None:
        """*req*'s client went away before it was answered; no-op when already ended."""
        if not req.done:
            self.cancelled += 1
            self.end(req)
