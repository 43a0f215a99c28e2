"""Saving and loading a ``DataLoader``'s checkpoints (its ``state_dict`` and
``load_state_dict``), split out of ``_loader``: which pass position a checkpoint records, and
how a loaded one is re-dealt when the number of readers changed (``_elastic`` for map-style
datasets, ``_checkpoint.elastic_iter`` for iterable ones). Works on the loader's own fields.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.utils.data

from .._checkpoint import elastic_iter as _elastic_iter
from .._checkpoint import elastic_map as _elastic
from .._checkpoint import fingerprint as _fingerprint
from .._checkpoint.resume import Progress, ResumePoint, capture_rng

__all__ = ["load", "save"]


def save(loader: Any) -> dict[str, Any]:
    """``loader.state_dict()``."""
    state = _plain_state(loader)
    if loader._elastic_ok:
        live = loader._live_pass is not None and loader._live_pass() is not None
        pos = _elastic.position(loader, state, loader._pass_deal if live else loader._deal)
        if pos is not None:
            state["position"] = pos.to_dict()
    elif state["iterable"] and not state["finished"] and _elastic_iter.supports(loader.dataset):
        live = loader._live_pass is not None and loader._live_pass() is not None
        readers = _elastic_iter.readers_state(
            loader.dataset,
            loader._pass_iter_deal if live else loader._iter_deal,
            rank=loader._rank,
            world_size=loader._world,
            num_workers=loader.num_workers,
        )
        state["readers"] = readers
        delivered = _elastic_iter.Delivered.from_plain(state["delivered"])
        state["delivered"] = delivered.to_plain(keep=readers["units"])
    state["fingerprint"] = _fingerprint.fingerprint(loader, auto_sharded=loader._elastic_ok)
    return state


def _plain_state(loader: Any) -> dict[str, Any]:
    it = loader._live_pass() if loader._live_pass is not None else None
    if it is None:
        if loader._resume is not None:
            loaded: ResumePoint = loader._resume
            return loaded.to_dict()
        it_point = ResumePoint(
            iterable=isinstance(loader.dataset, torch.utils.data.IterableDataset),
            num_workers=loader.num_workers,
            epoch=loader._epoch,
            rng=capture_rng(loader.generator),
            base_seed=0,
            progress=Progress(max(1, loader.num_workers)),
            finished=True,
        )
        return it_point.to_dict()
    point: ResumePoint = it.checkpoint(loader._epoch_of_pass)
    return point.to_dict()


def load(loader: Any, state: dict[str, Any]) -> None:
    """``loader.load_state_dict(state)``."""
    _fingerprint.check(
        state.get("fingerprint") if isinstance(state, dict) else None,
        _fingerprint.fingerprint(loader, auto_sharded=loader._elastic_ok),
    )
    iterable = isinstance(loader.dataset, torch.utils.data.IterableDataset)
    elastic = iterable and "readers" in state and _elastic_iter.supports(loader.dataset)
    point = ResumePoint.from_dict(
        state, iterable=iterable, num_workers=loader.num_workers, elastic=elastic
    )
    if point.epoch is not None and loader._auto_epoch is not None:
        loader._auto_epoch = point.epoch  # the next pass is that epoch again, then onwards
    elif point.epoch is not None:
        loader.set_epoch(point.epoch)
    point, loader._deal = _elastic.plan(loader, state, point)
    loader._iter_deal = None
    if elastic and not point.finished:
        loader._iter_deal = _elastic_iter.plan_resume(
            state, rank=loader._rank, world_size=loader._world, num_workers=loader.num_workers
        )
        if loader._iter_deal is not None:  # the workers read their plans from the start
            progress = Progress(
                max(1, loader.num_workers), delivered=point.progress.delivered.copy()
            )
            point = dataclasses.replace(point, progress=progress)
    if loader._persistent_pass is not None:  # its workers are mid-pass: start afresh
        loader._persistent_pass.close()
        loader._persistent_pass = None
    loader._resume = None if point.finished else point
    loader._live_pass = None  # state_dict() now reports what was loaded, not an old pass
