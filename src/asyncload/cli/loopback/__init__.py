"""One loopback object store for the tests, the benchmarks, ``asyncload demo`` and ``serve``.

A :class:`Store` holds what is served and how: objects from a mapping (``/<path>``) or generated
from the path (``/obj/{size}/{latency}/{index}``, see :func:`object_view`), a latency per request
(fixed, with jitter, or drawn from a tail distribution named in the path), ``Range`` and
``HEAD``, conditionals, faults queued per path (:data:`FAULTS`), and two ways to push back per
prefix (a path's directory): a token bucket answering ``503 SlowDown`` or ``429`` and a queue of
a few slots in front of the store. It counts what it did (requests, hits, throttles, requests in
flight and their peak, cancellations).

The package, one concept a module:

* ``store.py``: :class:`Store` and every decision about a request (which reply, which fault);
  ``messages.py``: the request and reply it decides on; ``generated.py``: generated objects.
* ``web.py``: the HTTP front end on aiohttp.web (the tests, ``asyncload serve``, the demo).
* ``fast.py``: a hand-written HTTP/1.1 front end on asyncio's ``Protocol``, for benchmark
  children only, where the server's CPU per response is taken from the measured client's.
* ``run.py``: :class:`ServerThread`, :class:`ServerProcess`, :func:`serve`, the child's options.
* ``_child.py``: the script a :class:`ServerProcess` runs, importing this package without
  ``asyncload`` (and torch) behind it.
"""

from __future__ import annotations

from .generated import latency_seconds, object_bytes, object_view
from .messages import S3_SIGNATURE_ERROR, S3_SLOWDOWN, Reply, Ticket, parse_range
from .run import ServerProcess, ServerThread, build_parser, run_child, serve, store_from_args
from .store import FAULTS, Store

__all__ = [
    "FAULTS",
    "S3_SIGNATURE_ERROR",
    "S3_SLOWDOWN",
    "Reply",
    "ServerProcess",
    "ServerThread",
    "Store",
    "Ticket",
    "build_parser",
    "latency_seconds",
    "object_bytes",
    "object_view",
    "parse_range",
    "run_child",
    "serve",
    "store_from_args",
]
