"""Where a pass's engines run, behind one small protocol: worker processes, or one thread.

``_loader.pass_iterator.Pass`` talks to a ``Workers`` object only; it never knows which
kind it has. Each implementation does, in one place, what differs between them: how a message
reaches an engine, where a reply is unpacked and pinned (``get``), how liveness is checked and
how the engines are stopped (NOTE [ Data flow and shutdown ] in ``_protocol/messages.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from .._stats.loader_stats import RecorderSnapshot
from .standby import StandbySlot

__all__ = ["StandbySlot", "Workers"]


class Workers(Protocol):
    """The engines of one pass (or, with persistent workers, of every pass of an iterator)."""

    count: int
    """How many engines; worker ids are ``range(count)``."""
    live_stats: Callable[[], RecorderSnapshot] | None
    """Counters read live (an engine in this process), or ``None``: they ride on replies."""

    @property
    def pids(self) -> tuple[int, ...]:
        """The worker processes' pids (empty for an engine in a thread)."""
        ...

    @property
    def processes(self) -> tuple[Any, ...]:
        """The worker processes (``multiprocessing`` objects, kept once stopped; none for an
        engine in a thread)."""
        ...

    def send(self, worker_id: int, msg: object) -> None:
        """Hand *msg* to engine *worker_id* (never blocks for long)."""

    def get(self, timeout: float) -> object | None:
        """The next reply from any engine, unpacked and (``pin_memory``) pinned; ``None`` after
        *timeout* seconds. Raises [`WorkerError`][asyncload.WorkerError] when an engine died."""

    def check_alive(self) -> None:
        """Raise [`WorkerError`][asyncload.WorkerError] if an engine (or the pin thread) is gone."""

    def prepare_next(self) -> None:
        """The pass has sent its last task: get the next pass's engines ready meanwhile
        (``_workers.standby``; nothing for one thread, or with persistent workers)."""

    def close(self) -> None:
        """Stop every engine and release its resources; safe to call more than once.

        Called on the reaper thread only (NOTE [ Who stops workers ] in ``_workers/reaper.py``)."""
