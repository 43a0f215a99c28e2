"""A ``DataLoader``'s checkpoints as values: ``LoaderState``, ``save`` and ``load``.

``LoaderState`` is what a loader carries from one pass to the next besides its arguments: the
epoch counters, and a loaded checkpoint's resume point and re-deals, each used up by the pass
that takes it. The loader owns one and replaces it whole. ``save`` and ``load`` take values
(the loader's ``LoaderShape``, its state, its live pass) and give values back: which pass
position a checkpoint records, and how a loaded one is re-dealt when the number of readers
changed (``_checkpoint.elastic_map`` for map-style datasets, ``_checkpoint.elastic_iter`` for
iterable ones). Neither touches the loader.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from .._checkpoint import elastic_iter as _elastic_iter
from .._checkpoint import elastic_map as _elastic
from .._checkpoint import fingerprint as _fingerprint
from .._checkpoint.resume import NO_PASS, Progress, ResumePoint, capture_rng
from .._checkpoint.shape import LoaderShape

if TYPE_CHECKING:
    from .pass_iterator import Pass

__all__ = ["Loaded", "LoaderState", "epoch_holder", "load", "save"]


@dataclasses.dataclass(frozen=True, slots=True)
class LoaderState:
    """What a loader carries between passes (see module doc). The loader replaces it whole."""

    epoch: int | None = None
    """The epoch ``set_epoch`` named last (``None``: never called)."""
    auto_epoch: int | None = None
    """The next epoch the loader counts itself (``auto_shard`` under torchrun), until the
    caller calls ``set_epoch``."""
    epoch_of_pass: int | None = None
    """The epoch the current pass runs (recorded in its checkpoints)."""
    resume: ResumePoint | None = None
    """A loaded checkpoint's point, for the next pass (one-shot)."""
    deal: _elastic.Remainder | None = None
    """The next pass's re-deal of a map-style dataset (one-shot)."""
    iter_deal: _elastic_iter.ReaderDeal | None = None
    """The next pass's re-deal of an iterable dataset's units (one-shot)."""
    pass_deal: _elastic.Remainder | None = None
    """The current pass's ``deal``."""
    pass_iter_deal: _elastic_iter.ReaderDeal | None = None
    """The current pass's ``iter_deal``."""

    @property
    def redealt(self) -> bool:
        """The next pass reads a re-deal (it is never kept for the epoch after)."""
        return self.deal is not None or self.iter_deal is not None

    def next_pass(self) -> LoaderState:
        """The state once the next pass has taken the one-shot parts."""
        return dataclasses.replace(
            self, resume=None, deal=None, iter_deal=None,
            pass_deal=self.deal, pass_iter_deal=self.iter_deal,
        )  # fmt: skip


@dataclasses.dataclass(frozen=True, slots=True)
class Loaded:
    """What ``load`` gives back: the loader's new state, and the epoch to set (its sampler's
    and dataset's ``set_epoch``), if any."""

    state: LoaderState
    set_epoch: int | None
    sampler_epoch: int | None = None
    """The epoch the caller's own sampler was at (``epoch_holder``), for a checkpoint saved
    mid-epoch without ``loader.set_epoch``: that epoch's order is the one being resumed."""


def epoch_holder(shape: LoaderShape) -> Any | None:
    """The sampler whose epoch the caller sets (``DistributedSampler.set_epoch``): the first of
    the sampler, the batch sampler and the batch sampler's sampler with an ``int`` ``epoch``
    and a ``set_epoch``; ``None`` if none has."""
    inner = getattr(shape.batch_sampler, "sampler", None)
    for obj in (shape.sampler, shape.batch_sampler, inner):
        if isinstance(getattr(obj, "epoch", None), int) and callable(
            getattr(obj, "set_epoch", None)
        ):
            return obj
    return None


def save(shape: LoaderShape, state: LoaderState, live: Pass | None) -> dict[str, Any]:
    """``loader.state_dict()``: where *live* (the current pass, if any) stands."""
    saved = _plain_state(shape, state, live)
    holder = epoch_holder(shape)
    if holder is not None:  # a caller that sets its sampler's epoch itself, not the loader's
        saved["sampler_epoch"] = int(holder.epoch)
    if shape.elastic:
        pos = _elastic.position(shape, saved, state.pass_deal if live is not None else state.deal)
        if pos is not None:
            saved["position"] = pos.to_dict()
    elif saved["iterable"] and not saved["finished"] and _elastic_iter.supports(shape.dataset):
        readers = _elastic_iter.readers_state(
            shape.dataset,
            state.pass_iter_deal if live is not None else state.iter_deal,
            rank=shape.rank,
            world_size=shape.world_size,
            num_workers=shape.num_workers,
        )
        saved["readers"] = readers
        delivered = _elastic_iter.Delivered.from_plain(saved["delivered"])
        saved["delivered"] = delivered.to_plain(keep=readers["units"])
    saved["fingerprint"] = _fingerprint.fingerprint(shape)
    return saved


def _plain_state(shape: LoaderShape, state: LoaderState, live: Pass | None) -> dict[str, Any]:
    if live is not None:
        point = live.checkpoint(state.epoch_of_pass)
        if point.finished:  # the next pass starts where the generator stands now, not this one
            point = dataclasses.replace(point, rng=capture_rng(shape.generator))
        return point.to_dict()
    if state.resume is not None:
        return state.resume.to_dict()
    return ResumePoint(
        iterable=shape.iterable,
        num_workers=shape.num_workers,
        epoch=state.epoch,
        rng=capture_rng(shape.generator),
        base_seed=NO_PASS,
        progress=Progress(max(1, shape.num_workers)),
        finished=True,
    ).to_dict()


def load(shape: LoaderShape, state: LoaderState, saved: dict[str, Any]) -> Loaded:
    """``loader.load_state_dict(saved)``: the state whose next pass continues *saved*."""
    _fingerprint.check(
        saved.get("fingerprint") if isinstance(saved, dict) else None,
        _fingerprint.fingerprint(shape),
    )
    iterable = shape.iterable
    elastic = iterable and "readers" in saved and _elastic_iter.supports(shape.dataset)
    point = ResumePoint.from_dict(
        saved, iterable=iterable, num_workers=shape.num_workers, elastic=elastic
    )
    set_epoch = None
    if point.epoch is not None and state.auto_epoch is not None:
        state = dataclasses.replace(state, auto_epoch=point.epoch)  # that epoch again, onwards
    elif point.epoch is not None:
        set_epoch = point.epoch
    point, deal = _elastic.plan(shape, saved, point)
    iter_deal = None
    if elastic and not point.finished:
        iter_deal = _elastic_iter.plan_resume(
            saved, rank=shape.rank, world_size=shape.world_size, num_workers=shape.num_workers
        )
        if iter_deal is not None:  # the workers read their plans from the start
            progress = Progress(
                max(1, shape.num_workers), delivered=point.progress.delivered.copy()
            )
            point = dataclasses.replace(point, progress=progress)
    sampler_epoch = saved.get("sampler_epoch")
    if point.finished or point.epoch is not None or not isinstance(sampler_epoch, int):
        sampler_epoch = None  # the next epoch is the caller's to set; or set_epoch says it
    # A finished point is kept too: the next pass (the next epoch) restores its generator state.
    return Loaded(
        dataclasses.replace(state, resume=point, deal=deal, iter_deal=iter_deal),
        set_epoch,
        sampler_epoch,
    )
