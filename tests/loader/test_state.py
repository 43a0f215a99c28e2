"""A loader's checkpoints as values (``_loader/state.py``), without a loader or workers."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from asyncload._checkpoint.shape import LoaderShape
from asyncload._loader.state import LoaderState, load, save

pytestmark = pytest.mark.timeout(30)


def _shape(**changes: Any) -> LoaderShape:
    data = list(range(10))
    shape = LoaderShape(
        dataset=data,
        sampler=torch.utils.data.SequentialSampler(data),
        batch_sampler=None,
        generator=None,
        batch_size=4,
        auto_collation=True,
        drop_last=False,
        num_workers=2,
        rank=0,
        world_size=1,
        elastic=False,
    )
    return dataclasses.replace(shape, **changes)


def test_a_state_saved_between_passes_loads_as_the_epoch_to_set() -> None:
    saved = save(_shape(), LoaderState(epoch=3), live=None)
    assert saved["finished"] is True
    assert saved["epoch"] == 3
    loaded = load(_shape(), LoaderState(), saved)
    assert loaded.set_epoch == 3  # the loader calls set_epoch: its sampler and dataset hear it
    # Nothing left of a finished pass to replay; the next pass starts from its generator state.
    point = loaded.state.resume
    assert point is not None
    assert point.finished
    assert torch.equal(point.rng, saved["rng"])
    assert not loaded.state.redealt


def test_a_loader_that_counts_its_epochs_takes_the_epoch_itself() -> None:
    saved = save(_shape(), LoaderState(epoch=5), live=None)
    loaded = load(_shape(), LoaderState(auto_epoch=9), saved)
    assert loaded.set_epoch is None
    assert loaded.state.auto_epoch == 5  # that epoch again, then onwards


def test_load_leaves_the_state_it_was_given_alone() -> None:
    before = LoaderState(epoch=1, auto_epoch=2)
    load(_shape(), before, save(_shape(), LoaderState(epoch=7), live=None))
    assert before == LoaderState(epoch=1, auto_epoch=2)


def test_a_checkpoint_of_another_loader_shape_is_refused_by_name() -> None:
    saved = save(_shape(), LoaderState(), live=None)
    with pytest.raises(ValueError, match="batch_size"):
        load(_shape(batch_size=8), LoaderState(), saved)


def test_the_next_pass_takes_the_one_shot_parts() -> None:
    state = LoaderState(epoch=2, deal="re-deal", iter_deal="plans")  # type: ignore[arg-type]
    assert state.redealt
    taken = state.next_pass()
    assert (taken.deal, taken.iter_deal, taken.resume) == (None, None, None)
    assert (taken.pass_deal, taken.pass_iter_deal) == ("re-deal", "plans")
    assert taken.epoch == 2
    assert not taken.redealt
