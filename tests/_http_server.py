"""The loopback object store (``asyncload.cli.loopback``) served from a thread, for tests.

A real aiohttp.web server on 127.0.0.1 (``loopback/web.py``) in a thread with its own event
loop. What it answers (latency, faults, throttles, queues, counters) is decided by the store,
``src/asyncload/cli/loopback/store.py``, shared with the benchmarks and ``asyncload demo``; this
module keeps the names the tests use. ``ObjectServer`` is the state shared between a test and the
server's handlers; see ``loopback.FAULTS`` for what ``fail()`` can queue.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterator

from asyncload.cli.loopback import FAULTS, S3_SIGNATURE_ERROR, S3_SLOWDOWN, ServerThread
from asyncload.cli.loopback import Store as ObjectServer

__all__ = [
    "FAULTS",
    "S3_SIGNATURE_ERROR",
    "S3_SLOWDOWN",
    "ObjectServer",
    "ServerThread",
    "http_server_context",
    "serve_in_thread",
    "stop",
]


def serve_in_thread(
    state: ObjectServer | None = None, ssl_context: ssl.SSLContext | None = None
) -> ServerThread:
    """Start the server on an ephemeral loopback port; returns once it accepts connections.

    With *ssl_context* it serves HTTPS (``state.scheme`` becomes ``"https"``).
    """
    return ServerThread(state, ssl_context=ssl_context).start()


def stop(running: ServerThread) -> None:
    running.stop()


def http_server_context() -> Iterator[ObjectServer]:
    with ServerThread() as running:
        yield running.store
