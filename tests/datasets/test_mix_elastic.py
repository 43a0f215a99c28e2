"""Mix resumed with another number of workers or ranks: what was left, exactly once."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import pytest

import asyncload
from asyncload.datasets import TarShards, write_shards

pytestmark = [
    pytest.mark.usefixtures("no_leaks"),
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
]


class Keys(asyncload.Dataset[dict[str, str]]):
    """Map-style, in memory: sample i is ``{"__key__": "m0007"}``, as a tar shard's are."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, index: int) -> dict[str, str]:
        return {"__key__": f"m{index:04d}"}


def keys(batch: list[dict[str, Any]]) -> list[str]:
    """collate_fn: only the keys (a map-style and a tar sample have other fields)."""
    return [sample["__key__"] for sample in batch]


def _mix(tmp_path: Path, **kw: Any) -> asyncload.Mix:
    directory = tmp_path / "shards"
    if not directory.exists():
        samples = ({"__key__": f"s{i:04d}", "txt": "x"} for i in range(120))
        list(write_shards(samples, directory, samples_per_shard=10))
    shards = TarShards(sorted(str(p) for p in directory.glob("*.tar")), seed=3, shuffle_buffer=8)
    return asyncload.Mix([Keys(90), shards], [0.4, 0.6], seed=5, **kw)


def _loader(tmp_path: Path, workers: int, **kw: Any) -> asyncload.DataLoader[Any]:
    return asyncload.DataLoader(
        _mix(tmp_path, **kw), batch_size=4, num_workers=workers, collate_fn=keys
    )


def _take(loader: asyncload.DataLoader[Any], k: int) -> tuple[list[str], dict[str, Any]]:
    it = iter(loader)
    seen = [key for _, batch in zip(range(k), it, strict=False) for key in batch]
    state = loader.state_dict()
    del it
    return seen, state


def _rest(loader: asyncload.DataLoader[Any]) -> list[str]:
    return [key for batch in loader for key in batch]


EVERY = sorted([f"m{i:04d}" for i in range(90)] + [f"s{i:04d}" for i in range(120)])


def _exactly_once(seen: list[str]) -> None:
    counts = collections.Counter(seen)
    assert max(counts.values()) == 1, [k for k, c in counts.items() if c > 1]
    assert sorted(counts) == EVERY


@pytest.mark.parametrize(("old", "new"), [(2, 3), (3, 1), (0, 2)])
def test_workers_change_delivers_every_sample_once(tmp_path: Path, old: int, new: int) -> None:
    before, state = _take(_loader(tmp_path, old, stop="all"), 12)
    assert "readers" in state
    assert len(before) == 48
    _exactly_once(before + _rest(_loaded(tmp_path, new, state, stop="all")))


def _loaded(tmp_path: Path, workers: int, state: Any, **kw: Any) -> asyncload.DataLoader[Any]:
    loader = _loader(tmp_path, workers, **kw)
    loader.load_state_dict(state)
    return loader


def test_a_re_dealt_pass_checkpoints_and_re_deals_again(tmp_path: Path) -> None:
    before, state = _take(_loader(tmp_path, 2, stop="all"), 10)
    middle, state = _take(_loaded(tmp_path, 3, state, stop="all"), 10)
    _exactly_once(before + middle + _rest(_loaded(tmp_path, 1, state, stop="all")))


def test_stop_first_never_repeats_a_sample(tmp_path: Path) -> None:
    """With stop="first" what a pass covers depends on who ran out when; a re-deal may also
    deliver what a finished reader left unread, but never a sample twice."""
    whole = _rest(_loader(tmp_path, 2))
    before, state = _take(_loader(tmp_path, 2), 8)
    after = _rest(_loaded(tmp_path, 3, state))
    counts = collections.Counter(before + after)
    assert max(counts.values()) == 1
    assert len(counts) >= len(whole) * 0.8


def test_the_mix_is_re_dealt_with_its_weights(tmp_path: Path) -> None:
    """The readers of a re-dealt pass still draw 40/60 while both datasets last."""
    _, state = _take(_loader(tmp_path, 1, stop="all"), 2)
    after = _rest(_loaded(tmp_path, 2, state, stop="all"))
    head = after[:100]
    share = sum(key.startswith("m") for key in head) / len(head)
    assert 0.25 < share < 0.55, share


def test_one_rank_to_two_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before, state = _take(_loader(tmp_path, 2, stop="all"), 9)
    merged = asyncload.merge_state_dicts([state])
    after: list[str] = []
    for rank in range(2):  # RANK/WORLD_SIZE as torchrun sets them
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        after += _rest(_loaded(tmp_path, 2, merged, stop="all"))
    _exactly_once(before + after)


def test_other_data_weights_or_samples_are_refused(tmp_path: Path) -> None:
    _, state = _take(_loader(tmp_path, 2, stop="all"), 3)
    with pytest.raises(ValueError, match="data"):
        _loaded(tmp_path, 3, state, stop="first")
    _, state = _take(_loader(tmp_path, 2, samples=100), 3)
    assert "readers" not in state
    with pytest.raises(ValueError, match=r"num_workers=2.*not with samples="):
        _loaded(tmp_path, 3, state, samples=100)


@pytest.mark.parametrize("stop", ["all", "first"])
def test_the_same_shape_resumes_each_reader_where_it_was(tmp_path: Path, stop: Any) -> None:
    """No re-deal: each reader replays its own choices, so the rest is the same pass's rest."""
    whole = _rest(_loader(tmp_path, 2, stop=stop))
    before, state = _take(_loader(tmp_path, 2, stop=stop), 7)
    assert state["readers"]["redealt"] is False
    after = _rest(_loaded(tmp_path, 2, state, stop=stop))
    assert collections.Counter(before + after) == collections.Counter(whole)
