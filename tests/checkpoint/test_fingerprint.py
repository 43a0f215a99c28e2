"""A checkpoint is refused by a loader that batches or orders the data differently (issue 12
item 14): the error names what differs, with both values; num_workers may change."""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch

import asyncload

from .._datasets import SyncNumbers

pytestmark = pytest.mark.usefixtures("no_leaks")


def _loader(**kw: Any) -> asyncload.DataLoader[Any]:
    n = kw.pop("n", 40)
    args: dict[str, Any] = {
        "batch_size": 4,
        "shuffle": True,
        "generator": torch.Generator().manual_seed(1),
    }
    args.update(kw)
    return asyncload.DataLoader(SyncNumbers(n), **args)


def _checkpoint(loader: asyncload.DataLoader[Any], k: int) -> tuple[list[int], dict[str, Any]]:
    it = iter(loader)
    seen = [i for _, b in zip(range(k), it, strict=False) for i in b.tolist()]
    state = loader.state_dict()
    del it
    return seen, state


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"batch_size": 5}, "batch_size: checkpoint 4, this loader 5"),
        ({"drop_last": True}, "drop_last: checkpoint False, this loader True"),
        ({"n": 41}, "dataset length: checkpoint 40, this loader 41"),
        ({"shuffle": False}, "shuffle: checkpoint True, this loader False"),
        (
            {"generator": torch.Generator().manual_seed(2)},
            "generator seed: checkpoint 1, this loader 2",
        ),
        (
            {"sampler": torch.utils.data.SequentialSampler(range(40)), "shuffle": None},
            "sampler: checkpoint \"the loader's own\", this loader 'SequentialSampler'",
        ),
    ],
)
def test_a_mismatched_loader_refuses_the_checkpoint(change: dict[str, Any], named: str) -> None:
    _, state = _checkpoint(_loader(), 3)
    other = _loader(**change)
    with pytest.raises(ValueError, match="differently") as info:
        other.load_state_dict(state)
    assert named in str(info.value)


def test_sampler_length_mismatch_is_named() -> None:
    small = torch.utils.data.RandomSampler(range(40), num_samples=20)
    _, state = _checkpoint(_loader(sampler=small, shuffle=None), 2)
    big = torch.utils.data.RandomSampler(range(40), num_samples=30)
    with pytest.raises(ValueError, match="sampler length: checkpoint 20, this loader 30"):
        _loader(sampler=big, shuffle=None).load_state_dict(state)


def test_iterable_dataset_length_and_batch_size_are_checked() -> None:
    class Items(torch.utils.data.IterableDataset[int]):
        def __init__(self, n: int) -> None:
            self.n = n

        def __iter__(self) -> Any:
            return iter(range(self.n))

        def __len__(self) -> int:
            return self.n

    saved = asyncload.DataLoader(Items(20), batch_size=4)
    _, state = _checkpoint(saved, 2)
    with pytest.raises(ValueError, match="batch_size: checkpoint 4, this loader 2"):
        asyncload.DataLoader(Items(20), batch_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match="dataset length: checkpoint 20, this loader 30"):
        asyncload.DataLoader(Items(30), batch_size=4).load_state_dict(state)


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_a_change_of_num_workers_still_resumes_exactly_once() -> None:
    before, state = _checkpoint(_loader(num_workers=2), 3)
    restored = _loader(num_workers=3)
    restored.load_state_dict(state)
    after = [i for b in restored for i in b.tolist()]
    both = collections.Counter(before + after)
    assert sorted(both) == list(range(40))
    assert max(both.values()) == 1


def test_a_checkpoint_without_fingerprint_still_loads() -> None:
    before, state = _checkpoint(_loader(), 3)
    del state["fingerprint"]
    restored = _loader()
    restored.load_state_dict(state)
    after = [i for b in restored for i in b.tolist()]
    assert sorted(before + after) == list(range(40))
