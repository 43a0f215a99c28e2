"""Start a pass's engines from its settings: the one place a ``PassSpec`` becomes the
``WorkerConfig`` each engine gets. (A loader argument that the workers read does not pass
through here: it is a field of ``_engine/options.py``'s ``WorkerOptions``, carried whole.)"""

from __future__ import annotations

import os

from .._dataset import sharding as _sharding
from .._engine import WorkerConfig
from .._workers import Workers
from .spec import PassSpec

__all__ = ["start_workers"]


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
            options=spec.worker_options,
            rank=rank,
            world_size=world,
            storage_config=None,
            main_pid=os.getpid(),
            skip=skip,
            shared_seed=shared_seed,
            plan=spec.reader_plans[i] if spec.reader_plans is not None else None,
            learned_limit=spec.learned_limit,
        )
        for i, skip in enumerate(skips)
    ]
    if spec.num_workers == 0:
        from .._workers.thread import ThreadWorkers

        return ThreadWorkers(configs[0], pin_device=spec.pin_device)
    from .._workers.processes import ProcessWorkers
    from .._workers.start_method.context import resolve_context

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
