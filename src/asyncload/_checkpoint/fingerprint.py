"""What a checkpoint's resume depends on, so that a mismatched loader is refused, not fed wrong.

A checkpoint records *where* a pass stands (batch ordinals, per-worker counts); that position
means the same samples only if the loader that resumes it batches and orders the data the same
way. ``fingerprint`` lists those facts; ``check`` compares a saved list with the current one and
raises ``ValueError`` naming every fact that differs, with both values.

What may change across a resume: ``num_workers`` (map-style, and iterable datasets that can be
re-dealt, ``_checkpoint.elastic_iter``), ``in_order``, ``timeout``,
``max_concurrency``, ``prefetch_factor``, ``pin_memory``, and the world size when the loader
added the ``DistributedSampler`` itself (``auto_shard``; see ``_checkpoint/elastic_map.py``). What
may not: the fields below.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils.data

from .elastic_iter import ElasticIterable
from .shape import LoaderShape

__all__ = ["check", "fingerprint"]


def _length(obj: Any) -> int | None:
    try:
        return len(obj)
    except Exception:  # an IterableDataset without a length: nothing to compare
        return None


def _seed(obj: Any) -> int | None:
    """The seed a sampler or dataset shuffles with, where it says so."""
    generator = getattr(obj, "generator", None)
    if isinstance(generator, torch.Generator):
        return int(generator.initial_seed())
    seed = getattr(obj, "seed", None)
    return seed if type(seed) is int else None


def fingerprint(loader: LoaderShape) -> dict[str, Any]:
    """The facts a resume of *loader*'s pass depends on (plain values, for ``torch.save``).

    With ``loader.elastic`` the sampler is the loader's own (``auto_shard``; a
    ``DistributedSampler`` when ``WORLD_SIZE > 1``), whose kind and length depend on the world
    size, which may change (an elastic resume, ``_checkpoint/elastic_map.py``).
    """
    auto_sharded = loader.elastic
    dataset = loader.dataset
    iterable = isinstance(dataset, torch.utils.data.IterableDataset)
    facts: dict[str, Any] = {
        "dataset": type(dataset).__qualname__,
        "dataset length": _length(dataset),
        "batch_size": loader.batch_size,
        "drop_last": bool(loader.drop_last),
    }
    generator = loader.generator
    facts["generator seed"] = (
        int(generator.initial_seed()) if isinstance(generator, torch.Generator) else None
    )
    if iterable:
        facts["dataset seed"] = _seed(dataset)
        # TarShards: the shard list (a digest); other ElasticIterable datasets: their own key.
        facts["data"] = dataset.elastic_key() if isinstance(dataset, ElasticIterable) else None
        return facts
    sampler = loader.sampler
    # The loader's own sampler is a DistributedSampler under torchrun and torch's default
    # with one rank: the same data, dealt by world size, which may change.
    facts["sampler"] = "the loader's own" if auto_sharded else type(sampler).__qualname__
    facts["shuffle"] = isinstance(sampler, torch.utils.data.RandomSampler) or bool(
        getattr(sampler, "shuffle", False)
    )
    facts["sampler seed"] = _seed(sampler)
    facts["sampler length"] = None if auto_sharded else _length(sampler)
    if loader.batch_sampler is not None and loader.batch_size is None:  # a user batch_sampler
        facts["batch_sampler"] = type(loader.batch_sampler).__qualname__
        facts["batch_sampler length"] = _length(loader.batch_sampler)
    return facts


def check(saved: dict[str, Any] | None, current: dict[str, Any]) -> None:
    """Raise ``ValueError`` if *saved* (from a checkpoint) and *current* differ.

    A fact unknown on either side (``None``, or absent in an older checkpoint) is not compared.
    """
    if saved is None:
        return
    diffs = [
        f"{key}: checkpoint {saved[key]!r}, this loader {current[key]!r}"
        for key in current
        if saved.get(key) is not None and current[key] is not None and saved[key] != current[key]
    ]
    if diffs:
        raise ValueError(
            "this state_dict was saved from a loader that batches or orders the data "
            "differently, so resuming it would skip or repeat samples: "
            + "; ".join(diffs)
            + ". Build the loader with the same dataset (for TarShards, the same shard URLs), "
            "batch_size, drop_last, sampler and seed as the one that saved it (num_workers "
            "may differ)."
        )
