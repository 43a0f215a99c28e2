"""Elastic resume of map-style passes across a change of world size (issue 13 item 2).

Each rank's loader runs in this process in turn, RANK/WORLD_SIZE set as torchrun sets them;
the ranks move in lockstep (DDP), so rank 0's checkpoint stands for all of them.
"""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch

import asyncload

from .._datasets import SyncNumbers

pytestmark = pytest.mark.usefixtures("no_leaks")


def _loader(
    monkeypatch: pytest.MonkeyPatch, rank: int, world: int, n: int, **kw: Any
) -> asyncload.DataLoader[Any]:
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    return asyncload.DataLoader(SyncNumbers(n), batch_size=4, **kw)


def _run_ranks(
    monkeypatch: pytest.MonkeyPatch,
    world: int,
    n: int,
    steps: int | None,
    state: dict[str, Any] | None,
    **kw: Any,
) -> tuple[list[int], dict[str, Any] | None]:
    """Every rank of *world* takes *steps* batches (all with None), after loading *state*.
    Returns what they delivered and rank 0's checkpoint."""
    seen: list[int] = []
    saved = None
    for rank in range(world):
        loader = _loader(monkeypatch, rank, world, n, **kw)
        if state is not None:
            loader.load_state_dict(state)
        it = iter(loader)
        for _, batch in zip(range(steps if steps is not None else 10**9), it, strict=False):
            seen += batch.tolist()
        if rank == 0:
            saved = loader.state_dict()
        del it
    return seen, saved


def _exactly_once(items: list[int], n: int) -> None:
    counts = collections.Counter(items)
    assert sorted(counts) == list(range(n))
    assert max(counts.values()) == 1


@pytest.mark.parametrize(("old", "new"), [(2, 1), (1, 2), (2, 4), (4, 2)])
@pytest.mark.parametrize("shuffle", [True, False])
def test_world_size_change_delivers_the_epoch_exactly_once(
    monkeypatch: pytest.MonkeyPatch, old: int, new: int, shuffle: bool
) -> None:
    n = 64
    kw = {"shuffle": shuffle, "generator": torch.Generator().manual_seed(7)}
    before, state = _run_ranks(monkeypatch, old, n, 2, None, **kw)
    assert len(before) == 2 * 4 * old
    assert state is not None
    assert state["position"]["consumed"] == 8 * old
    after, _ = _run_ranks(monkeypatch, new, n, None, state, **kw)
    _exactly_once(before + after, n)


def test_global_rng_world_one_to_two(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(3)
    before, state = _run_ranks(monkeypatch, 1, 48, 3, None, shuffle=True)
    torch.manual_seed(99)  # a new process: the global RNG moved on
    after, _ = _run_ranks(monkeypatch, 2, 48, None, state, shuffle=True)
    _exactly_once(before + after, 48)


def test_a_resumed_deal_resumes_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """2 ranks -> 1 rank, checkpoint again mid-way, -> 2 ranks: still exactly once."""
    n, kw = 64, {"shuffle": True}
    first, state = _run_ranks(monkeypatch, 2, n, 2, None, **kw)
    second, state = _run_ranks(monkeypatch, 1, n, 3, state, **kw)
    assert state is not None
    assert state["position"]["consumed"] == 16 + 12
    third, _ = _run_ranks(monkeypatch, 2, n, None, state, **kw)
    _exactly_once(first + second + third, n)


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_world_and_workers_change_together(monkeypatch: pytest.MonkeyPatch) -> None:
    n, kw = 64, {"shuffle": True}
    before, state = _run_ranks(monkeypatch, 2, n, 3, None, num_workers=2, **kw)
    after, _ = _run_ranks(monkeypatch, 1, n, None, state, num_workers=3, **kw)
    _exactly_once(before + after, n)


def test_the_next_epoch_reads_the_new_world_normally(monkeypatch: pytest.MonkeyPatch) -> None:
    n = 32
    _, state = _run_ranks(monkeypatch, 2, n, 1, None, shuffle=True)
    loader = _loader(monkeypatch, 0, 1, n, shuffle=True)
    loader.load_state_dict(state)  # type: ignore[arg-type]
    rest = [i for b in loader for i in b.tolist()]
    assert len(rest) == n - 8
    assert sorted(i for b in loader for i in b.tolist()) == list(range(n))  # a whole epoch


def test_a_batch_size_change_across_world_sizes_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, state = _run_ranks(monkeypatch, 2, 32, 1, None, shuffle=True)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    other = asyncload.DataLoader(SyncNumbers(32), batch_size=8, shuffle=True)
    with pytest.raises(ValueError, match="batch_size: checkpoint 4, this loader 8"):
        other.load_state_dict(state)  # type: ignore[arg-type]
