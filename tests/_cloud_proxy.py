"""A loopback reverse proxy in front of a storage emulator that injects faults on demand.

Emulators answer correctly and nothing else; this proxy, an aiohttp server in a thread of the
test process, forwards every request to the emulator unchanged (signed requests stay valid: the
path and signed headers are kept) and, for a path with queued faults, answers the next requests
with them instead:

    "503", "500", "429", "403": that status, with a small XML error body
    "cut": the emulator's real headers and half its body, then the connection is closed

With ``page_size`` set, listings come in pages of that many keys, as from the real clouds at
1,000 (GCS) or 5,000 (Azure) keys: Azure list requests get a ``maxresults`` (Azurite pages
itself), and GCS XML listings, which fake-gcs-server returns whole, are cut into pages here,
with continuation tokens.

``hits`` counts requests per path and ``requests`` keeps each request's method, path, query and
headers, so a test can see exactly what the client sent (a page token, an If-Match).
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from xml.etree import ElementTree

import aiohttp
from aiohttp import web

_HOP = frozenset(("connection", "keep-alive", "transfer-encoding", "host", "content-length"))
_CODES = {"503": "ServerBusy", "500": "InternalError", "429": "TooManyRequests", "403": "Denied"}


@dataclass
class CloudProxy:
    """State shared between a test and the proxy's handler."""

    upstream: str
    host: str = "127.0.0.1"
    port: int = 0
    faults: dict[str, collections.deque[str]] = field(default_factory=dict)
    hits: collections.Counter[str] = field(default_factory=collections.Counter)
    requests: list[tuple[str, str, str, dict[str, str]]] = field(default_factory=list)
    page_size: int | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def fail(self, path: str, *faults: str) -> None:
        """Answer the next requests to *path* (as the emulator sees it) with *faults*."""
        self.faults.setdefault("/" + path.lstrip("/"), collections.deque()).extend(faults)

    def reset(self) -> None:
        self.faults.clear()
        self.hits.clear()
        self.requests.clear()
        self.page_size = None


def _gcs_page(body: bytes, token: str | None, size: int) -> bytes:
    """One page of a whole ListObjectsV2-style listing, from key *token* on."""
    root = ElementTree.fromstring(body)
    entries = root.findall("Contents")
    start = int(token or 0)
    for entry in entries[:start] + entries[start + size :]:
        root.remove(entry)
    for name in ("KeyCount", "IsTruncated", "NextContinuationToken"):
        for old in root.findall(name):
            root.remove(old)
    ElementTree.SubElement(root, "KeyCount").text = str(len(entries[start : start + size]))
    more = start + size < len(entries)
    ElementTree.SubElement(root, "IsTruncated").text = "true" if more else "false"
    if more:
        ElementTree.SubElement(root, "NextContinuationToken").text = str(start + size)
    return ElementTree.tostring(root, xml_declaration=True, encoding="UTF-8")


def _app(state: CloudProxy) -> web.Application:
    session: list[aiohttp.ClientSession] = []

    async def forward(request: web.Request) -> web.StreamResponse:
        path = request.path
        state.hits[path] += 1
        state.requests.append((request.method, path, request.query_string, dict(request.headers)))
        queue = state.faults.get(path)
        fault = queue.popleft() if queue else None
        if fault is not None and fault.isdigit():
            code = _CODES.get(fault, "Injected")
            body = f'<?xml version="1.0"?><Error><Code>{code}</Code><Message>injected {fault}'
            return web.Response(status=int(fault), text=body + "</Message></Error>")
        if not session:
            session.append(aiohttp.ClientSession(auto_decompress=False))
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        query = request.rel_url.query.copy()
        gcs_list = state.page_size and request.method == "GET" and "list-type" in query
        token = query.pop("continuation-token", None) if gcs_list else None
        if state.page_size and query.get("comp") == "list" and "maxresults" not in query:
            # A Shared Key signature covers the query: page unsigned (anonymous) listings only.
            query["maxresults"] = str(state.page_size)
        async with session[0].request(
            request.method,
            state.upstream + str(request.rel_url.with_query(query)),
            headers=headers,
            # No body, no Content-Type: aiohttp would add one, and it is part of a signature.
            data=await request.read() or None,
            skip_auto_headers=("Content-Type", "Accept-Encoding", "User-Agent", "Accept"),
            allow_redirects=False,
        ) as up:
            body = await up.read()
            if gcs_list and up.status == 200 and state.page_size:
                body = _gcs_page(body, token, state.page_size)
            out = {k: v for k, v in up.headers.items() if k.lower() not in _HOP}
            if request.method == "HEAD":
                length = up.headers.get("Content-Length")
                if length is not None:
                    out["Content-Length"] = length
                return web.Response(status=up.status, headers=out)
        if fault == "cut" and len(body) > 1:
            resp = web.StreamResponse(status=up.status, headers=out)
            resp.content_length = len(body)
            await resp.prepare(request)
            await resp.write(body[: len(body) // 2])
            if request.transport is not None:
                request.transport.close()
            return resp
        return web.Response(status=up.status, headers=out, body=body)

    async def close(_: web.Application) -> None:
        for s in session:
            await s.close()

    app = web.Application(client_max_size=1 << 30)
    app.router.add_route("*", "/{path:.*}", forward)
    app.on_cleanup.append(close)
    return app


def proxy_context(upstream: str) -> Iterator[CloudProxy]:
    """Run a proxy to *upstream* (``http://host:port``) on an ephemeral loopback port."""
    state = CloudProxy(upstream=upstream.rstrip("/"))
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    stopping: list[asyncio.Event] = []

    async def main() -> None:
        runner = web.AppRunner(_app(state), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, state.host, 0)
        await site.start()
        server: Any = site._server
        state.port = server.sockets[0].getsockname()[1]
        stopping.append(asyncio.Event())
        ready.set()
        await stopping[0].wait()
        await runner.cleanup()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    if not ready.wait(10):
        raise RuntimeError("the fault proxy did not start")
    try:
        yield state
    finally:
        loop.call_soon_threadsafe(stopping[0].set)
        thread.join(10)
        loop.close()
