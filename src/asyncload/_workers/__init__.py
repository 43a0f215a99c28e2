"""Where a pass's engines run, behind one small protocol: worker processes, or one thread.

``_pass.Pass`` talks to a ``Workers`` object only; it never knows which
kind it has. Each implementation does, in one place, what differs between them: how a message
reaches an engine, where a reply is unpacked and pinned (``get``), how liveness is checked and
how the engines are stopped (NOTE [ Data flow and shutdown ] in ``_protocol.py``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Protocol

from .. import _sharding
from .._engine import WorkerConfig
from .._spec import PassSpec
from .._stats import RecorderSnapshot
from ._reaper import reaper
from ._standby import StandbySlot

__all__ = ["StandbySlot", "Workers", "reaper", "start_workers"]


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
        (``_standby``; nothing for one thread, or with persistent workers)."""

    def close(self) -> None:
        """Stop every engine and release its resources; safe to call more than once.

        Called on the reaper thread only (NOTE [ Who stops workers ] in ``_reaper.py``)."""


def start_workers(
    spec: PassSpec, *, base_seed: int, skips: list[int], shared_seed: int | None
) -> Workers:
    """Start a pass's engines: one thread for ``num_workers=0``, else one process each.

    Args:
        spec: The pass's settings.
        base_seed: Worker *i* seeds its RNGs with ``base_seed + i``, as in torch.
        skips: Per worker, samples of an iterable dataset to skip (resuming a checkpoint).
        shared_seed: An ``IterDataPipe``'s shuffle seed, the same in every worker.
    """
    rank, world = _sharding.rank_and_world_size()
    configs = [
        WorkerConfig(
            worker_id=i,
            num_workers=max(1, spec.num_workers),
            base_seed=base_seed,
            dataset=spec.dataset,
            is_iterable=spec.is_iterable,
            auto_collation=spec.auto_collation,
            batch_size=spec.batch_size,
            drop_last=spec.drop_last,
            collate_fn=spec.collate_fn,
            worker_init_fn=spec.worker_init_fn,
            max_concurrency=spec.max_concurrency,
            rank=rank,
            world_size=world,
            storage_config=None,
            main_pid=os.getpid(),
            skip=skip,
            shared_seed=shared_seed,
            skip_sample_errors=spec.sample_errors.skips,
            plan=spec.reader_plans[i] if spec.reader_plans is not None else None,
        )
        for i, skip in enumerate(skips)
    ]
    if spec.num_workers == 0:
        from ._thread import ThreadWorkers

        return ThreadWorkers(configs[0], pin_device=spec.pin_device)
    from .._context import resolve_context
    from ._processes import ProcessWorkers

    sent_objects = {
        "dataset": spec.dataset,
        "collate_fn": spec.collate_fn,
        "worker_init_fn": spec.worker_init_fn,
    }
    return ProcessWorkers(
        configs,
        # The objects let the start method be checked against __main__ (see _guards).
        context=resolve_context(spec.multiprocessing_context, sent_objects),
        pin_device=spec.pin_device,
        # Per worker, a batch in flight or kept by the loop holds a block or two; beyond
        # that, torch's path (NOTE [ Reused shared memory ]).
        shm_blocks=4 * spec.outstanding_per_worker + 8,
        sent_objects=sent_objects,
        standby=spec.standby,
        next_pass=not spec.persistent,
    )
