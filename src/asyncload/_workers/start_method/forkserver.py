"""multiprocessing's forkserver, forked from the loader's process rather than started afresh.

multiprocessing starts its forkserver as a new interpreter, which imports torch and the script
(``__main__``) before it can fork a single worker: 1-1.5 s with a CPU build of torch, 3-5 s with
a CUDA build (measured on an H100 machine, where ``import torch`` alone took 3.3-4.7 s). A loader
built 2 s before ``iter()`` then waits for the rest, once per process.

When a loader is built with the default start method and forking this process is safe
(``unsafe_reason``: CUDA not initialised, obstore unused, no other Python thread, no thread
started since asyncload was imported), asyncload forks the server from this process instead:
it already holds torch and everything else imported, and serves within milliseconds. It is
still multiprocessing's forkserver (its protocol, its singleton, its ``main``), so workers start
from it as forkserver workers do: from a process that never ran CUDA, threads or an async
runtime, whatever this process does after the loader is built.

What differs from a server started afresh, and how it is handled:

* it holds this process's memory as it was at the fork, copy-on-write. ``gc.freeze()`` keeps
  the collector of the server and of its workers off those objects, so their pages stay shared;
* ``__main__`` is this process's module, not imported again: workers see the script's globals as
  they were when the loader was built (its ``__file__`` normalised as multiprocessing compares
  it, else every worker would run ``python ./train.py`` again). What only the guarded part of
  the script defines is still refused up front (``start_method.guards``), as for a fresh server: a
  script that works with one works with the other;
* it keeps this process's open files, as any forked child does, but each pipe and socket becomes
  one whose peer is gone (EOF to reads, EPIPE to writes): held there, they would keep their
  peers from seeing EOF (a subprocess's stdin; the "alive" pipe, whose EOF tells the server
  this process has gone);
* multiprocessing's state is as in a process of its own: the forkserver's lock (held by
  ``ensure_running`` during the fork) free, ``spawnv_passfds`` its own;
* handlers the script installed for signals (a SIGTERM handler that saves a checkpoint, say) are
  reset to the defaults, so a signal sent to the process group doesn't run them in the server.

It is the process's one forkserver: later loaders, also those naming ``"forkserver"``, use it.
A first loader naming ``"forkserver"`` gets a fresh one. Linux only (``fork`` is unsafe on
macOS, where ``spawn`` is the default).

    DataLoader() ──► unsafe_reason() is None? ──no──────► a fresh server, in the background
                           │ yes                            (``_context.start_early``)
                           ▼
                     ensure_running(), whose spawnv_passfds forks instead of exec'ing:
                       child: pipes and sockets cut off, handlers reset, gc.freeze(),
                              run forkserver.main (the same code a fresh server runs)
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import socket
import stat
import sys
import threading
import traceback
import warnings
from collections.abc import Sequence
from multiprocessing import forkserver, resource_tracker, spawn, util
from typing import Any

import numpy  # noqa: F401  (its BLAS pool starts when imported: part of the baseline below)
import torch  # noqa: F401  (likewise, whatever it starts when imported)

from . import guards as _guards

__all__ = ["fork_server", "server_pid"]

_SERVER_MAIN = "from multiprocessing.forkserver import main"
_TASKS = "/proc/self/task"


def _threads() -> set[str]:
    return set(os.listdir(_TASKS))


# The threads that importing NumPy and torch left running (a BLAS pool, which handles fork).
# One more at the fork means someone started it since (torch's CPU pool after a large enough
# operation or set_num_threads, a gRPC or Tokio runtime, ...): whatever it holds could hang
# the server's workers, so a fresh server is started then. Threads started before asyncload
# was imported can't be told from that pool.
_AT_IMPORT = _threads() if os.path.isdir(_TASKS) else set()


def _forget_in_child() -> None:
    # A child made by os.fork() (a fork-context Process or Pool that iterates a loader built
    # here) inherits multiprocessing's singletons as they are in the parent.
    #
    # The resource tracker guards its pipe with a lock that a thread of the parent may hold at
    # the fork: the reaper dropping a pass's queues (their semaphores unregister), a standby
    # start making new ones. The child, where that thread does not run, then hangs in its first
    # Queue() or Event() (seen: 3 child passes in 15 hung). Its copy of the pipe is usable:
    # only the lock is the parent's.
    resource_tracker._resource_tracker._lock = threading.RLock()  # type: ignore[attr-defined]
    # The forkserver is the parent's, which ensure_running then fails to wait for
    # ("ChildProcessError: No child processes"), and the child holds a copy of the pipe whose
    # EOF tells that server its owner has gone: the child lets go of both, and starts its own
    # server if it needs one.
    server = forkserver._forkserver
    alive = getattr(server, "_forkserver_alive_fd", None)
    if getattr(server, "_forkserver_pid", None) is None:
        return
    server._forkserver_address = None  # type: ignore[attr-defined]
    server._forkserver_alive_fd = None  # type: ignore[attr-defined]
    server._forkserver_pid = None  # type: ignore[attr-defined]
    server._lock = threading.Lock()  # type: ignore[attr-defined]
    if alive is not None:
        with contextlib.suppress(OSError):
            os.close(alive)


os.register_at_fork(after_in_child=_forget_in_child)


def server_pid() -> int | None:
    """The pid of this process's forkserver, if it started one."""
    pid: int | None = getattr(forkserver._forkserver, "_forkserver_pid", None)
    return pid


# asyncload's own long-lived threads that may run when the server is forked (the reaper, which
# stops workers): thread → a lock it holds whenever it does anything but wait. Forking with
# every such lock held leaves nothing of theirs half-done in the server, where they don't run.
_quiet: dict[threading.Thread, threading.Lock] = {}


def register_quiet_thread(thread: threading.Thread, busy: threading.Lock) -> None:
    """*thread* holds *busy* whenever it works; it may run while the server is forked."""
    _quiet[thread] = busy


def _quiet_threads() -> list[threading.Thread]:
    return [t for t in list(_quiet) if t.is_alive()]


def unsafe_reason() -> str | None:
    """Why the forkserver must not be forked from this process now, or ``None``."""
    if sys.platform != "linux" or not hasattr(os, "fork") or not os.path.isdir(_TASKS):
        return "not Linux with /proc"
    reason = _guards.fork_unsafe_reason()
    if reason is not None:
        return reason
    quiet = _quiet_threads()
    # asyncload's other threads too: the server lives long
    if threading.active_count() - len(quiet) > 1:
        return "another Python thread runs"
    if not _threads() - {str(t.native_id) for t in quiet} <= _AT_IMPORT:
        return "threads started since asyncload was imported"
    return None


def fork_server() -> bool:
    """Start the forkserver by forking this process, when that is safe and none runs yet.

    Returns whether it did; when not, the caller starts a fresh one (or ``iter()`` does).
    Blocks for the fork only (a few milliseconds: the page tables are copied).
    """
    if server_pid() is not None or unsafe_reason() is not None:
        return False
    original = util.spawnv_passfds

    def fork_or_spawn(path: bytes, args: Sequence[Any], passfds: Sequence[int]) -> int:
        # [python, *flags, "-c", command, *argv]: newer Pythons pass the script's arguments on.
        words = [str(a) for a in args]
        at = words.index("-c") + 1 if "-c" in words else len(words)
        if at >= len(words) or _SERVER_MAIN not in words[at]:  # the resource tracker: as usual
            return original(path, args, passfds)
        return _fork(words[at], words[at + 1 :], passfds, original)

    held: list[threading.Lock] = []
    for thread in _quiet_threads():  # each waits, holding nothing, until the fork is done
        busy = _quiet[thread]
        if not busy.acquire(timeout=5.0):
            for lock in held:
                lock.release()
            return False
        held.append(busy)
    util.spawnv_passfds = fork_or_spawn  # no other Python thread runs (checked above)
    try:
        forkserver.ensure_running()
    except Exception:  # a fresh server is started instead, and reports what fails
        return False
    finally:
        util.spawnv_passfds = original
        for lock in held:
            lock.release()
    return True


def _fork(command: str, argv: list[str], passfds: Sequence[int], spawnv: Any) -> int:
    """Fork a process that runs *command* (``forkserver.main(...)``) as ``python -c command
    *argv`` would, with *passfds*; its pid. *spawnv* is multiprocessing's own, restored there."""
    main_path = spawn.get_preparation_data("asyncload").get("init_main_from_path")
    for stream in (sys.stdout, sys.stderr):  # else the server could write out this process's
        if stream is not None:  # buffered output a second time
            with contextlib.suppress(Exception):
                stream.flush()
    # Signals wait until the child has reset the handlers: a SIGTERM or Ctrl-C in between would
    # run the script's handler there, or raise into the loader's constructor and carry on.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        with warnings.catch_warnings():
            # Python 3.12+ warns whenever other OS threads exist: here only those importing
            # NumPy and torch started (unsafe_reason), as under torch's fork workers.
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        raise
    if pid:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        return pid
    status = 1
    try:
        # As multiprocessing would have it in a process of its own: its lock free, its
        # function back, and __main__ named as workers will look it up (else each of them
        # runs the script again: `python ./train.py` leaves "./" in __file__).
        util.spawnv_passfds = spawnv
        forkserver._forkserver._lock = threading.Lock()  # type: ignore[attr-defined]
        main = sys.modules.get("__main__")
        if main is not None and main_path is not None and hasattr(main, "__file__"):
            main.__file__ = main_path
        _become_server(set(passfds))
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        sys.argv = ["-c", *argv]
        exec(command, {"__name__": "__asyncload_forkserver__"})
        status = 0
    except SystemExit as stop:  # forkserver.main's way out: this process has gone
        status = stop.code if isinstance(stop.code, int) else 0
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(status)  # never back into the caller's frames, atexit or finalizers


def _inode(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _become_server(keep: set[int]) -> None:
    """In the forked child: what a freshly started server would not have, taken away."""
    # Pipes and sockets, the other ends of the server's own pipes among them: held here, they
    # would keep their peers from ever seeing EOF (a subprocess's stdin, the "alive" pipe).
    # Each becomes one whose peer is gone (reads see EOF, writes fail with EPIPE), under the
    # same number, so an object that still owns it neither writes into whatever gets that
    # number next nor succeeds silently. Files stay open, as in any forked child; so do
    # stdin, stdout and stderr, unless one is the other end of a pipe passed to the server.
    import fcntl  # here: the module is imported on Windows too, which has none

    passed = {_inode(fd) for fd in keep}
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd in keep:
            continue
        try:
            st = os.fstat(fd)
        except OSError:  # the descriptor listdir itself used
            continue
        if fd <= 2 and (st.st_dev, st.st_ino) not in passed:
            continue
        if stat.S_ISFIFO(st.st_mode):
            read_end, write_end = os.pipe()
            writes = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDONLY
            os.dup2(write_end if writes else read_end, fd, inheritable=False)
            os.close(read_end)
            os.close(write_end)
        elif stat.S_ISSOCK(st.st_mode):
            mine, peer = socket.socketpair()
            os.dup2(mine.fileno(), fd, inheritable=False)
            mine.close()
            peer.close()
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
