"""Coroutines from synchronous code: the one bridge, in two forms.

``run_sync`` (``asyncload.read_sync``, datasets under a plain DataLoader) runs every call on one
long-lived private event loop in a daemon thread of the calling process, so it works whether or
not the caller's thread runs a loop of its own (Jupyter's, for example, where ``asyncio.run``
refuses), and the HTTP session of that loop keeps its connections alive from one call to the
next. A forked child (a torch worker started with ``fork``) finds the parent's loop without its
thread and starts its own.

``run_detached`` (``asyncload.list_files``, the CLI's one-off reads) runs one call on a new loop
in a short-lived thread and leaves nothing behind: what a program calls once before it builds
its loaders and starts (perhaps forks) their workers.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import threading
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

from .._exceptions import LoadError

__all__ = ["on_close", "run_detached", "run_sync"]

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None
_pid = 0


def _get_loop() -> asyncio.AbstractEventLoop:
    global _loop, _thread, _pid
    with _lock:
        if _loop is None or _pid != os.getpid() or _thread is None or not _thread.is_alive():
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="asyncload-sync", daemon=True)
            thread.start()
            _loop, _thread, _pid = loop, thread, os.getpid()
        return _loop


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run *coro* on the private loop and return its result (or raise its error) here."""
    if threading.current_thread() is _thread and _pid == os.getpid():
        coro.close()
        raise RuntimeError("asyncload: a synchronous read from a coroutine of its own loop")
    future: Future[T] = asyncio.run_coroutine_threadsafe(coro, _get_loop())
    try:
        return future.result()
    except LoadError as exc:
        raise exc.with_traceback(None) from exc.__cause__  # the frames of the loop add nothing
    except BaseException:
        future.cancel()  # e.g. Ctrl-C while waiting: do not leave the read running
        raise


def run_detached(make: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run ``make()`` on a new event loop in a new thread, wait for it, and return its result
    (or raise its error) here. The loop and the thread are gone when this returns; the
    coroutine must close what it opened on that loop (its storage sessions)."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(asyncio.run(make()))
        except BaseException as exc:  # handed to the caller's thread
            outcome.append(exc)

    thread = threading.Thread(target=run, name="asyncload-detached", daemon=True)
    thread.start()
    thread.join()
    result = outcome[0]
    if isinstance(result, BaseException):
        if isinstance(result, LoadError):
            raise result.with_traceback(None) from result.__cause__
        raise result
    return result  # type: ignore[no-any-return]


_closers: list[Callable[[], Awaitable[None]]] = []


def on_close(closer: Callable[[], Awaitable[None]]) -> None:
    """Run *closer* on the private loop at interpreter exit (the storage layer closes its
    sessions there), so this module needs to know nothing about what runs on its loop."""
    _closers.append(closer)


async def _close() -> None:
    for closer in _closers:
        await closer()


@atexit.register
def _shutdown() -> None:
    # Close the loop's sessions while the interpreter can still run them (no "unclosed" noise).
    loop = _loop
    if loop is None or _pid != os.getpid() or _thread is None or not _thread.is_alive():
        return
    try:
        asyncio.run_coroutine_threadsafe(_close(), loop).result(timeout=5)
    except Exception:  # best effort at exit
        pass
    loop.call_soon_threadsafe(loop.stop)
    _thread.join(timeout=5)
