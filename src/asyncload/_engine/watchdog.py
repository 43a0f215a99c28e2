"""Watchdogs that don't depend on the event loop: a blocked-loop monitor and a parent-death watch.

Both run in plain threads, so they keep working while a sample holds the loop with a blocking call
(``time.sleep``, a sync HTTP client, heavy CPU) inside ``async def __getitem__``.

* :class:`LoopMonitor` — the loop bumps a heartbeat every few milliseconds; a thread notices when
  it stops for longer than a threshold (``ASYNCLOAD_SLOW_CALLBACK`` seconds, 0.1 by default, ``0``
  turns it off), reads the loop thread's stack with :func:`sys._current_frames` and sends a
  :class:`LoopBlocked` to the main process through the worker's result path. The main process
  raises a :class:`BlockedLoopWarning` once per worker (and again if a loop stays stuck for
  ``STUCK_FACTOR`` thresholds) and names the sample in a ``BatchTimeout`` (:class:`StallBoard`).
* :class:`SampleWatch` — on the loop itself, every few seconds: a sample fetch that has awaited
  for ``ASYNCLOAD_STUCK_SAMPLE`` seconds (300 by default, ``0`` turns it off) while the loop
  turned is reported once per worker (:class:`SampleStuck`), with the coroutine's stack at its
  current ``await``; the main process raises a :class:`StuckSampleWarning`.
* :func:`watch_parent` — exits a worker whose main process died even when its loop never returns.
* :func:`checked_fetch` — wraps every sample fetch: marks the frames the monitor blames, and
  refuses a sample that is itself a coroutine (an ``await`` forgotten in ``__getitem__``).
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import platform
import signal
import sys
import sysconfig
import threading
import time
import traceback
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

from .._dataset.calling import _FETCH_CODE
from .._exceptions import PACKAGE_DIR, BlockedLoopWarning, StuckSampleWarning, user_stacklevel

__all__ = [
    "LoopBlocked",
    "LoopMonitor",
    "SampleStuck",
    "SampleWatch",
    "StallBoard",
    "parent_alive",
    "slow_callback_threshold",
    "start_sample_watch",
    "stuck_sample_threshold",
    "watch_parent",
]

ENV_THRESHOLD = "ASYNCLOAD_SLOW_CALLBACK"
DEFAULT_THRESHOLD = 0.1
STUCK_FACTOR = 100
"""A loop blocked this many thresholds (10 s by default) is reported again, also after the
once-per-worker warning: with ``timeout=0`` nothing else would say that a worker is stuck."""

# futex(2)'s number, as /proc/<pid>/task/<tid>/syscall shows it.
_FUTEX = {"x86_64": b"202", "aarch64": b"98"}.get(platform.machine())

_LIBRARY_DIRS = tuple(
    {
        os.path.realpath(p)
        for k in ("stdlib", "platstdlib", "purelib", "platlib")
        if (p := sysconfig.get_paths().get(k))
    }
)


ENV_STUCK_SAMPLE = "ASYNCLOAD_STUCK_SAMPLE"
DEFAULT_STUCK_SAMPLE = 300.0


def _seconds(name: str, default: float, what: str) -> float | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(
            f"{name}={raw!r} is not a number: give seconds (e.g. {default:g}), or 0 to turn the "
            f"{what} off"
        ) from None
    return value if value > 0 else None


def stuck_sample_threshold() -> float | None:
    """Seconds a sample may await before it is reported; ``None``: don't watch."""
    return _seconds(ENV_STUCK_SAMPLE, DEFAULT_STUCK_SAMPLE, "stuck-sample warning")


def slow_callback_threshold() -> float | None:
    """Seconds a loop may be held before it is reported; ``None``: don't watch."""
    return _seconds(ENV_THRESHOLD, DEFAULT_THRESHOLD, "blocked-loop warning")


# ── worker side: the monitor ──────────────────────────────────────────────────────────────────


@dataclass(frozen=True, slots=True)
class LoopBlocked:
    """Worker → main: the worker's event loop is held (``ended``: it runs again)."""

    worker_id: int
    ended: bool
    warn: bool = False
    blocked_s: float = 0.0
    dataset: str = ""
    index: str = ""
    location: str = ""
    stack: str = ""

    def describe(self, blocked_s: float | None = None) -> str:
        seconds = self.blocked_s if blocked_s is None else blocked_s
        who = f"sample {self.index} of {self.dataset}" if self.index else "code outside a sample"
        return (
            f"{who} has held the event loop of DataLoader worker {self.worker_id} for "
            f"{seconds:.2f} s at {self.location}"
        )

    def warning_text(self) -> str:
        return (
            f"asyncload: {self.describe()}: a blocking call inside async code. Every other "
            "request of this worker waits meanwhile. Await an async client (asyncload.read, "
            "aiohttp, obstore) instead, or run blocking code off the loop with "
            "`await asyncio.to_thread(fn, ...)` or `loop.run_in_executor(None, fn, ...)`; "
            "CPU-heavy work can go in a plain (sync) __getitem__, which runs in the worker's "
            f"thread pool. {ENV_THRESHOLD}=<seconds> sets the threshold (0: off). "
            f"Stack of the loop thread:\n{self.stack}"
        )


def _is_library(filename: str) -> bool:
    path = os.path.realpath(filename)
    return (
        path.startswith(PACKAGE_DIR) or path.startswith(_LIBRARY_DIRS) or filename.startswith("<")
    )


def inspect_loop(frame: FrameType | None) -> tuple[str, str, str, str] | None:
    """``(dataset, index, location, stack)`` of the sample running in *frame*'s thread."""
    frames: list[FrameType] = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    frames.reverse()  # outermost first
    for pos, f in enumerate(frames):
        if f.f_code is _FETCH_CODE:
            inner = frames[pos + 1 :]
            break
    else:
        return None
    local = f.f_locals
    own = [g for g in inner if not _is_library(g.f_code.co_filename)]
    ours = [g for g in inner if not g.f_code.co_filename.startswith(PACKAGE_DIR)]
    blamed = (own or ours or inner or [f])[-1]
    location = f"{blamed.f_code.co_filename}:{blamed.f_lineno} in {blamed.f_code.co_name}"
    stack = "".join(traceback.format_stack(frames[-1], limit=len(inner) or 1))
    return str(local.get("name", "")), repr(local.get("index")), location, stack.rstrip()


class LoopMonitor:
    """Reports, through *put*, a loop held longer than *threshold* seconds (see module doc).

    Create and :meth:`start` it in the loop's thread, before the loop runs.
    """

    def __init__(
        self,
        loop: Any,
        put: Callable[[object], None],
        worker_id: int,
        threshold: float,
    ) -> None:
        self._loop = loop
        self._put = put
        self._worker_id = worker_id
        self._threshold = threshold
        self._interval = min(threshold / 4, 0.025)
        self._loop_thread = threading.get_ident()
        task = f"/proc/self/task/{threading.get_native_id()}"
        self._schedstat, self._syscall = f"{task}/schedstat", f"{task}/syscall"
        self._beat = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="asyncload-loop-monitor")
        self._thread.daemon = True

    def start(self) -> None:
        self._loop.call_soon(self._tick)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _waited(self) -> float:
        """Seconds the loop thread has spent runnable but not running (Linux), else 0."""
        try:
            with open(self._schedstat, "rb") as f:
                return int(f.read().split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            return 0.0

    def _waits_on_lock(self) -> bool:
        """Whether the loop thread sleeps on a futex: most likely the GIL (Linux only)."""
        try:
            with open(self._syscall, "rb") as f:
                return f.read().split()[0] == _FUTEX
        except (OSError, IndexError):
            return False

    def _tick(self) -> None:
        self._beat = time.monotonic()
        if not self._stop.is_set():
            self._loop.call_later(self._interval, self._tick)

    def _holder(self) -> int | None:
        """Identifies the sample fetch on the loop thread's stack now (``None``: none)."""
        frame = sys._current_frames().get(self._loop_thread)
        while frame is not None:
            if frame.f_code is _FETCH_CODE:
                return id(frame)
            frame = frame.f_back
        return None

    def _watch(self) -> None:
        warned = stuck_warned = reported = False
        prev = time.monotonic()
        waited = self._waited()
        holder: int | None = None
        since = beat = 0.0
        while not self._stop.wait(self._interval):
            now = time.monotonic()
            late, prev = now - prev - self._interval, now
            if now - self._beat <= 2 * self._interval:  # the loop turns
                waited, holder = self._waited(), None
                if reported:
                    reported = False
                    self._put(LoopBlocked(self._worker_id, ended=True))
                continue
            # One loop iteration may run many short callbacks: only a sample seen on the loop
            # thread's stack at every look, with no heartbeat between, holds the loop.
            current = self._holder()
            if current != holder or self._beat != beat:
                holder, since, beat = current, now - self._interval, self._beat
            idle = now - self._beat
            # On a busy machine the loop thread may wait for a CPU for a long time: that is not
            # the sample's doing, so time spent runnable but not running is not counted.
            held = (now - since if holder is not None else idle) - (self._waited() - waited)
            stuck = held >= STUCK_FACTOR * self._threshold
            if held <= self._threshold or late > self._threshold / 2:
                # (This thread late too: the process was descheduled, or C code held the GIL.)
                continue
            if not stuck and held < 5 * self._threshold and self._waits_on_lock():
                # Waiting for the GIL, whose holder may itself wait for a CPU: a busy machine,
                # not a blocking call (a lock held this long is reported once it lasts).
                continue
            if reported and (stuck_warned or not stuck):
                continue
            frame = sys._current_frames().get(self._loop_thread)
            found = inspect_loop(frame)
            if found is None and not stuck:
                continue  # collate, or asyncload's own code: not a sample's blocking call
            dataset, index, location, stack = found or ("", "", "?", "")
            if found is None:
                stack = "".join(traceback.format_stack(frame)).rstrip() if frame else ""
            warn = not warned or (stuck and not stuck_warned)
            warned = True
            stuck_warned = stuck_warned or (stuck and warn)
            reported = True
            self._put(
                LoopBlocked(self._worker_id, False, warn, held, dataset, index, location, stack)
            )


def start_monitor(loop: Any, put: Callable[[object], None], worker_id: int) -> LoopMonitor | None:
    """Start a :class:`LoopMonitor` for *loop* (call in its thread), unless turned off."""
    threshold = slow_callback_threshold()
    if threshold is None:
        return None
    monitor = LoopMonitor(loop, put, worker_id, threshold)
    monitor.start()
    return monitor


# ── worker side: samples that await for ever ──────────────────────────────────────────────────


@dataclass(frozen=True, slots=True)
class SampleStuck:
    """Worker → main: a sample's fetch has awaited for *waited_s* seconds, the loop turning."""

    worker_id: int
    waited_s: float
    dataset: str
    index: str
    stack: str

    def warning_text(self) -> str:
        return (
            f"asyncload: sample {self.index} of {self.dataset} in DataLoader worker "
            f"{self.worker_id} has awaited for {self.waited_s:.0f} s without finishing (the "
            "event loop runs: something it awaits never completes, such as a request without a "
            "timeout, a future nobody sets or a lock never released). With timeout=0 the "
            "DataLoader waits for it for ever; give the await a timeout "
            "(`async with asyncio.timeout(...)`), or DataLoader(timeout=...). "
            f"{ENV_STUCK_SAMPLE}=<seconds> sets the threshold (0: off). Where it waits:\n"
            f"{self.stack}"
        )


def _await_chain(coro: Any) -> list[Any]:
    """*coro* and what it awaits, outermost first (coroutines, generators, async generators)."""
    chain: list[Any] = []
    while coro is not None and len(chain) < 200:
        chain.append(coro)
        coro = (
            getattr(coro, "cr_await", None)
            or getattr(coro, "gi_yieldfrom", None)
            or getattr(coro, "ag_await", None)
        )
    return chain


def _describe_await(chain: list[Any]) -> str:
    lines = []
    for c in chain:
        frame = getattr(c, "cr_frame", None) or getattr(c, "gi_frame", None)
        frame = frame or getattr(c, "ag_frame", None)
        if frame is not None:
            code = frame.f_code
            lines.append(f'  File "{code.co_filename}", line {frame.f_lineno}, in {code.co_name}')
        else:
            lines.append(f"  awaiting {type(c).__qualname__}: {c!r:.200}")
    return "\n".join(lines)


class SampleWatch:
    """Reports, through *put*, the first sample fetch that awaits longer than *threshold*.

    Runs on the loop (a timer every quarter threshold, at most every 5 s): the fetches it saw
    last time and still sees have not finished since; nothing is added to a sample's path.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        put: Callable[[object], None],
        worker_id: int,
        threshold: float,
    ) -> None:
        self._loop = loop
        self._put = put
        self._worker_id = worker_id
        self._threshold = threshold
        self._interval = min(threshold / 4, 5.0)
        self._seen: dict[int, tuple[float, weakref.ref[Any]]] = {}
        self._handle: asyncio.TimerHandle | None = None
        self._warned = False

    def start(self) -> None:
        self._handle = self._loop.call_later(self._interval, self._check)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()

    def _check(self) -> None:
        now = time.monotonic()
        seen: dict[int, tuple[float, weakref.ref[Any]]] = {}
        oldest: tuple[float, list[Any]] | None = None
        for task in asyncio.all_tasks(self._loop):
            chain = _await_chain(task.get_coro())
            pos = next(
                (i for i, c in enumerate(chain) if getattr(c, "cr_code", None) is _FETCH_CODE),
                None,
            )
            if pos is None:
                continue
            coro = chain[pos]
            key = id(coro)
            known = self._seen.get(key)
            since = known[0] if known is not None and known[1]() is coro else now
            seen[key] = (since, weakref.ref(coro))
            if oldest is None or since < oldest[0]:
                oldest = (since, chain[pos:])
        self._seen = seen
        if oldest is not None and now - oldest[0] >= self._threshold and not self._warned:
            self._warned = True  # once per worker
            fetch = oldest[1][0]
            local = fetch.cr_frame.f_locals if fetch.cr_frame is not None else {}
            self._put(
                SampleStuck(
                    self._worker_id,
                    now - oldest[0],
                    str(local.get("name", "")),
                    repr(local.get("index")),
                    _describe_await(oldest[1]),
                )
            )
        if not self._warned:
            self._handle = self._loop.call_later(self._interval, self._check)


def start_sample_watch(
    loop: asyncio.AbstractEventLoop, put: Callable[[object], None], worker_id: int
) -> SampleWatch | None:
    """Start a :class:`SampleWatch` on *loop*, unless turned off."""
    threshold = stuck_sample_threshold()
    if threshold is None:
        return None
    watch = SampleWatch(loop, put, worker_id, threshold)
    watch.start()
    return watch


# ── main side ─────────────────────────────────────────────────────────────────────────────────


class StallBoard:
    """The main process's view of its workers' blocked loops."""

    def __init__(self) -> None:
        # A bad ASYNCLOAD_SLOW_CALLBACK or ASYNCLOAD_STUCK_SAMPLE fails here, not in a worker.
        slow_callback_threshold()
        stuck_sample_threshold()
        self._held: dict[int, tuple[LoopBlocked, float]] = {}

    def take(self, msg: object) -> bool:
        """Handle *msg* if it is a :class:`LoopBlocked` or :class:`SampleStuck` (warn,
        remember); else ``False``."""
        if isinstance(msg, SampleStuck):
            warnings.warn(msg.warning_text(), StuckSampleWarning, stacklevel=user_stacklevel())
            return True
        if not isinstance(msg, LoopBlocked):
            return False
        if msg.ended:
            self._held.pop(msg.worker_id, None)
            return True
        self._held[msg.worker_id] = (msg, time.monotonic())
        if msg.warn:
            warnings.warn(msg.warning_text(), BlockedLoopWarning, stacklevel=user_stacklevel())
        return True

    def describe(self) -> str | None:
        """Which samples hold a loop now, for a ``BatchTimeout``; ``None`` if none."""
        if not self._held:
            return None
        now = time.monotonic()
        parts = [m.describe(m.blocked_s + now - t) for m, t in self._held.values()]
        return (
            "; ".join(parts)
            + " (a blocking call inside async code holds the loop: await an async client, or "
            "use asyncio.to_thread for blocking code)"
        )


# ── worker side: the parent-death watch ───────────────────────────────────────────────────────


def parent_alive(main_pid: int, ppid: int) -> bool:
    """Whether the main process *main_pid* lives (our parent *ppid* unchanged, not a zombie)."""
    # Under forkserver our parent is the server, which outlives the main process while any
    # worker lives; so check the main process itself, and count a zombie (dead, not yet reaped
    # by its own parent) as dead.
    if os.getppid() != ppid:
        return False
    try:
        os.kill(main_pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:
        with open(f"/proc/{main_pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no procfs (macOS): the kill() probe above is all we have
    return state not in (b"Z", b"X")


# Once the main process is gone the worker's own shutdown gets this long, then it is cut short.
ORPHAN_GRACE = 2.0
_PR_SET_PDEATHSIG = 1


def _set_pdeathsig() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        pass


_watching = 0  # the main process this one watches (watch_parent), once


def watch_parent(main_pid: int, interval: float = 0.25) -> None:
    """Exit this worker process when the main process dies, whatever its event loop does.

    Under ``forkserver`` our parent is the server, which exits with the main process: the kernel
    then kills us at once (``PR_SET_PDEATHSIG``). A thread also polls the main process, and
    ends the process ``ORPHAN_GRACE`` seconds after its death, time for a clean shutdown.
    """
    global _watching
    if _watching == main_pid:  # a standby worker started watching before its config came
        return
    _watching = main_pid
    ppid = os.getppid()
    if sys.platform == "linux" and ppid != main_pid:
        # Only when the parent is the forkserver: under fork the signal would follow the
        # *thread* that started us, which may end long before the main process does.
        _set_pdeathsig()
    if not parent_alive(main_pid, ppid):
        os._exit(0)

    def watch() -> None:
        while parent_alive(main_pid, ppid):
            time.sleep(interval)
        time.sleep(ORPHAN_GRACE)
        os._exit(0)

    threading.Thread(target=watch, name="asyncload-parent-watch", daemon=True).start()
