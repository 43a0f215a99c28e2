"""Which share of the data belongs to this rank and this worker.

A training job has ``world_size`` ranks (processes under torchrun), each with ``num_workers``
loader workers. Item *i* of a replicated iterable belongs to the global worker
``rank * num_workers + worker_id`` when ``i % (world_size * num_workers)`` equals it. This is the
one rule; ``shard`` applies it and ``get_worker_info`` reports the numbers it uses.
"""

from __future__ import annotations

import itertools
import logging
import os
import warnings
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, overload

import numpy as np

__all__ = [
    "WorkerInfo",
    "get_worker_info",
    "rank_and_world_size",
    "rank_sampler",
    "shard",
    "shard_position",
]

log = logging.getLogger("asyncload")

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """Facts about the worker this code runs in; see [`get_worker_info`][asyncload.get_worker_info].

    The first four fields are torch's ``WorkerInfo`` fields with the same meaning.

    Examples:
        >>> info = asyncload.get_worker_info()  # doctest: +SKIP
        >>> info.id, info.num_workers, info.rank, info.world_size  # doctest: +SKIP
        (1, 2, 0, 1)
    """

    id: int
    """This worker's id, ``0 <= id < num_workers``."""
    num_workers: int
    """Workers per rank."""
    seed: int
    """The seed this worker's ``random``, ``torch`` and NumPy generators were seeded with."""
    dataset: Any
    """This worker's copy of the dataset."""
    rank: int = 0
    """This process's rank in the training job (0 without distributed training)."""
    world_size: int = 1
    """Number of ranks in the training job (1 without distributed training)."""


# Per process: a worker process is one worker (the child sets it at start-up), and the
# dataset code that asks (get_worker_info, shard) has no handle to be passed it, as in torch.
_worker_info: WorkerInfo | None = None


def get_worker_info() -> WorkerInfo | None:
    """The [`WorkerInfo`][asyncload.WorkerInfo] of the calling worker; ``None`` in the main process.

    ``torch.utils.data.get_worker_info()`` also works inside asyncload workers.
    """
    return _worker_info


def _set_worker_info(info: WorkerInfo | None) -> None:
    global _worker_info
    _worker_info = info


def rank_and_world_size() -> tuple[int, int]:
    """Rank and world size: from ``torch.distributed`` when initialised, else ``RANK`` and
    ``WORLD_SIZE`` from the environment (as torchrun sets them), else ``(0, 1)``."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    try:
        rank = int(os.environ.get("RANK", "0"))
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError as exc:
        raise ValueError(f"RANK and WORLD_SIZE must be integers: {exc}") from None
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"invalid RANK={rank} for WORLD_SIZE={world}")
    return rank, world


def shard_position() -> tuple[int, int]:
    """``(index, count)`` of this worker among every worker of every rank."""
    info = _worker_info
    if info is not None:
        return info.rank * info.num_workers + info.id, info.world_size * info.num_workers
    return rank_and_world_size()


@overload
def shard(items: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]: ...
@overload
def shard(items: Sequence[T]) -> Sequence[T]: ...
@overload
def shard(items: AsyncIterable[T]) -> AsyncIterator[T]: ...
@overload
def shard(items: Iterable[T]) -> Iterable[T]: ...
def shard(items: Any) -> Any:
    """Return this worker's (and this rank's) share of *items*.

    An iterable dataset is copied into every worker; iterate ``shard(...)`` instead of the full
    list and each item is yielded by exactly one worker of one rank. Sequences and NumPy arrays are
    sliced (a view, no copy); other iterables and async iterables are filtered lazily.

    Examples:
        >>> class Urls(asyncload.IterableDataset):
        ...     def __init__(self, urls):
        ...         self.urls = urls
        ...     async def __aiter__(self):
        ...         for url in asyncload.shard(self.urls):
        ...             yield await asyncload.read(url)
    """
    index, count = shard_position()
    if count == 1:
        return items
    if isinstance(items, (Sequence, np.ndarray)) and not isinstance(items, (str, bytes)):
        return items[index::count]
    if isinstance(items, AsyncIterable):
        return _ashard(items, index, count)
    return itertools.islice(items, index, None, count)


async def _ashard(items: AsyncIterable[T], index: int, count: int) -> AsyncIterator[T]:
    i = 0
    async for item in items:
        if i % count == index:
            yield item
        i += 1


# Per process: the partition is logged at INFO once per process, not once per loader.
_announced = False


def rank_sampler(
    dataset: Any, *, rank: int, world_size: int, shuffle: bool, seed: int, drop_last: bool
) -> Any:
    """The ``DistributedSampler`` ``DataLoader(auto_shard=True)`` adds under torchrun.

    Says what it does: the partition is logged (INFO, once per process; DEBUG after that), and
    a share padded with repeated samples warns, since an evaluation over it counts them twice.
    """
    global _announced
    import torch.utils.data

    from .._exceptions import AsyncloadWarning

    sampler: torch.utils.data.DistributedSampler[Any] = torch.utils.data.DistributedSampler(
        dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
    )
    total = len(dataset)
    log.log(
        logging.DEBUG if _announced else logging.INFO,
        "asyncload: WORLD_SIZE=%d, so this DataLoader reads rank %d's share of its dataset: "
        "%d of %d samples (a DistributedSampler, shuffle=%s, drop_last=%s). Pass "
        "auto_shard=False to read the whole dataset on this rank.",
        world_size,
        rank,
        sampler.num_samples,
        total,
        shuffle,
        drop_last,
    )
    _announced = True
    padded = sampler.total_size - total
    if padded > 0:
        warnings.warn(
            f"asyncload: {total} samples don't split evenly over WORLD_SIZE={world_size} ranks, "
            f"so the automatic DistributedSampler repeats {padded} of them to give every rank "
            f"{sampler.num_samples}; an evaluation over this loader counts those twice. Pass "
            "auto_shard=False to read the whole dataset on this rank (rank-0-only evaluation), "
            "drop_last=True to drop the tail instead, or a sampler of your own.",
            AsyncloadWarning,
            stacklevel=4,
        )
    return sampler
