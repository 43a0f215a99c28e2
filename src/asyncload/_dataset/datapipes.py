"""What torch's DataLoader does to a DataPipe in each worker, done the same way here.

torch (``dataloader.py``, ``_utils/worker.py``) shards an ``IterDataPipe``/``MapDataPipe`` over
every worker of every rank with ``graph_settings.apply_sharding``, and seeds an
``IterDataPipe``'s shuffles with ``apply_random_seed`` from a seed the main process draws from
the loader's generator (the same in every worker, new every pass). Other datasets are left
alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import IterDataPipe, MapDataPipe, graph_settings

__all__ = ["Placement"]


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a worker sits among every worker of every rank."""

    worker_id: int
    num_workers: int
    rank: int
    world_size: int

    def shard(self, dataset: Any) -> None:
        """Keep this worker's share of a DataPipe (rank-major interleaving, as torch does)."""
        if isinstance(dataset, (IterDataPipe, MapDataPipe)):
            graph_settings.apply_sharding(
                dataset,
                self.num_workers * self.world_size,
                self.worker_id * self.world_size + self.rank,
            )

    def seed(self, dataset: Any, shared_seed: int | None) -> None:
        """Seed an IterDataPipe's shuffles with the seed every worker shares."""
        if isinstance(dataset, IterDataPipe) and shared_seed is not None:
            graph_settings.apply_random_seed(dataset, torch.Generator().manual_seed(shared_seed))
