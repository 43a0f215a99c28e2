"""The loopback store behind aiohttp.web: the tests', ``asyncload serve``'s and the demo's.

A real HTTP server library, as the tests' servers are meant to be: the store (``store.py``)
decides every reply, and the handler only waits and writes, acting the store's faults out with
aiohttp's own means (a ``StreamResponse`` cut short, trickled or stalled; the transport closed
or aborted). The benchmark children use ``fast.py`` instead, for its lower CPU per response.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable

from aiohttp import web

from .messages import Reply, Ticket
from .store import Store

__all__ = ["STORE", "make_app", "start"]

STORE = web.AppKey("store", Store)


def _response(reply: Reply) -> web.Response:
    # Content-Type as a header, not content_type=: aiohttp refuses a charset in the latter.
    # For HEAD aiohttp sends the body's Content-Length without the body.
    headers = dict(reply.headers)
    headers["Content-Type"] = reply.content_type
    return web.Response(status=reply.status, headers=headers, body=reply.body)


async def _act_out(
    request: web.Request, store: Store, req: Ticket, reply: Reply
) -> web.StreamResponse:
    fault, body = reply.fault or "", reply.body
    resp = web.StreamResponse(status=reply.status, headers=dict(reply.headers))
    resp.content_type = reply.content_type
    resp.content_length = len(body)
    await resp.prepare(request)
    if fault.startswith(("trickle:", "stall:")):
        seconds = float(fault.split(":", 1)[1])
        if fault.startswith("trickle:"):
            step = max(1, -(-len(body) // 25))
            for at in range(0, len(body), step):
                await asyncio.sleep(seconds / 25)
                await resp.write(body[at : at + step])
        else:
            await asyncio.sleep(seconds)
            await resp.write(body)
        store.end(req)
        await resp.write_eof()
        return resp
    await resp.write(body[: len(body) // 2])
    if fault == "short-replace":
        store.replace(req)
    # Ended before the connection goes: a fault that was served, not a client that left.
    store.end(req)
    transport = request.transport
    if transport is not None:
        if fault == "reset":
            transport.abort()
        else:
            transport.close()
    return resp


async def _handle(request: web.Request) -> web.StreamResponse:
    store = request.app[STORE]
    target = request.raw_path
    counter = store.answer_control(target)
    if counter is not None:
        return _response(counter)
    # aiohttp's headers are case-insensitive: the store's lower-case lookups find them.
    req = Ticket(request.method, target, request.headers)
    admitted = store.admit(req, dict(request.headers) if store.record else None)
    if isinstance(admitted, Reply):
        store.end(req)
        return _response(admitted)
    try:
        if admitted > 0:
            await asyncio.sleep(admitted)
        if store.queue_slots is not None:
            served: asyncio.Future[None] = asyncio.get_running_loop().create_future()

            def enter(_: Ticket) -> None:
                if not served.done():
                    served.set_result(None)

            store.line(req, enter)
            await served
        held = store.hold(req)
        if held > 0:
            await asyncio.sleep(held)
        reply = store.respond(req)
        if reply.fault is None:
            store.end(req)
            return _response(reply)
        return await _act_out(request, store, req, reply)
    except asyncio.CancelledError:
        # handler_cancellation: the client closed the connection before it was answered.
        store.cancel(req)
        raise


def make_app(store: Store) -> web.Application:
    """An application answering every method and path from *store*."""
    app = web.Application()
    app[STORE] = store
    app.router.add_route("*", "/{path:.*}", _handle)
    return app


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
    # handler_cancellation: a stalled handler learns that its client left (Store.cancelled).
    # A short shutdown_timeout: stopping does not wait for stalled handlers, it cancels them.
    runner = web.AppRunner(
        make_app(store), access_log=None, handler_cancellation=True, shutdown_timeout=0.1
    )
    await runner.setup()
    site = web.TCPSite(runner, store.host, store.port, backlog=backlog, ssl_context=ssl_context)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    store.port = runner.addresses[0][1]
    if ssl_context is not None:
        store.scheme = "https"
    return runner.cleanup
