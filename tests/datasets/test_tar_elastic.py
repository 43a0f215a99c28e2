"""TarShards resumed with another number of workers or ranks: the epoch exactly once."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncload
from asyncload.datasets import TarShards, write_shards

pytestmark = [
    pytest.mark.usefixtures("no_leaks"),
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
]

N = 120


def _shards(tmp_path: Path, n: int = N, per_shard: int = 10) -> list[str]:
    samples = ({"__key__": f"s{i:04d}", "txt": f"s{i:04d}"} for i in range(n))
    return list(write_shards(samples, tmp_path / "shards", samples_per_shard=per_shard))


def _loader(urls: list[str], workers: int, **kw: Any) -> asyncload.DataLoader[Any]:
    ds = TarShards(urls, seed=3, shards_in_flight=2, **kw)
    return asyncload.DataLoader(ds, batch_size=4, num_workers=workers)


def _keys(batch: Any) -> list[str]:
    return list(batch["__key__"])


def _take(loader: asyncload.DataLoader[Any], k: int) -> tuple[list[str], dict[str, Any]]:
    seen: list[str] = []
    it = iter(loader)
    for _, batch in zip(range(k), it, strict=False):
        seen += _keys(batch)
    state = loader.state_dict()
    del it
    return seen, state


def _rest(loader: asyncload.DataLoader[Any]) -> list[str]:
    return [key for batch in loader for key in _keys(batch)]


def _exactly_once(keys: list[str], n: int = N) -> None:
    counts = collections.Counter(keys)
    assert sorted(counts) == [f"s{i:04d}" for i in range(n)]
    assert max(counts.values()) == 1, [k for k, c in counts.items() if c > 1]


@pytest.mark.parametrize(("old", "new"), [(2, 3), (3, 1), (1, 2)])
@pytest.mark.parametrize("buffer", [0, 16])
def test_workers_change_delivers_the_epoch_exactly_once(
    tmp_path: Path, old: int, new: int, buffer: int
) -> None:
    urls = _shards(tmp_path)
    before, state = _take(_loader(urls, old, shuffle_buffer=buffer), 7)
    assert len(before) == 28
    assert state["readers"]["num_workers"] == max(1, old)
    assert not state["readers"]["redealt"]
    restored = _loader(urls, new, shuffle_buffer=buffer)
    restored.load_state_dict(torch.load(_save(state, tmp_path), weights_only=True))
    _exactly_once(before + _rest(restored))
    # The next epoch is an ordinary one.
    _exactly_once(_rest(restored))


def _save(state: dict[str, Any], tmp_path: Path) -> Path:
    path = tmp_path / "state.pt"
    torch.save(state, path)
    return path


def test_a_re_dealt_pass_checkpoints_and_resumes_again(tmp_path: Path) -> None:
    urls = _shards(tmp_path)
    first, state = _take(_loader(urls, 2, shuffle_buffer=8), 5)
    second_loader = _loader(urls, 3, shuffle_buffer=8)
    second_loader.load_state_dict(state)
    second, state = _take(second_loader, 6)
    assert state["readers"]["redealt"]
    third_loader = _loader(urls, 1, shuffle_buffer=8)
    third_loader.load_state_dict(state)
    _exactly_once(first + second + _rest(third_loader))


def test_only_partly_read_shards_are_read_again(tmp_path: Path) -> None:
    """Without a shuffle buffer each reader has at most shards_in_flight shards partly read;
    finished ones (their end seen by a delivered sample) are not in the new plan."""
    urls = _shards(tmp_path, per_shard=5)
    before, state = _take(_loader(urls, 1), 10)  # 40 samples: 8 shards' worth
    units = state["delivered"]
    done = [u for u, (wm, _, size) in units.items() if size >= 0 and wm >= size]
    assert len(done) >= 5
    restored = _loader(urls, 2)
    restored.load_state_dict(state)
    assert restored._state.iter_deal is not None
    planned = {p[0] for plan in restored._state.iter_deal.plans for p in plan}
    assert not planned & set(done)
    assert len(planned) == len(urls) - len(done)
    _exactly_once(before + _rest(restored))


def test_same_shape_keeps_the_per_worker_resume(tmp_path: Path) -> None:
    """Same num_workers: each worker skips what it delivered, the order of an uninterrupted
    pass is kept."""
    urls = _shards(tmp_path)
    whole = _rest(_loader(urls, 2, shuffle_buffer=8))
    before, state = _take(_loader(urls, 2, shuffle_buffer=8), 5)
    restored = _loader(urls, 2, shuffle_buffer=8)
    restored.load_state_dict(state)
    assert restored._state.iter_deal is None
    assert before + _rest(restored) == whole


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"urls": "fewer"}, "data: checkpoint '12 shards"),
        ({"batch_size": 8}, "batch_size: checkpoint 4, this loader 8"),
        ({"seed": 4}, "dataset seed: checkpoint 3, this loader 4"),
    ],
)
def test_changed_shards_batch_size_or_seed_is_refused(
    tmp_path: Path, change: dict[str, Any], match: str
) -> None:
    urls = _shards(tmp_path)
    _, state = _take(_loader(urls, 2), 3)
    ds = TarShards(
        urls[:-1] if change.get("urls") else urls, seed=change.get("seed", 3), shards_in_flight=2
    )
    other = asyncload.DataLoader(ds, batch_size=change.get("batch_size", 4), num_workers=3)
    with pytest.raises(ValueError, match=match):
        other.load_state_dict(state)


def test_samples_per_rank_is_not_elastic_and_says_so(tmp_path: Path) -> None:
    urls = _shards(tmp_path)
    _, state = _take(_loader(urls, 2, samples_per_rank=N), 3)
    assert "readers" not in state
    with pytest.raises(ValueError, match="samples_per_rank"):
        _loader(urls, 3, samples_per_rank=N).load_state_dict(state)


def _ranks(
    monkeypatch: pytest.MonkeyPatch, urls: list[str], world: int, steps: int | None, states: Any
) -> tuple[list[str], list[dict[str, Any]]]:
    """Every rank of *world* in turn (RANK/WORLD_SIZE as torchrun sets them)."""
    seen: list[str] = []
    saved = []
    for rank in range(world):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(world))
        loader = _loader(urls, 2, shuffle_buffer=8)
        if states is not None:
            loader.load_state_dict(states if isinstance(states, dict) else states[rank])
        if steps is None:
            seen += _rest(loader)
        else:
            keys, state = _take(loader, steps)
            seen += keys
            saved.append(state)
    return seen, saved


def test_world_size_change_needs_every_rank_merged(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    urls = _shards(tmp_path, n=160)  # 16 shards: 4 per reader over 2 ranks × 2 workers
    before, states = _ranks(monkeypatch, urls, 2, 3, None)
    with pytest.raises(ValueError, match="merge_state_dicts"):
        _ranks(monkeypatch, urls, 3, None, states[0])
    after, _ = _ranks(monkeypatch, urls, 3, None, asyncload.merge_state_dicts(states))
    _exactly_once(before + after, 160)


def test_pinning_a_batch_keeps_its_tags() -> None:
    """The pin-memory thread rebuilds each Result: tags (and skip counts) must survive it."""
    from asyncload._protocol.messages import Result
    from asyncload._workers.pin_memory import pin

    msg = Result(3, 0, 1, "not a tensor", None, (), 4, ((7, 0, ()),))
    pinned = pin(msg, "cuda")
    assert (pinned.tags, pinned.sample_count, pinned.data) == (msg.tags, 4, "not a tensor")
