"""Elastic resume of a map-style pass across a change of world size.

``DataLoader(auto_shard=True)`` reads rank *r*'s share of an epoch's *global sequence* (the
``DistributedSampler``'s permutation, or with one rank the ``RandomSampler``'s or the
``SequentialSampler``'s order). Under DDP every rank takes one batch per step, so the ranks
move in lockstep: after each has consumed *k* samples, the first ``k * world_size`` positions
of the global sequence have been delivered, whatever rank a checkpoint came from. A checkpoint
records that position (``Position``); a loader with another world size rebuilds the same
sequence and deals what is left of it over its ranks (``Remainder``), so what was delivered
before and after is every sample of the epoch exactly once (padding aside: like
``DistributedSampler``, a share is padded with repeated samples when the rest does not split
evenly, unless ``drop_last=True``, which drops that tail instead).

Not covered: batches a rank yielded ahead of its watermark with ``in_order=False`` are not
part of the global position, so after a change of world size they are delivered again (at
most ``prefetch_factor * num_workers`` batches per rank). With the same world size the usual
per-batch bookkeeping applies and nothing is repeated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.data

from .resume import Progress
from .shape import LoaderShape

__all__ = ["Position", "Remainder", "plan", "position", "share_length"]


def order_of(sampler: Any, *, has_generator: bool) -> dict[str, Any] | None:
    """How to rebuild the global sequence of a pass over *sampler* (``None``: can't)."""
    if isinstance(sampler, torch.utils.data.DistributedSampler):
        return {
            "kind": "distributed",
            "seed": int(sampler.seed),
            "epoch": int(sampler.epoch),
            "shuffle": bool(sampler.shuffle),
        }
    if isinstance(sampler, torch.utils.data.RandomSampler):
        if sampler.replacement or sampler._num_samples is not None:
            return None
        return {"kind": "random", "generator": has_generator}
    if isinstance(sampler, torch.utils.data.SequentialSampler):
        return {"kind": "sequential"}
    return None


def global_sequence(order: dict[str, Any], n: int) -> list[int]:
    """The epoch's global sequence of sample indices, as the saving loader's sampler drew it.

    A RandomSampler's order carries the RNG state at the start of its pass (``"rng"``).
    """
    kind = order["kind"]
    if kind == "sequential" or (kind == "distributed" and not order["shuffle"]):
        return list(range(n))
    if kind == "distributed":  # DistributedSampler.__iter__'s permutation, before padding
        g = torch.Generator()
        g.manual_seed(int(order["seed"]) + int(order["epoch"]))
        return torch.randperm(n, generator=g).tolist()
    rng = order["rng"]
    if order["generator"]:  # the loader's generator, as the pass's RandomSampler used it
        g = torch.Generator()
        g.set_state(rng)
        return list(torch.utils.data.RandomSampler(range(n), generator=g))
    with torch.random.fork_rng(devices=[]):  # it drew its seed from the global RNG
        torch.set_rng_state(rng)
        return list(torch.utils.data.RandomSampler(range(n)))


def share_length(remaining: int, world_size: int, drop_last: bool) -> int:
    """Samples per rank when *remaining* are dealt over *world_size* ranks."""
    if drop_last:
        return remaining // world_size
    return -(-remaining // world_size)


class Remainder(torch.utils.data.Sampler[int]):
    """Rank *rank*'s share of ``sequence[start:]`` over *world_size* ranks, dealt and padded
    as ``DistributedSampler`` deals a whole epoch (with ``start=0`` it yields the same)."""

    def __init__(
        self,
        sequence: list[int],
        *,
        start: int,
        rank: int,
        world_size: int,
        drop_last: bool,
        order: dict[str, Any],
    ) -> None:
        self.order = order  # how *sequence* was drawn, for the next checkpoint
        self.sequence = sequence
        self.start = start
        self.rank = rank
        self.world_size = world_size
        self.drop_last = drop_last
        self.num_samples = share_length(len(sequence) - start, world_size, drop_last)

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        rest = self.sequence[self.start :]
        total = self.num_samples * self.world_size
        if len(rest) < total and rest:  # pad by repeating from the front, as torch does
            rest = (rest * (-(-total // len(rest))))[:total]
        return iter(rest[self.rank : total : self.world_size])


@dataclass(frozen=True)
class Position:
    """Where a pass stands in its epoch's global sequence (saved in ``state_dict``)."""

    order: dict[str, Any]
    """``order_of`` the sampler that drew the sequence."""
    world_size: int
    """Ranks the pass was dealt over."""
    start: int
    """Position in the sequence where this pass's deal began (0 unless itself resumed)."""
    consumed: int
    """Positions before this one were delivered, by every rank (lockstep)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "order": dict(self.order),
            "world_size": self.world_size,
            "start": self.start,
            "consumed": self.consumed,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Position:
        return cls(dict(d["order"]), int(d["world_size"]), int(d["start"]), int(d["consumed"]))


def position(loader: LoaderShape, state: dict[str, Any], deal: Remainder | None) -> Position | None:
    """The global position of the pass *state* describes (``None``: not elastic).

    *deal*: the pass's ``Remainder`` when it is itself an elastic resume, else ``None``.
    """
    if state.get("finished"):
        return None
    per_batch = loader.per_batch
    if deal is not None:
        order, world, start, share = deal.order, deal.world_size, deal.start, len(deal)
    else:
        found = order_of(loader.sampler, has_generator=loader.generator is not None)
        if found is None:
            return None
        order, world, start, share = found, loader.world_size, 0, len(loader.sampler)
        if order["kind"] == "distributed" and state.get("epoch") is not None:
            order["epoch"] = int(state["epoch"])
        if order["kind"] == "random":
            order["rng"] = state["rng"].clone()
    taken = min(int(state["watermark"]) * per_batch, share)
    return Position(order, world, start, min(len(loader.dataset), start + taken * world))


def plan(loader: LoaderShape, state: dict[str, Any], point: Any) -> tuple[Any, Remainder | None]:
    """How *loader* resumes *point*: the point (its progress reset when the deal changed) and
    the ``Remainder`` its next pass reads, or ``None`` for the usual per-batch resume."""
    saved = state.get("position")
    if saved is None or point.finished or not loader.elastic:
        return point, None
    pos = Position.from_dict(saved)
    if pos.world_size == loader.world_size and pos.start == 0:
        return point, None  # the same deal: the per-batch bookkeeping is exact
    sequence = global_sequence(pos.order, len(loader.dataset))
    if pos.world_size == loader.world_size:
        start = pos.start  # the same re-deal again, with its own bookkeeping
    else:
        start = pos.consumed
        point = dataclasses.replace(point, progress=Progress(max(1, loader.num_workers)))
    deal = Remainder(
        sequence,
        start=start,
        rank=loader.rank,
        world_size=loader.world_size,
        drop_last=loader.drop_last,
        order=pos.order,
    )
    return point, deal
