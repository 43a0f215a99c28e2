"""The blocked-loop monitor: :class:`LoopMonitor`, in a plain thread beside a worker's loop.

The loop bumps a heartbeat every few milliseconds; the thread notices when it stops for longer
than a threshold (``ASYNCLOAD_SLOW_CALLBACK`` seconds, 0.1 by default, ``0`` turns it off), reads
the loop thread's stack with :func:`sys._current_frames` and sends a :class:`LoopBlocked` to the
main process through the worker's result path: it keeps working while a sample holds the loop
with a blocking call (``time.sleep``, a sync HTTP client, heavy CPU) inside
``async def __getitem__``. The main process raises a ``BlockedLoopWarning`` once per worker (and
again if a loop stays stuck for ``STUCK_FACTOR`` thresholds) and names the sample in a
``BatchTimeout`` (``_loader.stalls``). The sample is the one whose fetch
(``_dataset.calling.checked_fetch``) is on the loop thread's stack. Samples that await for ever
while the loop turns are ``sample_watch``'s; the parent-death watch is ``_workers.parent_watch``.
"""

from __future__ import annotations

import os
import platform
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

from .._dataset.calling import _FETCH_CODE
from .._exceptions import PACKAGE_DIR
from .cpu_load import schedstat

__all__ = [
    "LoopBlocked",
    "LoopMonitor",
    "inspect_loop",
    "machine_busy",
    "seconds_setting",
    "slow_callback_threshold",
    "start_monitor",
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


def seconds_setting(name: str, default: float, what: str) -> float | None:
    """Seconds from the environment variable *name* (*default* when unset); ``None`` when 0."""
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


def slow_callback_threshold() -> float | None:
    """Seconds a loop may be held before it is reported; ``None``: don't watch."""
    return seconds_setting(ENV_THRESHOLD, DEFAULT_THRESHOLD, "blocked-loop warning")


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
            f"{who} has held the event loop of DataLoader worker {self.worker_id} for at least "
            f"{seconds:.2f} s at {self.location}"
        )

    def warning_text(self) -> str:
        return (
            f"asyncload: {self.describe()}: a blocking call inside async code. Every other "
            "request of this worker waits meanwhile. Await an async client (asyncload.read, "
            "aiohttp, obstore) instead, or run blocking code off the loop with "
            "`await asyncio.to_thread(fn, ...)` or `loop.run_in_executor(None, fn, ...)`; "
            "CPU-heavy work (decode, transforms) can go through `await asyncload.cpu(fn, ...)`, "
            "which runs it on the worker's CPU lane. "
            f"{ENV_THRESHOLD}=<seconds> sets the threshold (0: off). "
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


def _same(a: tuple[int, object] | None, b: tuple[int, object] | None) -> bool:
    """Whether two looks at the loop's stack saw the same sample's fetch (by identity: an index
    may be any object, whose ``==`` need not give a bool)."""
    return a is not None and b is not None and a[0] == b[0] and a[1] is b[1]


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
        self._stat = f"{task}/stat"
        # Where schedstat reads as zeros (some containers), how long the thread ran is unknown:
        # then only the GIL tells a busy machine (``machine_busy``).
        self._ran_known = self._sched()[0] > 0
        self._beat = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="asyncload-loop-monitor")
        self._thread.daemon = True

    def start(self) -> None:
        self._loop.call_soon(self._tick)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _sched(self) -> tuple[float, float]:
        """Seconds the loop thread has run on a CPU, and waited runnable for one (Linux), else
        zeros. A wait still going on is not in the second figure yet: the kernel adds it when
        the thread gets a CPU again."""
        try:
            return schedstat(self._schedstat)
        except (OSError, ValueError):  # (an empty file: too few values to unpack)
            return 0.0, 0.0

    def _runnable(self) -> bool:
        """Whether the loop thread is runnable now: on a CPU or waiting for one (Linux)."""
        try:
            with open(self._stat, "rb") as f:
                return f.read().rsplit(b")", 1)[1].split()[0] == b"R"
        except (OSError, IndexError):
            return False

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

    def _holder(self) -> tuple[int, object] | None:
        """Identifies the sample fetch on the loop thread's stack now (``None``: none)."""
        frame = sys._current_frames().get(self._loop_thread)
        while frame is not None:
            if frame.f_code is _FETCH_CODE:
                # The frame's address alone does not tell two samples apart: the frame object
                # of a sample that finished is freed, and the next sample's is often made at
                # the same address. Its index object, held here, cannot be reused meanwhile.
                return id(frame), frame.f_locals.get("index")
            frame = frame.f_back
        return None

    def _watch(self) -> None:
        warned = stuck_warned = reported = False
        prev = time.monotonic()
        ran_at, waited = self._sched()
        holder: tuple[int, object] | None = None
        since = beat = 0.0
        while not self._stop.wait(self._interval):
            now = time.monotonic()
            late, prev = now - prev - self._interval, now
            ran, wait = self._sched()
            if now - self._beat <= 2 * self._interval:  # the loop turns
                ran_at, waited, holder = ran, wait, None
                if reported:
                    reported = False
                    self._put(LoopBlocked(self._worker_id, ended=True))
                continue
            # One loop iteration may run many short callbacks: only a sample seen on the loop
            # thread's stack at every look, with no heartbeat between, holds the loop.
            current = self._holder()
            if not _same(current, holder) or self._beat != beat:
                holder, since, beat, ran_at = current, now - self._interval, self._beat, ran
            idle = now - self._beat
            # On a busy machine the loop thread may wait for a CPU for a long time: that is not
            # the sample's doing, so time spent runnable but not running is not counted.
            held = (now - since if holder is not None else idle) - (wait - waited)
            stuck = held >= STUCK_FACTOR * self._threshold
            if held <= self._threshold or late > self._threshold / 2:
                # (This thread late too: the process was descheduled, or C code held the GIL.)
                continue
            if (
                not stuck
                and held < 5 * self._threshold
                and machine_busy(
                    held,
                    ran - ran_at if self._ran_known else None,
                    self._runnable,
                    self._waits_on_lock,
                )
            ):
                continue  # (reported once it lasts)
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


def machine_busy(
    held: float, ran: float | None, runnable: Callable[[], bool], on_lock: Callable[[], bool]
) -> bool:
    """Whether a loop thread that held its loop *held* seconds, *ran* of them on a CPU
    (``None``: unknown), was kept from running by a busy machine rather than by its sample.

    Waiting for the GIL (*on_lock*: asleep on a futex), whose holder may itself wait for a
    CPU, is the machine's doing. So is waiting for a CPU: runnable now (*runnable*) and on a
    CPU for less than half the hold. The kernel adds a wait to the thread's figures only when
    it ends, so a wait still going on is not subtracted from *held*; and a thread the GIL's
    hand-off woke is runnable outside the futex for a while (2 of 5 runs of the engine's tests
    on a busy 2-core machine blamed a sample of 8 ms at its ``return`` for 0.12 s). A sample
    that computes runs; one that blocks sleeps in another call: both are its doing.

    Examples:
        >>> never = lambda: False
        >>> machine_busy(0.2, 0.01, runnable=lambda: True, on_lock=never)  # waits for a CPU
        True
        >>> machine_busy(0.2, 0.19, runnable=lambda: True, on_lock=never)  # computes
        False
        >>> machine_busy(0.2, 0.0, runnable=never, on_lock=never)  # sleeps: time.sleep
        False
        >>> machine_busy(0.2, None, runnable=lambda: True, on_lock=never)  # ran: unknown
        False
    """
    return on_lock() or (ran is not None and ran < held / 2 and runnable())


def start_monitor(loop: Any, put: Callable[[object], None], worker_id: int) -> LoopMonitor | None:
    """Start a :class:`LoopMonitor` for *loop* (call in its thread), unless turned off."""
    threshold = slow_callback_threshold()
    if threshold is None:
        return None
    monitor = LoopMonitor(loop, put, worker_id, threshold)
    monitor.start()
    return monitor
