"""Running the loopback store: in a thread of this process, in a child process, or until Ctrl-C.

* :class:`ServerThread`: a thread with its own event loop; the caller reads and changes the
  :class:`Store` directly (the tests, over aiohttp.web).
* :class:`ServerProcess`: ``_child.py`` run as a script in a child process, which prints
  ``PORT <n>`` and serves until its stdin closes, so it also goes away when the parent dies
  (the benchmarks, with ``fast=True``; the demo, over aiohttp.web). Its CPU time is then not
  mixed into the measured client's, and it starts in a fraction of a second: it imports this
  package without ``asyncload`` (and torch) behind it.
* :func:`serve`: in the caller's event loop until cancelled (``asyncload serve``).

Each takes a front end: aiohttp.web (``web.py``) unless ``fast`` asks for the hand-written one
of the benchmarks (``fast.py``). Either is imported only when used: a fast child never imports
aiohttp.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import ssl
import subprocess
import sys
import threading
import warnings
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, TypeVar

from .generated import object_view
from .store import Store

__all__ = [
    "ServerProcess",
    "ServerThread",
    "build_parser",
    "run_child",
    "serve",
    "store_from_args",
]

_CHILD = Path(__file__).resolve().parent / "_child.py"


class _Start(Protocol):
    def __call__(
        self, store: Store, *, backlog: int, ssl_context: ssl.SSLContext | None = None
    ) -> Awaitable[Callable[[], Awaitable[None]]]: ...


def _front_end(fast: bool) -> _Start:
    if fast:
        from .fast import start
    else:
        from .web import start  # aiohttp: imported only by those that serve through it
    return start


async def serve(
    store: Store,
    *,
    fast: bool = False,
    backlog: int = 4096,
    announce: Callable[[Store], None] | None = None,
    until_stdin_closes: bool = False,
) -> None:
    """Serve *store* on ``store.host:store.port`` until cancelled (or stdin closes).

    Args:
        store: What to serve; its ``port`` becomes the bound one (0: an ephemeral port).
        fast: Over the benchmarks' hand-written HTTP front end rather than aiohttp.web.
        backlog: The listen backlog: large, so a burst of connections from many workers is
            not dropped (``python -m http.server`` has 5).
        announce: Called once the server accepts connections.
        until_stdin_closes: Also stop at end of file on stdin: a parent holds it open, so the
            server never outlives it.

    Raises:
        OSError: The address cannot be bound.
    """
    stop_serving = await _front_end(fast)(store, backlog=backlog)
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
        await stop_serving()


def run_child(store: Store, *, fast: bool = False) -> None:
    """Serve *store* as a child process does: print ``PORT <n>``, stop when stdin closes.

    Args:
        store: What to serve.
        fast: Over the benchmarks' hand-written HTTP front end (``fast.py``).
    """
    if store.generated:
        object_view(0, 1)  # build the pool before announcing the port: no first-request stall
    main = serve(
        store,
        fast=fast,
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
        self,
        store: Store | None = None,
        *,
        ssl_context: ssl.SSLContext | None = None,
        fast: bool = False,
    ) -> None:
        """Args:
        store: What to serve (a new, empty :class:`Store` when ``None``).
        ssl_context: Serve HTTPS with it (``store.scheme`` becomes ``"https"``).
        fast: Over the benchmarks' hand-written HTTP front end rather than aiohttp.web.
        """
        self.store = store if store is not None else Store()
        self.ssl_context = ssl_context
        self.fast = fast
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
        start = _front_end(self.fast)
        try:
            stop = loop.run_until_complete(
                start(self.store, backlog=1024, ssl_context=self.ssl_context)
            )
        except BaseException as exc:
            failed.append(exc)
            ready.set()
            return
        ready.set()
        loop.run_forever()
        loop.run_until_complete(stop())
        # Whatever the front end left running (a stalled reply) ends with the loop.
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))

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
    """``_child.py`` (or another script that calls :func:`run_child`) run in a child process.

    Use as a context manager; the child exits when the context closes or when this process
    dies (it watches its stdin).
    """

    start_timeout = 30.0
    """Seconds the child may take to print its port (a script that imports more, longer)."""

    def __init__(
        self, args: Sequence[str] = (), *, host: str = "127.0.0.1", fast: bool = False
    ) -> None:
        """Args:
        args: The script's options (see :func:`build_parser`), ``--host`` and ``--fast`` aside.
        host: The address to listen on.
        fast: Serve over the benchmarks' hand-written HTTP front end (adds ``--fast``).
        """
        self.host = host
        self.port = 0
        self._args = [*args, "--fast"] if fast else list(args)
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
        return [sys.executable, str(_CHILD), "--host", self.host, *self._args]

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


def build_parser() -> argparse.ArgumentParser:
    """The script's options; a benchmark that serves more adds its own to it."""
    parser = argparse.ArgumentParser(description="The loopback object store, in a child process.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument(
        "--fast", action="store_true", help="the benchmarks' hand-written HTTP, not aiohttp.web"
    )
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
