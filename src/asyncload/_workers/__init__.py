"""Where a pass's engines run, behind one small protocol: worker processes, or one thread.

:class:`~asyncload._pass.Pass` talks to a :class:`Workers` object only; it never knows which
kind it has. Each implementation does, in one place, what differs between them: how a message
reaches an engine, where a reply is unpacked and pinned (``get``), how liveness is checked and
how the engines are stopped (NOTE [ Data flow and shutdown ] in ``_protocol.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from .._engine import WorkerConfig
from .._stats import RecorderSnapshot

__all__ = ["Workers", "start_workers"]


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

    def send(self, worker_id: int, msg: object) -> None:
        """Hand *msg* to engine *worker_id* (never blocks for long)."""

    def get(self, timeout: float) -> object | None:
        """The next reply from any engine, unpacked and (``pin_memory``) pinned; ``None`` after
        *timeout* seconds. Raises :class:`~asyncload.WorkerError` when an engine died."""

    def check_alive(self) -> None:
        """Raise :class:`~asyncload.WorkerError` if an engine (or the pin thread) is gone."""

    def close(self) -> None:
        """Stop every engine and release its resources; safe to call more than once."""


def start_workers(
    configs: list[WorkerConfig],
    *,
    in_thread: bool,
    pin_device: str | None,
    context: Any,
    shm_blocks: int,
    sent_objects: dict[str, Any],
) -> Workers:
    """Start the engines for *configs*: one thread (``in_thread``), else one process each."""
    if in_thread:
        from ._thread import ThreadWorkers

        return ThreadWorkers(configs[0], pin_device=pin_device)
    from .._context import resolve_context
    from ._processes import ProcessWorkers

    return ProcessWorkers(
        configs,
        context=resolve_context(context),
        pin_device=pin_device,
        shm_blocks=shm_blocks,
        sent_objects=sent_objects,
    )
