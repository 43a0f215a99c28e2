"""The shutdown sequence of worker processes, NOTE [ Data flow and shutdown ] in
``_protocol/messages.py``: written once, for a pass's workers and for standby ones
(``_workers.standby``).

NOTE [ Ctrl-C and finalizers ]
------------------------------
Python runs signal handlers in the main thread only, at the next bytecode it executes. If that
bytecode belongs to a finalizer (a ``__del__``, a weakref callback), the ``KeyboardInterrupt``
is printed as "Exception ignored in ..." and lost: the training loop goes on as if Ctrl-C had
never been pressed. A pass's multiprocessing objects carry many finalizers (each queue's two
connections and three semaphores, the done signal's shared memory, each process's descriptors),
and without care they run in the main thread when the pass is dropped, every epoch::

    main thread:  close() ── stop processes ── let go ──► release_elsewhere(box)
    "asyncload-release":                                   waits for the caller to return,
                                                           box.clear() → finalizers run here

So the owners hand their objects to a short-lived thread, which drops the last references;
the finalizers then run where no signal handler ever does. Not at interpreter exit: no
training loop is left to lose a Ctrl-C, and a daemon thread could be cut off mid-finalizer.
"""

from __future__ import annotations

import atexit
import mmap
import multiprocessing.connection
import multiprocessing.context
import multiprocessing.reduction
import multiprocessing.sharedctypes
import multiprocessing.util  # its exit handler must be registered before ours (see the end)
import os
import signal
import sys
import tempfile
import threading
import time
import weakref
from typing import Any

from .._protocol.messages import Shutdown
from .._transfer.shm import sweep_dead

__all__ = [
    "JOIN_TIMEOUT",
    "DoneFlag",
    "new_index_queue",
    "release_elsewhere",
    "shared_polling",
    "stop_processes",
]

# Seconds to wait for a worker to exit on its own before terminate(), then kill().
JOIN_TIMEOUT = 5.0


class DoneFlag:
    """The "done" signal of a set of workers (step 1 of the shutdown): one byte of shared
    memory, read and written without a lock.

    A ``multiprocessing.Event`` takes a lock shared by every process for each read, and a
    worker killed (SIGKILL, a segfault) while it held that lock left it held for good: the
    other workers, which read the event before every result they send, stopped there, never saw
    the signal, and were killed only after ``JOIN_TIMEOUT`` (a fresh clone's CI saw
    ``test_killed_worker_raises_naming_pid_and_signal`` take 6.3 s; earlier, before ``set()``
    was bounded, 26 workers piled up behind it). One byte needs no lock: a read or a write of it
    is whole, and no process can die holding anything.

    The byte is a memfd of its own, not multiprocessing's shared heap (``RawValue``): a heap
    arena shared with a user's ``Value`` was handed to a spawned worker twice, once in each
    pickle of its arguments, and the start failed ("bad value(s) in fds_to_keep"). It reaches a
    worker only as the worker starts (its arguments), as the event did.

    Examples:
        >>> import multiprocessing
        >>> done = DoneFlag(multiprocessing.get_context("fork"))
        >>> done.is_set()
        False
        >>> done.set()
        >>> done.is_set()
        True
    """

    __slots__ = ("_byte", "_fd")

    def __init__(self, context: Any = None, *, fd: int | None = None) -> None:
        del context  # any start method: a spawned worker gets the descriptor (__reduce__)
        self._fd = -1
        if sys.platform == "win32":  # pragma: no cover - no DupFd: a named mapping, by name
            self._byte: Any = multiprocessing.sharedctypes.RawArray("b", 1)
            return
        if fd is None:
            fd = _anonymous_file()
        try:
            self._byte = mmap.mmap(fd, 1)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd  # kept: each spawned worker's start passes it on

    def is_set(self) -> bool:
        return self._byte[0] != 0

    def set(self) -> None:
        self._byte[0] = 1

    def __reduce__(self) -> tuple[Any, ...]:
        multiprocessing.context.assert_spawning(self)
        if self._fd < 0:  # pragma: no cover - Windows: the array pickles itself
            return _shared_done_flag, (self._byte,)
        return _rebuild_done_flag, (multiprocessing.reduction.DupFd(self._fd),)

    def __del__(self) -> None:
        # Unmaps a page and closes a descriptor: never blocks, on whatever thread collects it.
        if getattr(self, "_fd", -1) >= 0:
            self._byte.close()
            os.close(self._fd)


def _rebuild_done_flag(dup: Any) -> DoneFlag:
    fd = dup.detach()
    os.set_inheritable(fd, False)  # passed on to this worker only, not to what it starts
    return DoneFlag(fd=fd)


def _shared_done_flag(byte: Any) -> DoneFlag:  # pragma: no cover - Windows
    flag = DoneFlag.__new__(DoneFlag)
    flag._fd, flag._byte = -1, byte
    return flag


def _anonymous_file() -> int:
    """A descriptor of a one-byte file with no name (nothing to leave behind in /dev/shm)."""
    try:
        fd = os.memfd_create("asyncload-done", os.MFD_CLOEXEC)
    except (AttributeError, OSError):  # no memfd (macOS, an old kernel, a seccomp filter)
        with tempfile.TemporaryFile() as f:  # unlinked at once; the copy outlives it
            fd = os.dup(f.fileno())
    try:
        os.pwrite(fd, b"\0", 0)  # the byte exists on disk: a write to the map never SIGBUSes
    except BaseException:
        os.close(fd)
        raise
    return fd


def shared_polling(proc: Any) -> None:
    """Let two threads ask a started *proc* whether it exited (``is_alive()``, ``join()``,
    ``exitcode``) and both get the truth.

    The stopping thread (the reaper) joins a pass's workers while the user may join them too
    (``iter(loader)._workers``, as torch's tests do). A forkserver process's exit status is 8
    bytes on a pipe that the server then closes: whichever thread reads second finds EOF, and
    multiprocessing records exit code 255 for good ("the forkserver got killed"). Such a
    process's ``Popen`` becomes ``_SharedPollPopen``, which reads under a lock, after the wait
    for the pipe (which holds no lock, so a thread that waits for ever never keeps another
    from asking). Other start methods read the status with ``waitpid``, where the thread that
    comes second sees what the first recorded."""
    popen = getattr(proc, "_popen", None)
    if _SharedPollPopen is not None and type(popen) is _SharedPollPopen.__base__:
        popen._asyncload_poll_lock = threading.Lock()  # type: ignore[union-attr]
        popen.__class__ = _SharedPollPopen  # no closure over it: no cycle keeps its fds


try:
    from multiprocessing import popen_forkserver
except ImportError:  # pragma: no cover - no forkserver on this platform
    _SharedPollPopen: Any = None
else:

    class _SharedPollPopen(popen_forkserver.Popen):  # type: ignore[no-redef]
        _asyncload_poll_lock: threading.Lock

        def poll(self, flag: int = os.WNOHANG) -> int | None:
            if flag != os.WNOHANG and self.returncode is None:
                multiprocessing.connection.wait([self.sentinel])  # its exit status is there
            with self._asyncload_poll_lock:
                return super().poll(os.WNOHANG)


def new_index_queue(context: Any) -> Any:
    """A worker's index queue, ready for the stop (NOTE [ Data flow and shutdown ], step 4)."""
    queue = context.Queue()
    # Fail fast (or keep going) regardless of a Ctrl-C the main process handles.
    queue.cancel_join_thread()
    # A broken pipe (its worker gone, and this process's read end closed by the stop) ends the
    # feeder thread quietly, where it would print a traceback per message still buffered. Read
    # when the first put starts that thread.
    queue._ignore_epipe = True
    return queue


def _unblock_feeder(queue: Any) -> None:
    """Close this process's read end of *queue*, whose worker has exited.

    That end is then the pipe's only one, so a feeder thread blocked on the full pipe (tasks a
    killed or stuck worker never read) would wait on it for ever, and keep the queue's
    semaphores named in /dev/shm until this process exits. Closed, the write fails with EPIPE,
    the feeder's quiet end (``new_index_queue``). Called before ``close()``: the feeder closes
    this end itself at ``close()``'s sentinel, and two threads must not both close one
    descriptor.
    """
    finalizer = getattr(queue, "_close", None)
    if finalizer is None or not finalizer.still_active():
        return  # no feeder thread, or it was sent the sentinel already (at exit, say)
    if signal.getsignal(signal.SIGPIPE) == signal.SIG_DFL:
        return  # the write would kill this process (a script that restored SIGPIPE), not fail
    queue._reader.close()


def stop_processes(
    procs: list[Any],
    index_queues: list[Any],
    result_queue: Any,
    done: Any,
    *,
    close_objects: bool = True,
) -> None:
    """Stop worker processes and close their queues: NOTE [ Data flow and shutdown ], steps 1-4
    (the pin-memory thread, step 0, is the caller's). Also for standby processes that never
    got a config (``_workers.standby``): they take the same ``Shutdown``. Without *close_objects*
    the exited processes' objects stay usable (``is_alive()``, ``join()``: a pass's ``_workers``,
    which torch's iterator exposes); their descriptors go with them."""
    done.set()
    for q in index_queues:
        try:
            q.put(((), Shutdown()))
        except (OSError, ValueError):  # queue already closed
            pass
    deadline = time.monotonic() + JOIN_TIMEOUT
    for w in procs:
        w.join(max(deadline - time.monotonic(), 0.0))
    for w in procs:
        if w.is_alive():
            w.terminate()
            w.join(1.0)
        if w.is_alive():  # pragma: no cover - SIGTERM ignored
            w.kill()
            w.join(1.0)
    for w in procs:
        code = w.exitcode
        if code is not None and code < 0:  # killed mid-anything, perhaps inside torch's window
            sweep_dead(w.pid)
    # strict=False: a standby whose next process failed to start holds one queue more.
    for w, q in zip(procs, index_queues, strict=False):
        if not w.is_alive():
            _unblock_feeder(q)
    for q in [*index_queues, result_queue]:
        q.cancel_join_thread()
        q.close()
    for w in procs:
        if not w.is_alive():
            # Its arguments (the queues and the done flag) go with this stop, on this thread,
            # and not whenever the process object goes: a collection on some other thread would
            # run their semaphores' finalizers there (NOTE [ Who stops workers ]).
            w._args, w._kwargs = (), {}
    if not close_objects:
        return
    for w in procs:
        if not w.is_alive():
            w.close()  # its descriptors now, and multiprocessing forgets it


def release_elsewhere(box: list[Any]) -> None:
    """Drop *box*'s contents off the main thread (NOTE [ Ctrl-C and finalizers ]): here if
    the caller isn't the main thread (the reaper, NOTE [ Who stops workers ]), else in a
    short-lived thread.

    *box* must be the caller's only reference to what it holds, and the caller must not keep
    *box* past its return. At interpreter exit (the main thread has stopped: atexit handlers,
    finalizers run then) it drops them at once: a daemon thread may be cut off there between
    unlinking a semaphore and telling the resource tracker, which then warns of a leak.
    """
    main = threading.main_thread()
    if threading.current_thread() is not main or not main.is_alive():
        box.clear()  # interpreter exit, or already off the main thread (the reaper's)
        return
    try:
        thread = threading.Thread(target=_release, args=(box,), name="asyncload-release")
        thread.daemon = True
        thread.start()
    except RuntimeError:  # the interpreter is shutting down: no new threads, drop them here
        box.clear()
        return
    _releasing.add(thread)


def _release(box: list[Any]) -> None:
    # Until the caller has returned: then only this frame, getrefcount's argument and the
    # Thread's args tuple refer to box. (Were it fewer in some Python, the wait would just end
    # at once, the finalizers maybe in the caller's thread as before; never a hang.)
    deadline = time.monotonic() + 1.0
    while sys.getrefcount(box) > 3 and time.monotonic() < deadline:
        time.sleep(0.001)
    box.clear()


_releasing: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


def _join_releases() -> None:
    """Let releases started just before exit finish: a daemon thread frozen at exit between
    unlinking a semaphore and telling the resource tracker leaves it warning of a leak."""
    deadline = time.monotonic() + 2.0
    for thread in list(_releasing):
        thread.join(max(deadline - time.monotonic(), 0.0))


# atexit runs its handlers last-registered first: this one before multiprocessing's.
atexit.register(_join_releases)
