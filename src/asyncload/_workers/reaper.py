"""The one thread that stops workers, and the process-wide bound on standby processes.

NOTE [ Who stops workers ]
--------------------------
A finalizer (``__del__``, ``weakref.finalize``, a collection of a reference cycle) runs on
whatever thread allocated when the collector ran: the training thread in the middle of
``Thread.start()`` holding ``threading``'s limbo lock, the loop-monitor thread walking frames,
a pin-memory thread. A finalizer that joins a thread or a process there can wait for ever (the
joined thread may need that very lock to start its own helper thread), and one that starts a
thread can deadlock on the limbo lock itself. So stopping workers has one owner, a daemon thread
that exists for it, and a finalizer only hands it the job::

    any thread, any moment:   Pass.__del__, a loader's finalizer ──► reaper.submit(job)
                              (SimpleQueue.put: never blocks, safe inside a finalizer)
    training thread:          Pass.close() ──► reaper.submit(job, wait=True) ─┐ waits, bounded
    "asyncload-reaper":       job(): stop_processes (bounded joins) ◄─────────┘
                              drops the objects: their finalizers run here, never on the
                              main thread (NOTE [ Ctrl-C and finalizers ] in ``_workers/stop.py``)
                              every few seconds: reclaims idle standby processes

Until the reaper has stopped them, the objects that own processes (a pass's workers, a standby
set) are also held here (``Reaper.own``). A loader or a pass in a reference cycle becomes garbage
as a whole: the collector clears weak references, and so runs multiprocessing's finalizers that
unlink the queues' semaphores, *before* any ``__del__`` can hand the objects on. A worker still
unpickling its queues then fails (``SemLock._rebuild`` → ``FileNotFoundError`` on its stderr).
Held here, those objects are never part of the garbage.

The thread is started on ordinary calls only (a loader built, a pass started), never from a
finalizer. Where it can't run (a child made by ``os.fork()``, interpreter exit) a job waits in
the queue for the next ordinary call, or runs in the caller when the caller may block (an
explicit ``close()``, ``atexit``). At exit the thread first runs what is queued and the job in its
hands, then ends (``Reaper.stop_thread``), all before multiprocessing's exit handler joins the
children. A job that raises is printed to stderr and the reaper goes on.

Standby processes (``_workers.standby``) are bounded here too: at most ``max_standby_processes()``
of them across every loader of the process (``ASYNCLOAD_MAX_STANDBY``, default twice the usable
cores, at least 4); a new set pushes out the oldest, and a set no pass has taken for
``standby_idle_s()`` seconds (``ASYNCLOAD_STANDBY_IDLE``, default 60) is stopped.
"""

from __future__ import annotations

import atexit
import multiprocessing.util  # noqa: F401  (its exit handler is registered before ours: see the end)
import os
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Protocol

from .start_method import forkserver as _forkserver

__all__ = [
    "StandbyBudget",
    "max_standby_processes",
    "reaper",
    "standby_idle_s",
]

ENV_MAX_STANDBY = "ASYNCLOAD_MAX_STANDBY"
ENV_STANDBY_IDLE = "ASYNCLOAD_STANDBY_IDLE"
DEFAULT_STANDBY_IDLE = 60.0

# How long an explicit close() waits for its job: the stop sequence's own bound (joins of
# JOIN_TIMEOUT, then terminate and kill with a second each) and some slack for a queue ahead.
WAIT_TIMEOUT = 15.0
# How often the reaper wakes without a job, to reclaim idle standby processes.
_TICK = 1.0


class _Job:
    __slots__ = ("done", "fn")

    def __init__(self, fn: Callable[[], object]) -> None:
        self.fn = fn
        self.done = threading.Event()


_STOP = _Job(lambda: None)
"""Queued at exit: the thread ends once the jobs ahead of it have run (``stop_thread``)."""


class Reaper:
    """Runs the jobs that stop workers, one after the other, on one daemon thread.

    Examples:
        >>> reaper.submit(workers.close)  # from a finalizer: returns at once  # doctest: +SKIP
        >>> reaper.submit(workers.close, wait=True)  # from close(): bounded wait  # doctest: +SKIP
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        # Only ordinary calls take it (never a finalizer): it guards the thread's start.
        self._start_lock = threading.Lock()
        self.idle_hooks: list[Callable[[], None]] = []
        self._owned: set[object] = set()  # see the module doc
        # Held while a job runs, wherever it runs: at exit, what the thread is doing ends
        # before multiprocessing's own exit handler joins the children.
        self._job_lock = threading.Lock()

    def own(self, obj: object) -> None:
        """Keep *obj* (which owns processes) reachable until ``disown``: never cyclic garbage."""
        self._owned.add(obj)

    def disown(self, obj: object) -> None:
        """*obj*'s processes are stopped."""
        self._owned.discard(obj)

    def ensure_started(self) -> None:
        """Start the thread if it isn't running. Ordinary calls only, never a finalizer."""
        thread = self._thread
        if thread is not None and thread.is_alive() and self._pid == os.getpid():
            return
        if not threading.main_thread().is_alive():  # interpreter exit: jobs run in the caller
            return
        with self._start_lock:
            if self._pid != os.getpid():  # a child made by os.fork(): the parent's jobs aren't ours
                self._reset()
            if self._thread is not None and self._thread.is_alive():
                return
            thread = threading.Thread(target=self._run, name="asyncload-reaper", daemon=True)
            try:
                thread.start()
            except RuntimeError:  # no new threads at interpreter shutdown
                return
            self._thread = thread

    def _reset(self) -> None:
        self._owned = set()
        self._job_lock = threading.Lock()
        self._queue = queue.SimpleQueue()
        self._thread = None
        self._pid = os.getpid()

    def on_reaper_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def submit(self, fn: Callable[[], object], *, wait: bool = False) -> None:
        """Have the reaper run *fn*; with *wait*, return once it ran (at most WAIT_TIMEOUT s).

        Without *wait* this never blocks and starts no thread: safe in a finalizer. With *wait*
        (an ordinary call that may block), *fn* runs in the caller when no reaper can run.
        """
        if self.on_reaper_thread():
            _run_job(fn)  # inside a job already
            return
        if wait:
            self.ensure_started()
            thread = self._thread
            if (
                thread is None
                or not thread.is_alive()
                or self._pid != os.getpid()
                or not threading.main_thread().is_alive()
            ):
                with self._job_lock:
                    _run_job(fn)  # interpreter exit, or no thread to be had
                return
        job = _Job(fn)
        self._queue.put(job)
        if wait:
            job.done.wait(WAIT_TIMEOUT)

    def drain(self, timeout: float) -> bool:
        """Wait (at most *timeout* s) until every job submitted so far has run; ``True`` if so.

        For tests and ``atexit``: what was handed over before this call is done after it.
        """
        if self.on_reaper_thread():
            return True
        marker = _Job(lambda: None)
        self._queue.put(marker)
        self.ensure_started()
        thread = self._thread
        if thread is None or not thread.is_alive() or not threading.main_thread().is_alive():
            self._run_pending()  # no reaper, or interpreter exit: here
        return marker.done.wait(timeout)

    def stop_thread(self, timeout: float) -> bool:
        """At exit: the thread runs the jobs queued so far (and the one in its hands), then
        ends. ``True`` once it has (or none runs here); ``False`` if *timeout* s passed first.

        Only then may multiprocessing's exit handler join the children: a job the thread had
        taken from the queue, but not yet begun, would otherwise close the very ``Process``
        objects that handler joins (``ValueError: process object is closed``).
        """
        thread = self._thread
        if thread is None or not thread.is_alive() or self._pid != os.getpid():
            return True
        self._queue.put(_STOP)
        thread.join(timeout)
        return not thread.is_alive()

    def _run_pending(self) -> None:
        """Run queued jobs in this thread (at exit, or with no reaper thread)."""
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is _STOP:
                continue
            with self._job_lock:
                _run_job(job.fn)
            job.done.set()

    def _run(self) -> None:
        # It may run while the fork server is forked from this process: it holds the job lock
        # whenever it works (see _forkserver).
        _forkserver.register_quiet_thread(threading.current_thread(), self._job_lock)
        last_tick = time.monotonic()
        while True:
            try:
                job = self._queue.get(timeout=_TICK)
            except queue.Empty:
                job = None
            if job is _STOP:  # interpreter exit (stop_thread)
                return
            if job is not None:
                with self._job_lock:
                    _run_job(job.fn)
                job.done.set()
                del job  # its objects go here, not in the next wait's frame
            now = time.monotonic()
            if now - last_tick >= _TICK:
                last_tick = now
                for hook in list(self.idle_hooks):
                    with self._job_lock:
                        _run_job(hook)


def _run_job(fn: Callable[[], object]) -> None:
    try:
        fn()
    except Exception:  # one failed stop must not stop the others; said where a user sees it
        print("asyncload: stopping DataLoader workers failed:", file=sys.stderr)
        traceback.print_exc()


# Process-wide: it stops the workers of every loader, and one thread is all it takes.
reaper = Reaper()


def _drain_at_exit(owner: Reaper = reaper) -> None:
    # Bounded: what can't be stopped in time is left to multiprocessing's own exit handler
    # (it terminates daemonic children) and to the end of the process (daemon threads).
    deadline = time.monotonic() + WAIT_TIMEOUT
    if not owner.stop_thread(WAIT_TIMEOUT):
        return  # stuck in a job: running more here would race it
    while time.monotonic() < deadline:  # what no thread ran (none started, or a forked child)
        try:
            job = owner._queue.get_nowait()
        except queue.Empty:
            return
        if job is _STOP:
            continue
        with owner._job_lock:
            _run_job(job.fn)
        job.done.set()


# atexit runs its handlers last-registered first: this one before multiprocessing's (which
# stops the children and the resource tracker), imported above for that.
atexit.register(_drain_at_exit)


# ── the bound on standby processes ────────────────────────────────────────────────────────────


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def max_standby_processes() -> int:
    """How many standby processes all loaders of this process may hold at once."""
    raw = os.environ.get(ENV_MAX_STANDBY, "").strip()
    if not raw:
        return max(4, 2 * _usable_cores())
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(
            f"{ENV_MAX_STANDBY}={raw!r} is not a whole number: give how many standby worker "
            "processes all loaders may hold (0 turns standby processes off)"
        ) from None
    return max(0, value)


def standby_idle_s() -> float:
    """Seconds a standby set may wait for a pass before it is stopped."""
    raw = os.environ.get(ENV_STANDBY_IDLE, "").strip()
    if not raw:
        return DEFAULT_STANDBY_IDLE
    try:
        return max(0.0, float(raw))
    except ValueError:
        raise ValueError(
            f"{ENV_STANDBY_IDLE}={raw!r} is not a number: give seconds a standby worker may wait"
        ) from None


class _Holder(Protocol):
    def evict(self) -> None:
        """Stop the standby processes this holder keeps (through the reaper) and forget them."""


class StandbyBudget:
    """Standby processes alive: the sets slots hold or start (oldest first), and those on their
    way out; who must make room for a new set.

    Process-wide (``budget`` below): the bound is across every loader of the process. A set
    counts from its slot's ``admit`` until a pass takes it or it has stopped (``stopping``,
    then ``stopped``), so stops queued behind the reaper count too.
    """

    def __init__(self) -> None:
        # Re-entrant: release() runs in finalizers, maybe on a thread that holds it already
        # (a collection triggered inside admit()).
        self._lock = threading.RLock()
        self._held: dict[_Holder, tuple[int, float]] = {}  # slot → (processes, since)
        self._stopping: dict[object, int] = {}  # standby set → processes

    def forget(self) -> None:
        """In a child made by ``os.fork()``: the sets counted here are the parent's."""
        self._lock = threading.RLock()  # a parent's thread may have held it at the fork
        self._held = {}
        self._stopping = {}

    def admit(self, holder: _Holder, count: int) -> bool:
        """Reserve *count* processes for *holder*; ``False``: none may be started now.

        Older sets are pushed out to make room. A set larger than the bound is admitted alone,
        so one loader's standby never exceeds its own workers. While sets pushed out earlier
        are still stopping and no room is left, none is admitted (the pass starts its own).
        """
        cap = max_standby_processes()
        if cap == 0 or count <= 0:
            return False
        victims: list[_Holder] = []
        with self._lock:
            self._held.pop(holder, None)
            stopping = sum(self._stopping.values())
            total = stopping + sum(n for n, _ in self._held.values())
            for other in list(self._held):
                if total + count <= cap:
                    break
                victims.append(other)
                total -= self._held.pop(other, (0, 0.0))[0]
            admitted = total + count <= cap or total == 0
            if admitted:
                self._held[holder] = (count, time.monotonic())
        for victim in victims:
            victim.evict()
        return admitted

    def release(self, holder: _Holder) -> None:
        """*holder* holds no set any more (a pass took it, or it is ``stopping``)."""
        with self._lock:
            self._held.pop(holder, None)

    def stopping(self, standby: object, count: int) -> None:
        """*standby*'s *count* processes are being stopped: they count until ``stopped``."""
        with self._lock:
            self._stopping[standby] = count

    def stopped(self, standby: object) -> None:
        with self._lock:
            self._stopping.pop(standby, None)

    def alive(self) -> int:
        """Standby processes reserved, running or stopping now."""
        with self._lock:
            return sum(self._stopping.values()) + sum(n for n, _ in self._held.values())

    def reclaim_idle(self) -> None:
        """Stop the sets that have waited longer than ``standby_idle_s()`` (the reaper's tick)."""
        try:
            limit = standby_idle_s()
        except ValueError:
            return  # a bad setting fails the next loader, not the reaper
        now = time.monotonic()
        with self._lock:
            idle = [h for h, (_, since) in self._held.items() if now - since > limit]
            for holder in idle:
                self._held.pop(holder, None)
        for holder in idle:
            holder.evict()


budget = StandbyBudget()
reaper.idle_hooks.append(budget.reclaim_idle)


def _after_fork_in_child() -> None:
    # A child made by os.fork() holds neither the parent's reaper thread nor its standby sets.
    reaper._reset()
    budget._lock = threading.RLock()
    budget._held.clear()
    budget._stopping.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
