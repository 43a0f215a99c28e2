"""Worker processes started before the pass that uses them, waiting for its settings.

Without ``persistent_workers`` every pass starts new worker processes, as torch's do. Under
``forkserver`` that is a fork of the server per worker, one after the other, and a new
interpreter's first steps: 20-30 ms of every ``iter(loader)`` here, before any request leaves.
So once a pass has sent its last task and a worker has answered (not while its first
requests need the CPU), ``StandbySlot.prepare`` starts the next pass's processes in a
background thread, while that pass's last batches are still being fetched.
They wait for their ``WorkerConfig`` on their index queue (``worker_main`` given ``Standing``),
having built meanwhile the object-store clients of the prefixes configured when they were
started (``_storage.prewarm``: 7-17 ms each, otherwise on the pass's loop, in front of its first
requests), and the next pass takes them (``StandbySlot.take``) and sends each its config. A loader
prepares its first pass's processes the same way when it is built, under ``forkserver``
(``_context.early_context``), so the first batch of a loader built a moment before
``iter()`` waits for no process either (with persistent workers too: that first set is all
they need)::

    pass N: ... last task sent, a batch in ──► prepare(): start processes ──► they wait,
                                                 watching the main process
    pass N+1: iter() ──► take(): all alive? ──► send each its pickled config ──► as before
                             └─ no: stop them (NOTE [ Data flow and shutdown ]), start anew

The config, with the dataset, is still pickled at ``iter()``: what the program changed in the
dataset between epochs reaches the workers, as with torch. Only under ``forkserver`` and
``spawn``: under ``fork`` a worker inherits the dataset rather than unpickling it, and a config
sent later would have to be picklable. A slot's processes are stopped when a pass can't use
them, when the loader is collected (``StandbySlot.close``), and at exit: they are daemonic,
and watch the main process like any worker.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.util  # its exit handler must be registered before ours (see the end)
import os
import threading
import time
import weakref
from typing import Any

from .._protocol.messages import Standing
from .._storage import api as _storage
from .._storage.api import StorageConfig
from .reaper import budget, reaper
from .stop import (
    JOIN_TIMEOUT,
    DoneFlag,
    new_index_queue,
    release_elsewhere,
    shared_polling,
    stop_processes,
)

__all__ = ["Standby", "StandbySlot"]

_METHODS = ("forkserver", "spawn")


class Standby:
    """*count* worker processes of one context, with a pass's queues and done flag, that have
    no config yet."""

    def __init__(
        self, context: Any, count: int, storage: StorageConfig | None = None, pool_size: int = 0
    ) -> None:
        from .child import worker_main  # what only a loader with workers needs

        self.context = context
        self.count = count
        self.done_event: DoneFlag | None = DoneFlag(context)
        self.result_queue = context.Queue()
        self.index_queues: list[Any] = []
        self.procs: list[Any] = []
        reaper.own(self)  # until close(), before any process starts: NOTE [ Who stops workers ]
        standing = Standing(os.getpid(), storage, pool_size, dict(os.environ))
        try:
            for worker_id in range(count):
                index_queue = new_index_queue(context)
                self.index_queues.append(index_queue)  # closed by close() whatever fails next
                # A queue's first put starts its feeder thread (~1 ms on a busy machine):
                # here, not in iter(). (freed, None) is "releases only", which the worker skips.
                index_queue.put(((), None))
                proc = context.Process(
                    target=worker_main,
                    args=(standing, index_queue, self.result_queue, self.done_event),
                    name=f"asyncload-worker-{worker_id}",
                    daemon=True,
                )
                proc.start()
                shared_polling(proc)
                self.procs.append(proc)
        except BaseException:
            self.close()
            raise

    def fits(self, context: Any, count: int) -> bool:
        """Whether a pass with this context and worker count can take these processes."""
        return (
            self.count == count == len(self.procs)
            and self.context.get_start_method() == context.get_start_method()
            and all(p.is_alive() for p in self.procs)
        )

    def close(self) -> None:
        if self.done_event is None:  # closed already
            return
        # This object lets go of them: NOTE [ Ctrl-C and finalizers ] in _stop.py.
        box: list[Any] = [self.procs, self.index_queues, self.result_queue, self.done_event]
        self.procs, self.index_queues = [], []
        self.result_queue = self.done_event = None
        stop_processes(*box)
        release_elsewhere(box)
        reaper.disown(self)
        budget.stopped(self)

    def retire(self) -> None:
        """Have the reaper stop these processes; they count against the budget until then."""
        budget.stopping(self, self.count)
        reaper.submit(self.close)


class StandbySlot:
    """The loader's place for the next pass's standby processes (at most one set).

    Sets are bounded across the process (``_reaper.StandbyBudget``): a new one pushes out the
    oldest, and one that waits too long is stopped. Every stop goes through the reaper
    (NOTE [ Who stops workers ] in ``_workers/reaper.py``); nothing here joins in a finalizer.

    Examples:
        >>> slot = StandbySlot()  # doctest: +SKIP
        >>> slot.prepare(multiprocessing.get_context("forkserver"), 2)  # doctest: +SKIP
        >>> standby = slot.take(context, 2)  # a Standby, or None  # doctest: +SKIP
    """

    def __init__(self) -> None:
        # Re-entrant: a collection inside prepare() may run a dropped loader's finalizer, which
        # closes this slot from the same thread.
        self._lock = threading.RLock()
        self._pid = os.getpid()
        self._thread: threading.Thread | None = None  # the start under way, if any
        self._standby: Standby | None = None
        self._closed = False
        # No more sets: one failed to start, or the loader's objects can only reach a worker
        # when it starts (``ProcessWorkers``: a multiprocessing.Value, Lock, Queue...).
        self._off = False
        _slots.add(self)

    def prepare(self, context: Any, count: int, *, max_concurrency: int = 0) -> None:
        """Start *count* processes for the next pass in a background thread, if it's safe.

        They build the storage clients of the prefixes configured now, with *max_concurrency*
        connections per host (``_storage.prewarm``); none when it is 0.
        """
        if context.get_start_method() not in _METHODS or multiprocessing.current_process().daemon:
            return
        if self._busy() or not budget.admit(self, count):  # admit() pushes older sets out
            return
        storage = _storage.export_config() if max_concurrency > 0 else None
        thread = threading.Thread(
            target=self._start,
            args=(context, count, storage, max_concurrency),
            name="asyncload-standby",
            daemon=True,
        )
        with self._lock:
            if self._busy():  # meanwhile
                budget.release(self)
                return
            self._thread = thread
        # Before start(): a Ctrl-C inside start() (it waits for the thread to begin) leaves a
        # thread that runs all the same, and the exit must wait for it (_close_at_exit).
        _starting.add(thread)
        # Not under the lock: a finalizer of this slot's loader may run on a thread that holds
        # threading's start lock (a collection inside Thread.start()) and wait for ours.
        try:
            thread.start()
        except Exception:  # no thread to be had (RuntimeError): the next pass starts its own
            _starting.discard(thread)
            with self._lock:
                if self._thread is thread:
                    self._thread = None
            budget.release(self)

    def forget(self) -> None:
        """In a child made by ``os.fork()``: the set this copy of the slot holds or starts is
        the parent's, to take and to stop (NOTE [ Who stops workers ]), so it is dropped
        here. The child prepares none of its own: a fork-context ``Process`` or ``Pool``
        worker ends without running ``atexit``, so a start under way there would be cut off
        mid-way (its worker fails to unpickle queues whose semaphores are gone)."""
        self._lock = threading.RLock()  # a parent's thread may have held it at the fork
        self._thread = None
        self._standby = None
        self._off = True
        self._pid = os.getpid()

    def _busy(self) -> bool:
        """Whether this slot holds, starts, or may not start a set now."""
        with self._lock:
            return (
                self._closed or self._off or self._thread is not None or self._standby is not None
            )

    def _start(
        self, context: Any, count: int, storage: StorageConfig | None, pool_size: int
    ) -> None:
        try:
            self._start_set(context, count, storage, pool_size)
        finally:
            _starting.discard(threading.current_thread())

    def _start_set(
        self, context: Any, count: int, storage: StorageConfig | None, pool_size: int
    ) -> None:
        try:
            standby = Standby(context, count, storage, pool_size)
        except Exception:  # the next pass starts its own workers, and reports what fails
            with self._lock:
                self._off = True  # never again for this loader: no restarts in a loop
                if self._thread is threading.current_thread():
                    self._thread = None
            budget.release(self)
            return
        with self._lock:
            # Not pushed out, taken past or closed meanwhile (any of which forgot this start).
            keep = not self._closed and self._thread is threading.current_thread()
            if keep:
                self._standby = standby
        if not keep:
            standby.retire()

    def _settle(self) -> Standby | None:
        with self._lock:
            thread = self._thread
        if thread is not None:
            _join(thread, JOIN_TIMEOUT)  # a start that hangs is left behind: it stops its own
        with self._lock:
            self._thread = None
            standby, self._standby = self._standby, None
        budget.release(self)
        return standby

    def take(self, context: Any, count: int) -> Standby | None:
        """The prepared processes if a pass with *context* and *count* workers can use them;
        ``None`` (and any that don't fit stopped) otherwise."""
        standby = self._settle()
        if standby is not None and not standby.fits(context, count):
            standby.retire()
            return None
        return standby

    def turn_off(self) -> None:
        """Prepare no more sets for this loader (its objects need a worker's start)."""
        with self._lock:
            self._off = True
        self.evict()

    def evict(self) -> None:
        """Stop the set this slot holds or is starting (the budget's call); later passes may
        prepare another."""
        with self._lock:
            standby, self._standby = self._standby, None
            self._thread = None  # a start under way stops what it started when it ends
        if standby is not None:
            standby.retire()
        budget.release(self)

    @property
    def held(self) -> bool:
        """Whether a set is held or starting."""
        with self._lock:
            return self._standby is not None or self._thread is not None

    def close(self, *, wait: bool = False) -> None:
        """Stop the prepared processes, if any, and prepare no more.

        Safe in a finalizer: the reaper stops them. A start under way (a loader dropped just
        after it was built, or the last epoch's standby processes, nobody knowing it was the
        last) stops what it started itself when it ends, so this does not wait for it, unless
        *wait*: at interpreter exit (``_close_at_exit``), where no process may be left starting
        while the interpreter tears down the queues it needs; then at most ``JOIN_TIMEOUT``
        seconds, and the stop runs before this returns.
        """
        with self._lock:
            self._closed = True
            thread = self._thread
            if not wait:
                self._thread = None
        if wait and thread is not None:
            _join(thread, JOIN_TIMEOUT)
            reaper.drain(JOIN_TIMEOUT + 5)  # the stop the start handed over when it ended
        with self._lock:
            standby, self._standby = self._standby, None
            self._thread = None
        if standby is not None:
            budget.stopping(standby, standby.count)
            reaper.submit(standby.close, wait=wait)
        budget.release(self)


_slots: weakref.WeakSet[StandbySlot] = weakref.WeakSet()
# Starts under way, also those of slots already collected: at exit each must end before the
# interpreter tears down what it uses (a start cut off mid-way leaves the forkserver printing
# an EOFError, or a semaphore made after multiprocessing's exit handler ran, which the
# resource tracker then calls leaked), and what it started is then stopped.
_starting: set[threading.Thread] = set()


# How long a standby thread whose start() was cut short may take to begin: one whose OS
# thread exists begins within milliseconds, even on a busy machine.
_BEGIN_GRACE = 1.0


def _join(thread: threading.Thread, timeout: float) -> None:
    """``thread.join(timeout)``, also for a thread whose ``start()`` a KeyboardInterrupt cut
    short: it may not have begun yet, and join() would raise. One that has not begun within
    ``_BEGIN_GRACE`` never will (the interrupt came before its OS thread): it is forgotten."""
    if thread is threading.current_thread():
        raise RuntimeError("a standby start cannot wait for itself")
    deadline = time.monotonic() + timeout
    begin_by = time.monotonic() + min(timeout, _BEGIN_GRACE)
    while True:
        try:
            thread.join(max(0.0, deadline - time.monotonic()))
            return
        except RuntimeError:  # "cannot join thread before it is started"
            if time.monotonic() >= begin_by:
                _starting.discard(thread)
                return
            time.sleep(0.005)


def _close_at_exit() -> None:
    deadline = time.monotonic() + JOIN_TIMEOUT
    for thread in list(_starting):
        _join(thread, max(0.0, deadline - time.monotonic()))
    for slot in list(_slots):
        if slot._pid != os.getpid():  # a copy in a child made by os.fork(): not its processes
            continue
        try:
            slot.close(wait=True)
        except Exception:  # the others still get closed; exit goes on
            pass


def _forget_in_child() -> None:
    # A loader copied into a child by os.fork() (a fork-context Process or Pool given a loader
    # built here) must not take the parent's standby processes as its own, nor push them out of
    # a budget, which would stop them under the parent's passes.
    budget.forget()
    _starting.clear()  # the parent's threads: none runs here
    for slot in list(_slots):
        slot.forget()


os.register_at_fork(after_in_child=_forget_in_child)

# atexit runs its handlers last-registered first: this one before multiprocessing's (which
# stops the children and the resource tracker), imported above for that.
atexit.register(_close_at_exit)
