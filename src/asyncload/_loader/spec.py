"""What a pass needs from its loader, as values: ``PassSpec``, and torch's length rules."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .._dataset.sample_errors import SampleErrorPolicy
from .._engine.options import WorkerOptions

if TYPE_CHECKING:
    from .lookahead import BatchSizes

_RAISE = SampleErrorPolicy()  # today's behaviour: a failing sample fails its batch

__all__ = ["PassSpec", "length_warning", "spec_length"]


@dataclass(frozen=True)
class PassSpec:
    """What a pass needs from its loader, as values (the loader's arguments, resolved)."""

    dataset: Any
    is_iterable: bool
    auto_collation: bool
    index_sampler: Any
    batch_size: int | None
    drop_last: bool
    collate_fn: Callable[[Any], Any]
    worker_init_fn: Callable[[int], None] | None
    num_workers: int
    worker_options: WorkerOptions
    """What every worker reads as given (``_engine/options.py``)."""
    outstanding_per_worker: int
    """Batches per worker in progress at most (the fixed window, ``_loader.lookahead``)."""
    in_order: bool
    timeout: float
    persistent: bool
    pin_device: str | None
    generator: torch.Generator | None
    multiprocessing_context: Any = None
    prefetch_bytes: int = 1 << 30
    """Bytes the batches out may hold, beyond ``always_out_per_worker`` batches per worker
    (``_loader.lookahead``)."""
    always_out_per_worker: int = 0
    """Batches per worker that may be out whatever bytes they hold; 0: the whole window."""
    batch_sizes: BatchSizes | None = None
    """The loader's ``_loader.lookahead.BatchSizes``, shared by its passes (``None``: this
    pass's own)."""

    sample_errors: SampleErrorPolicy = _RAISE
    learned_limit: Any = None
    """Where each worker's adaptive limit starts: what the last pass's workers learned
    (``_engine.slots.learned_from``); ``None``: from the start."""
    reader_plans: tuple[Any, ...] | None = None
    """Per worker, the units a re-dealt iterable pass reads (``_checkpoint.elastic_iter``)."""
    standby: Any = None
    """The loader's ``_workers._standby.StandbySlot``: worker processes started before the
    pass that takes them (the first pass's when the loader is built; without persistent
    workers, each next pass's during the one before)."""


def spec_length(spec: PassSpec) -> int:
    """``len(loader)``, taken only when asked: an IterableDataset's ``__len__`` may raise
    TypeError (every IterDataPipe without a length does), and iterating must still work."""
    if not spec.is_iterable:
        return len(spec.index_sampler)
    length = len(spec.dataset)
    if spec.batch_size is not None and spec.auto_collation:
        return length // spec.batch_size if spec.drop_last else -(-length // spec.batch_size)
    return length


def length_warning(spec: PassSpec, reported: int, yielded: int) -> str:
    """torch's warning when an IterableDataset yields more than ``len(loader)`` said, word for
    word: code and tests match on it."""
    text = (
        f"Length of IterableDataset {spec.dataset} was reported to be {reported}"
        f"(when accessing len(dataloader)), but {yielded} samples have been fetched. "
    )
    if spec.num_workers > 0:
        text += (
            "For multiprocessing data-loading, this could be caused by not properly "
            "configuring the IterableDataset replica at each worker. Please see "
            "https://pytorch.org/docs/stable/data.html#torch.utils.data.IterableDataset "
            "for examples."
        )
    return text
