"""From a ``DataLoader``'s arguments to a pass's settings: ``pass_spec`` builds the frozen
``spec.PassSpec`` each pass gets.

What the loader derives rather than holds: how many batches each worker keeps out
(``prefetch_factor``'s default follows from ``max_concurrency``), which device batches are
pinned for, with torch's warnings word for word, and where a pass's adaptive limits start
(where the last pass's workers got to). ``pass_spec`` works on the loader's own fields, as
``state`` does; what a pass then changes for an elastic resume stays with the loader.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
import torch.utils.data

from .._engine.slots import learned_from, most_in_flight
from .._workers.pin_memory import accelerator_device
from .spec import PassSpec

__all__ = ["always_out_per_worker", "outstanding_per_worker", "pass_spec"]


def outstanding_per_worker(
    prefetch_factor: int | None, max_concurrency: int | None, num_workers: int, per_batch: int
) -> int:
    """Batches each worker keeps out: ``prefetch_factor`` where given, else enough that
    ``max_concurrency`` samples are in flight, plus one being collated or in transit.

    Examples:
        >>> outstanding_per_worker(None, 128, num_workers=2, per_batch=32)
        5
        >>> outstanding_per_worker(2, 128, num_workers=2, per_batch=32)
        2
    """
    if prefetch_factor is not None:
        return prefetch_factor
    return math.ceil(most_in_flight(max_concurrency, num_workers) / per_batch) + 1


TORCH_PREFETCH_FACTOR = 2
"""torch's default ``prefetch_factor``: batches per worker out, whatever their size."""


def always_out_per_worker(prefetch_factor: int | None, outstanding: int) -> int:
    """Batches each worker may have out whatever bytes they hold (``_loader.lookahead``): all
    *outstanding* where ``prefetch_factor`` is given, as torch's loader has them; by default
    torch's 2, and more only while their bytes fit in ``prefetch_bytes``.

    Examples:
        >>> always_out_per_worker(None, 9)
        2
        >>> always_out_per_worker(9, 9)
        9
    """
    if prefetch_factor is not None:
        return outstanding
    return min(TORCH_PREFETCH_FACTOR, outstanding)


def pass_spec(loader: Any) -> PassSpec:
    """The next pass's settings, from *loader*'s (an ``asyncload.DataLoader``).

    Called from ``DataLoader._get_iterator``: the warnings' ``stacklevel`` counts on that, to
    point at the caller's ``for`` or ``iter``.
    """
    if loader.pin_memory and loader.pin_memory_device:
        warnings.warn(
            "pin_memory_device is deprecated, the current accelerator will be used as the "
            f"device, ignore pin_memory_device='{loader.pin_memory_device}'.",
            stacklevel=4,
        )
    pin_device = accelerator_device() if loader.pin_memory else None
    if loader.pin_memory and pin_device is None:
        _warn_no_accelerator()
    return PassSpec(
        dataset=loader.dataset,
        is_iterable=isinstance(loader.dataset, torch.utils.data.IterableDataset),
        auto_collation=loader._auto_collation,
        index_sampler=loader._index_sampler,
        batch_size=loader.batch_size,
        drop_last=loader.drop_last,
        collate_fn=loader.collate_fn,
        worker_init_fn=loader.worker_init_fn,
        num_workers=loader.num_workers,
        worker_options=loader._worker_options,
        outstanding_per_worker=loader._outstanding_per_worker,
        always_out_per_worker=loader._always_out_per_worker,
        batch_sizes=loader._batch_sizes,
        in_order=loader.in_order,
        timeout=loader.timeout,
        persistent=loader.persistent_workers,
        pin_device=pin_device,
        generator=loader.generator,
        multiprocessing_context=loader.multiprocessing_context,
        prefetch_bytes=loader.prefetch_bytes,
        sample_errors=loader._sample_errors,
        standby=loader._standby,
        learned_limit=_learned_limit(loader),
    )


def _learned_limit(loader: Any) -> Any:
    """Where the next pass's adaptive limits start: where the last pass's workers got to
    (no slow start again, and a store's throttle remembered), or ``None``."""
    if loader.max_concurrency is not None:
        return None
    return learned_from(list(loader._learned.values()), max(1, loader.num_workers))


_warned_pin = False


def _warn_no_accelerator() -> None:
    global _warned_pin
    if not _warned_pin:
        _warned_pin = True
        warnings.warn(
            "'pin_memory' argument is set as true but no accelerator is found, "
            "then device pinned memory won't be used.",
            stacklevel=5,
        )
