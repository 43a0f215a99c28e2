"""multiprocessing's forkserver, forked from the loader's process rather than started afresh.

multiprocessing starts its forkserver as a new interpreter, which imports torch and the script
(``__main__``) before it can fork a single worker: 1-1.5 s with a CPU build of torch, 3-5 s with
a CUDA build (measured on an H100 machine, where ``import torch`` alone took 3.3-4.7 s). A loader
built 2 s before ``iter()`` then waits for the rest, once per process.

When a loader is built with the default start method and forking this process is safe
(``_guards.fork_unsafe_reason``: CUDA not initialised, obstore unused, no other thread of
Python's), asyncload forks the server from this process instead: it already holds torch and
everything else imported, and serves within milliseconds. It is still multiprocessing's
forkserver (its protocol, its singleton, its ``main``), so workers start from it as forkserver
workers do: from a process that never ran CUDA, threads or an async runtime, whatever this
process does after the loader is built.

What differs from a server started afresh, and how it is handled:

* it holds this process's memory as it was at the fork, copy-on-write. ``gc.freeze()`` keeps
  the collector of the server and of its workers off those objects, so their pages stay shared;
* ``__main__`` is this process's module, not imported again: workers see the script's globals as
  they were when the loader was built. What only the guarded part of the script defines is still
  refused up front (``_guards``), as for a fresh server: a script that works with one works with
  the other;
* it inherits this process's open descriptors, as any forked child does. It closes the ends of
  its own pipes that only this process must hold: the write end of the "alive" pipe (whose EOF
  tells the server that this process is gone; held open, the server would outlive it) and of
  Python 3.14's authkey pipe;
* handlers the script installed for signals (a SIGTERM handler that saves a checkpoint, say) are
  reset to the defaults, so a signal sent to the process group doesn't run them in the server.

Only for the default start method: ``multiprocessing_context="forkserver"`` asks for Python's own
server, and gets it. Linux only (``fork`` is unsafe on macOS, where ``spawn`` is the default).

    DataLoader() ──► fork_unsafe_reason() is None? ──no──► a fresh server, in the background
                           │ yes                            (``_context.start_early``)
                           ▼
                     ensure_running(), whose spawnv_passfds forks instead of exec'ing:
                       child: close the pipes' other ends, reset handlers, gc.freeze(),
                              run forkserver.main (the same code a fresh server runs)
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import stat
import sys
import traceback
import warnings
from collections.abc import Sequence
from multiprocessing import forkserver, util
from typing import Any

from . import _guards

__all__ = ["fork_server", "server_pid"]

_SERVER_MAIN = "from multiprocessing.forkserver import main"


def server_pid() -> int | None:
    """The pid of this process's forkserver, if it started one."""
    pid: int | None = getattr(forkserver._forkserver, "_forkserver_pid", None)
    return pid


def fork_server() -> bool:
    """Start the forkserver by forking this process, when that is safe and none runs yet.

    Returns whether it did; when not, the caller starts a fresh one (or ``iter()`` does).
    Blocks for the fork only (a few milliseconds: the page tables are copied).
    """
    if sys.platform != "linux" or not hasattr(os, "fork") or server_pid() is not None:
        return False
    if _guards.fork_unsafe_reason() is not None:
        return False
    original = util.spawnv_passfds

    def spawn(path: bytes, args: Sequence[Any], passfds: Sequence[int]) -> int:
        # [python, *flags, "-c", command, *argv]: newer Pythons pass the script's arguments on.
        words = [str(a) for a in args]
        at = words.index("-c") + 1 if "-c" in words else len(words)
        if at >= len(words) or _SERVER_MAIN not in words[at]:  # the resource tracker: as usual
            return original(path, args, passfds)
        return _fork(words[at], words[at + 1 :], passfds)

    util.spawnv_passfds = spawn  # no other Python thread runs (checked above)
    try:
        forkserver.ensure_running()
    except Exception:  # a fresh server is started instead, and reports what fails
        return False
    finally:
        util.spawnv_passfds = original
    return True


def _fork(command: str, argv: list[str], passfds: Sequence[int]) -> int:
    """Fork a process that runs *command* (``forkserver.main(...)``) as ``python -c command
    *argv`` would, with *passfds*; its pid."""
    ends = _pipe_ids(passfds)
    for stream in (sys.stdout, sys.stderr):  # else the server could write out this process's
        if stream is not None:  # buffered output a second time
            with contextlib.suppress(Exception):
                stream.flush()
    with warnings.catch_warnings():
        # Python 3.12+ warns when other OS threads exist (BLAS pools, say); fork_unsafe_reason
        # has vetted those that could hang a child, as for torch's own fork workers.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid:
        return pid
    status = 1
    try:
        _become_server(set(passfds), ends)
        sys.argv = ["-c", *argv]
        exec(command, {"__name__": "__asyncload_forkserver__"})
        status = 0
    except SystemExit as stop:  # forkserver.main's way out: this process has gone
        status = stop.code if isinstance(stop.code, int) else 0
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(status)  # never back into the caller's frames, atexit or finalizers


def _pipe_ids(fds: Sequence[int]) -> set[tuple[int, int]]:
    ids = set()
    for fd in fds:
        st = os.fstat(fd)
        if stat.S_ISFIFO(st.st_mode):
            ids.add((st.st_dev, st.st_ino))
    return ids


def _become_server(keep: set[int], pipes: set[tuple[int, int]]) -> None:
    """In the forked child: what a freshly started server would not have, taken away."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd in keep:
            continue
        try:
            st = os.fstat(fd)
        except OSError:  # the descriptor listdir itself used
            continue
        if stat.S_ISFIFO(st.st_mode) and (st.st_dev, st.st_ino) in pipes:
            os.close(fd)  # the other end of a pipe passed to the server
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
            if sig == signal.SIGINT and handler is not signal.SIG_IGN:
                signal.signal(sig, signal.default_int_handler)  # a fresh interpreter's
            elif callable(handler) and sig != signal.SIGINT:
                signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):  # SIGKILL and the like
            continue
    signal.set_wakeup_fd(-1)  # an event loop's, if the loader was built inside one
    gc.freeze()
