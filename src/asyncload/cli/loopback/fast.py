"""The benchmarks' front end: HTTP/1.1 written by hand on asyncio's ``Protocol``.

Only the benchmark children use it (``ServerProcess(fast=True)``); the tests, ``asyncload
serve`` and the demo speak HTTP through aiohttp.web (``web.py``). A benchmark measures its
clients, and on a 2-core machine every microsecond the stand-in for remote storage spends is
taken from them: aiohttp.web used ~125 µs of server CPU per 100 KB response, this ~35 µs
(~25 µs under uvloop). What is served is decided by the store (``store.py``); this module
parses requests, waits on timers rather than tasks, and writes the replies: bodies are
memoryviews, not copies; pipelined requests are answered in order; keep-alive by default.
"""

from __future__ import annotations

import asyncio
import collections
import http
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from .messages import Reply, Ticket
from .store import Store

__all__ = ["start"]

_Out = list[bytes | memoryview]
_PHRASES = {s.value: s.phrase for s in http.HTTPStatus}


def _head(reply: Reply) -> bytes:
    lines = [f"HTTP/1.1 {reply.status} {_PHRASES[reply.status]}"]
    lines += [f"{name}: {value}" for name, value in reply.headers]
    lines.append(f"Content-Type: {reply.content_type}")
    lines.append(f"Content-Length: {len(reply.body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class _Request(Ticket):
    __slots__ = ("handle", "slot")

    def __init__(self, slot: int, method: str, target: str, headers: dict[str, str]) -> None:
        super().__init__(method, target, headers)
        self.slot = slot  # its place among the connection's replies
        self.handle: asyncio.TimerHandle | asyncio.Task[None] | None = None


@dataclass
class _Stream:
    """A reply written over time (a fault), started once the replies before it are out."""

    req: _Request
    reply: Reply


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
        self._replies: collections.deque[_Out | _Stream | None] = collections.deque()
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
            self._store.cancel(req)
        self._open.clear()

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
                self._ready(self._sent + len(self._replies) - 1, Reply(400, body=b"bad request"))
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
        seen: dict[str, str] | None = {} if store.record else None
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name, value = name.strip(), value.strip()
            headers[name.lower()] = value
            if seen is not None:
                seen[name] = value
        if headers.get("connection", "").lower() == "close" or version == "HTTP/1.0":
            self._close_after = True
        slot = self._sent + len(self._replies)
        self._replies.append(None)
        if "transfer-encoding" in headers:  # no request here has a body worth a parser
            self._close_after = True
            self._ready(slot, Reply(400, body=b"chunked request bodies are not read"))
            return
        try:
            self._skip = int(headers.get("content-length", 0))
        except ValueError:
            self._close_after = True
            self._ready(slot, Reply(400, body=b"bad Content-Length"))
            return
        counter = store.answer_control(target)
        if counter is not None:
            self._ready(slot, counter)
            return
        req = _Request(slot, method, target, headers)
        self._open[slot] = req
        admitted = store.admit(req, seen)
        if isinstance(admitted, Reply):
            self._finish(req, admitted)
        elif admitted > 0:
            req.handle = self._loop.call_later(admitted, store.line, req, self._held)
        else:
            store.line(req, self._held)

    def _held(self, req: Ticket) -> None:
        assert isinstance(req, _Request)
        held = self._store.hold(req)
        if held > 0:
            req.handle = self._loop.call_later(held, self._serve, req)
        else:
            self._serve(req)

    def _serve(self, req: _Request) -> None:
        req.handle = None
        reply = self._store.respond(req)
        if reply.fault is None:
            self._finish(req, reply)
            return
        self._replies[req.slot - self._sent] = _Stream(req, reply)
        self._flush()

    def _end(self, req: _Request) -> None:
        self._open.pop(req.slot, None)
        self._store.end(req)

    def _finish(self, req: _Request, reply: Reply) -> None:
        self._end(req)
        self._ready(req.slot, reply, head_only=req.method == "HEAD")

    def _ready(self, slot: int, reply: Reply, *, head_only: bool = False) -> None:
        if self._transport is None:
            return
        head = _head(reply)
        self._replies[slot - self._sent] = [head] if head_only else [head, reply.body]
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
        req, reply = out.req, out.reply
        fault, body = reply.fault or "", reply.body
        transport.write(_head(reply))
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
            self._store.replace(req)
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


async def start(
    store: Store, *, backlog: int, ssl_context: ssl.SSLContext | None = None
) -> Callable[[], Awaitable[None]]:
    """Listen on ``store.host:store.port`` (``store.port`` becomes the bound port).

    Args:
        store: What to serve.
        backlog: The listen backlog.
        ssl_context: Serve HTTPS with it (``store.scheme`` becomes ``"https"``).

    Returns:
        A coroutine function that stops serving and closes every connection.

    Raises:
        OSError: The address cannot be bound.
    """
    conns: set[_Connection] = set()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: _Connection(store, conns), store.host, store.port, backlog=backlog, ssl=ssl_context
    )
    store.port = server.sockets[0].getsockname()[1]
    if ssl_context is not None:
        store.scheme = "https"

    async def stop() -> None:
        server.close()
        for conn in list(conns):
            conn.abort()
        for _ in range(3):  # connection_lost, then the stream tasks it cancelled, finish
            await asyncio.sleep(0)
        await server.wait_closed()

    return stop
