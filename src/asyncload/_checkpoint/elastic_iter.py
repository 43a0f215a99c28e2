"""Elastic resume of an iterable pass: the remaining work re-dealt over another set of readers.

A *reader* is one worker of one rank (``world_size * num_workers`` of them). An iterable dataset
that is made of *units* read in order (``TarShards``: shards) can say which sample each item is,
as a tag ``(unit, offset, ended)``: the item is sample ``offset`` of ``unit`` (counted from 0 in
the unit as stored, whatever was skipped), and ``ended`` lists ``(unit, size)`` for units that
finished since the reader's previous item. The main process notes the tags of every batch that
reaches the training loop (``Delivered``); batches fetched but not yielded are not noted.

A checkpoint then holds the epoch's units (those of this rank's readers) and, per unit touched,
what was delivered: a watermark below which every offset was, the few offsets above it, and the
unit's size once known. A loader with another number of readers takes what is left (``plan``):
units partly delivered first, then untouched ones, dealt round-robin over its readers
(``deal``); each reader reads its units and leaves out the offsets already delivered. What was
delivered before and after is every sample of the epoch exactly once.

The protocol (``ElasticIterable``): ``elastic_key()`` (what identifies the data, or ``None`` when
this configuration can't be re-dealt), ``elastic_units(rank, world_size, worker, num_workers)``
and ``elastic_iter(plan, skip)``. Datasets without it resume per worker only (same shape).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "Delivered",
    "ElasticIterable",
    "ReaderDeal",
    "Tag",
    "UnitPlan",
    "deal",
    "merge_state_dicts",
    "remaining",
    "supports",
]

Tag = tuple[int, int, tuple[tuple[int, int], ...]]
"""``(unit, offset, ended)``: which sample an item is, and the units that ended before it."""
UnitPlan = tuple[int, int, tuple[int, ...]]
"""``(unit, watermark, extras)``: read *unit*, leaving out offsets below *watermark* and
*extras* (delivered before the checkpoint)."""


@runtime_checkable
class ElasticIterable(Protocol):
    """What an iterable dataset implements so that a checkpoint resumes with another number of
    workers or ranks (``TarShards`` does).

    The dataset is read in *units* (a file, a shard); each has a stable integer id and holds
    samples in a fixed order. Implement the three methods and the loader does the rest: it
    records what was delivered per unit and re-deals what is left over the new readers.

    Examples:
        >>> class Files(asyncload.IterableDataset):  # doctest: +SKIP
        ...     def elastic_key(self):
        ...         return f"{len(self.files)} files"  # a change of data is refused
        ...     def elastic_units(self, rank, world_size, worker, num_workers):
        ...         g, n = rank * num_workers + worker, world_size * num_workers
        ...         return list(range(len(self.files)))[g::n]
        ...     async def elastic_iter(self, plan, skip):
        ...         ...  # yield ((unit, offset, ended), sample) for the plan's units
    """

    def elastic_key(self) -> str | None:
        """Identifies the data (a checkpoint of other data is refused); ``None``: not elastic."""

    def elastic_units(self, rank: int, world_size: int, worker: int, num_workers: int) -> list[int]:
        """The units reader ``(rank, worker)`` reads in an ordinary pass of this epoch."""

    def elastic_iter(
        self, plan: Sequence[UnitPlan] | None, skip: int
    ) -> AsyncIterator[tuple[Tag, Any]]:
        """This reader's items with their tags: its ordinary share (``plan=None``) without its
        first *skip* items, or the units of *plan* without the offsets it names."""


def supports(dataset: Any) -> bool:
    """Whether *dataset* can be re-dealt: it implements the protocol and says yes."""
    return isinstance(dataset, ElasticIterable) and dataset.elastic_key() is not None


@dataclass
class _Unit:
    watermark: int = 0
    extras: set[int] = field(default_factory=set)
    size: int = -1  # -1: not known yet

    @property
    def done(self) -> bool:
        return 0 <= self.size <= self.watermark


class Delivered:
    """Per unit, which offsets reached the training loop (main process)."""

    def __init__(self, units: dict[int, _Unit] | None = None) -> None:
        self.units: dict[int, _Unit] = units if units is not None else {}

    def note(self, tags: Iterable[Tag]) -> None:
        for unit, offset, ended in tags:
            u = self.units.setdefault(unit, _Unit())
            if offset == u.watermark:
                u.watermark += 1
                while u.watermark in u.extras:
                    u.extras.discard(u.watermark)
                    u.watermark += 1
            elif offset > u.watermark:
                u.extras.add(offset)
            for done, size in ended:
                self.units.setdefault(done, _Unit()).size = size

    def copy(self) -> Delivered:
        return Delivered(
            {k: _Unit(u.watermark, set(u.extras), u.size) for k, u in self.units.items()}
        )

    def to_plain(self, keep: Iterable[int] | None = None) -> dict[int, list[Any]]:
        """Plain values for ``torch.save(weights_only=True)``; only units in *keep* if given."""
        wanted = None if keep is None else set(keep)
        return {
            k: [u.watermark, sorted(u.extras), u.size]
            for k, u in sorted(self.units.items())
            if wanted is None or k in wanted
        }

    @classmethod
    def from_plain(cls, plain: dict[Any, Any] | None) -> Delivered:
        units = {}
        for k, (wm, extras, size) in (plain or {}).items():
            units[int(k)] = _Unit(int(wm), {int(x) for x in extras}, int(size))
        return cls(units)


def remaining(units: Sequence[int], delivered: Delivered) -> list[UnitPlan]:
    """What is left of *units*: partly delivered ones first, then untouched, in *units*' order."""
    partial: list[UnitPlan] = []
    untouched: list[UnitPlan] = []
    for unit in dict.fromkeys(units):  # in order, once each
        u = delivered.units.get(unit)
        if u is None or (u.watermark == 0 and not u.extras):
            untouched.append((unit, 0, ()))
        elif not u.done:
            partial.append((unit, u.watermark, tuple(sorted(u.extras))))
    return partial + untouched


def deal(plans: Sequence[UnitPlan], readers: int) -> list[list[UnitPlan]]:
    """*plans* dealt round-robin over *readers*: reader ``g`` gets ``g, g + readers, ...``."""
    return [list(plans[g::readers]) for g in range(readers)]


@dataclass(frozen=True)
class ReaderDeal:
    """This rank's part of a re-deal: one plan per worker, and the units they cover."""

    plans: tuple[tuple[UnitPlan, ...], ...]
    units: tuple[int, ...]


def redeal(
    units: Sequence[int], delivered: Delivered, *, rank: int, world_size: int, num_workers: int
) -> ReaderDeal:
    """Rank *rank*'s plans when what is left of *units* is dealt over every reader."""
    per_reader = deal(remaining(units, delivered), world_size * num_workers)
    mine = per_reader[rank * num_workers : (rank + 1) * num_workers]
    return ReaderDeal(
        plans=tuple(tuple(p) for p in mine),
        units=tuple(plan[0] for reader in mine for plan in reader),
    )


def merge_state_dicts(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One checkpoint from every rank's ``loader.state_dict()`` of an iterable pass.

    Each rank's checkpoint of a ``TarShards`` (or other ``ElasticIterable``) pass covers only
    its own readers. To resume with another world size, merge the checkpoints of all ranks
    and load the result on every new rank. A map-style checkpoint needs no merging (any
    rank's stands for all).

    Examples:
        >>> states = [torch.load(f"loader-rank{r}.pt") for r in range(4)]  # doctest: +SKIP
        >>> loader.load_state_dict(asyncload.merge_state_dicts(states))  # doctest: +SKIP

    Raises:
        ValueError: The checkpoints are not of one iterable pass, or a rank is missing.
    """
    if not states:
        raise ValueError("merge_state_dicts needs the state_dict of every rank, got none")
    readers = [s.get("readers") if isinstance(s, dict) else None for s in states]
    if any(r is None for r in readers):
        raise ValueError(
            "merge_state_dicts: every state_dict must come from a loader over an elastic "
            "iterable dataset (TarShards), in the middle of a pass"
        )
    world = {int(r["world_size"]) for r in readers if r is not None}
    ranks = sorted(rank for r in readers if r is not None for rank in r["ranks"])
    if len(world) != 1 or ranks != list(range(world.pop())):
        raise ValueError(
            f"merge_state_dicts: got the checkpoints of ranks {ranks}; pass one state_dict "
            "from each rank of the job that saved them, and nothing else"
        )
    merged = dict(states[0])
    units: list[int] = []
    delivered: dict[Any, Any] = {}
    for s, r in zip(states, readers, strict=True):
        assert r is not None
        units += [int(u) for u in r["units"]]
        delivered.update(s.get("delivered") or {})
    merged["readers"] = {**readers[0], "units": units, "ranks": ranks}  # type: ignore[dict-item]
    merged["delivered"] = delivered
    return merged


def readers_state(
    dataset: Any, deal: ReaderDeal | None, *, rank: int, world_size: int, num_workers: int
) -> dict[str, Any]:
    """The ``"readers"`` entry of a checkpoint: the units this rank's pass covers."""
    n = max(1, num_workers)
    if deal is not None:
        units = list(deal.units)
    else:
        units = [u for w in range(n) for u in dataset.elastic_units(rank, world_size, w, n)]
    return {
        "units": [int(u) for u in units],
        "ranks": [rank],
        "world_size": world_size,
        "num_workers": n,
        "redealt": deal is not None,
    }


def plan_resume(
    state: dict[str, Any], *, rank: int, world_size: int, num_workers: int
) -> ReaderDeal | None:
    """How this rank resumes *state*: ``None`` for the per-worker resume (the same readers
    as the saving pass), else its part of the re-deal.

    Raises:
        ValueError: The checkpoint covers some ranks only and the world size changed.
    """
    readers = state["readers"]
    n = max(1, num_workers)
    saved_world, ranks = int(readers["world_size"]), [int(r) for r in readers["ranks"]]
    if (
        not readers["redealt"]
        and ranks == [rank]
        and saved_world == world_size
        and int(readers["num_workers"]) == n
    ):
        return None  # the same readers: each skips what it delivered
    delivered = Delivered.from_plain(state.get("delivered"))
    units = [int(u) for u in readers["units"]]
    if ranks == list(range(saved_world)):  # every rank's work: deal it over every reader
        return redeal(units, delivered, rank=rank, world_size=world_size, num_workers=n)
    if ranks == [rank] and saved_world == world_size:  # this rank's work over its workers
        return redeal(units, delivered, rank=0, world_size=1, num_workers=n)
    raise ValueError(
        f"this state_dict holds the readers of rank(s) {ranks} of {saved_world} only, and this "
        f"loader is rank {rank} of {world_size}: to resume with another world size, merge the "
        "state_dicts of every rank with asyncload.merge_state_dicts(states) and load the "
        "result on every new rank"
    )
