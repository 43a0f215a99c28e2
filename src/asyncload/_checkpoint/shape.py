"""What a checkpoint depends on of a loader, as a value the loader builds (``LoaderShape``).

Saving, loading and re-dealing a checkpoint read the loader's arguments (dataset, sampler,
batch size, world size, ...) and never the loader itself: this layer sits below it, and a
value can be built in a test without one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["LoaderShape"]


@dataclass(frozen=True, slots=True)
class LoaderShape:
    """A loader's arguments that its checkpoints depend on.

    Examples:
        >>> shape = LoaderShape(
        ...     dataset=range(10), sampler=range(10), batch_sampler=None, generator=None,
        ...     batch_size=4, auto_collation=True, drop_last=False, num_workers=2,
        ...     rank=0, world_size=1, elastic=False,
        ... )
        >>> shape.per_batch
        4
    """

    dataset: Any
    sampler: Any
    batch_sampler: Any
    generator: torch.Generator | None
    batch_size: int | None
    auto_collation: bool
    drop_last: bool
    num_workers: int
    rank: int
    world_size: int
    elastic: bool
    """The sampler is the loader's own over a map-style dataset (``auto_shard``): a
    checkpoint may resume with another world size (``elastic_map``)."""

    @property
    def per_batch(self) -> int:
        """Samples per index task: the batch size, or 1 without automatic batching."""
        return self.batch_size if self.auto_collation and self.batch_size else 1

    @property
    def iterable(self) -> bool:
        """The dataset is an ``IterableDataset``."""
        return isinstance(self.dataset, torch.utils.data.IterableDataset)
