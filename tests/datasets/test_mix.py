"""asyncload.Mix: proportions, stop modes, sharding across workers, exact resume."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from typing import Any

import pytest

import asyncload

pytestmark = pytest.mark.usefixtures("no_leaks")


class Tagged(asyncload.Dataset[tuple[str, int]]):
    """In memory: item i is (tag, i), after a short seeded delay so completions interleave."""

    def __init__(self, tag: str, n: int) -> None:
        self.tag, self.n = tag, n

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, index: int) -> tuple[str, int]:
        await asyncio.sleep((index * 7919 % 13) / 10_000)
        return self.tag, index


class TaggedStream(asyncload.IterableDataset[tuple[str, int]]):
    """An iterable that shards itself across workers, as iterables must."""

    def __init__(self, tag: str, n: int) -> None:
        self.tag, self.n = tag, n

    async def __aiter__(self) -> AsyncIterator[tuple[str, int]]:
        for i in asyncload.shard(range(self.n)):
            yield self.tag, i


def _epoch(loader: Any) -> list[tuple[str, int]]:
    return [(t, int(i)) for batch in loader for t, i in zip(*batch, strict=True)]


def _load(mix: asyncload.Mix, **kw: Any) -> asyncload.DataLoader[Any]:
    return asyncload.DataLoader(mix, batch_size=16, **kw)


def test_proportions_follow_the_weights_and_repeat_for_a_seed() -> None:
    def run(seed: int) -> list[tuple[str, int]]:
        mix = asyncload.Mix(
            [Tagged("a", 500), Tagged("b", 300), TaggedStream("c", 200)],
            [0.6, 0.3, 0.1],
            seed=seed,
            samples=10_000,
        )
        return _epoch(_load(mix, num_workers=0, max_concurrency=256))

    first = run(3)
    counts = collections.Counter(t for t, _ in first)
    assert len(first) == 10_000
    for tag, weight in zip("abc", (0.6, 0.3, 0.1), strict=True):
        assert abs(counts[tag] / 10_000 - weight) < 0.02, counts
    assert run(3) == first
    assert run(4) != first


def test_stop_first_ends_the_pass_when_one_dataset_runs_out() -> None:
    mix = asyncload.Mix([Tagged("a", 1000), Tagged("b", 20)], [0.5, 0.5], seed=1)
    got = _epoch(_load(mix, num_workers=0))
    counts = collections.Counter(t for t, _ in got)
    assert counts["b"] == 20
    assert counts["a"] < 100  # stopped long before "a" ran out
    assert len(set(got)) == len(got)


@pytest.mark.slow
@pytest.mark.parametrize("num_workers", [0, 2])
def test_stop_all_yields_every_sample_once_across_workers(num_workers: int) -> None:
    mix = asyncload.Mix([Tagged("a", 120), TaggedStream("b", 70)], [0.3, 0.7], seed=5, stop="all")
    got = _epoch(_load(mix, num_workers=num_workers))
    expected = {("a", i) for i in range(120)} | {("b", i) for i in range(70)}
    assert collections.Counter(got) == collections.Counter(expected)


def test_epochs_change_the_choices_and_permutations() -> None:
    mix = asyncload.Mix([Tagged("a", 50), Tagged("b", 50)], seed=2, stop="all")
    loader = _load(mix, num_workers=0)
    loader.set_epoch(0)
    e0 = _epoch(loader)
    loader.set_epoch(1)
    e1 = _epoch(loader)
    assert sorted(e0) == sorted(e1)
    assert e0 != e1


@pytest.mark.slow
@pytest.mark.parametrize(("stop", "samples"), [("all", None), ("first", None), ("first", 400)])
def test_resume_mid_epoch_delivers_the_rest_exactly_once(stop: Any, samples: int | None) -> None:
    def make() -> asyncload.DataLoader[Any]:
        mix = asyncload.Mix(
            [Tagged("a", 150), TaggedStream("b", 90)],
            [0.5, 0.5],
            seed=9,
            stop=stop,
            samples=samples,
        )
        return _load(mix, num_workers=2)

    whole = _epoch(make())
    it = iter(loader := make())
    before = [
        (t, int(i))
        for _, batch in zip(range(5), it, strict=False)
        for t, i in zip(*batch, strict=True)
    ]
    state = loader.state_dict()
    del it
    restored = make()
    restored.load_state_dict(state)
    after = _epoch(restored)
    assert collections.Counter(before + after) == collections.Counter(whole)


def test_bad_arguments_say_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="2 datasets but 3 weights"):
        asyncload.Mix([Tagged("a", 1), Tagged("b", 1)], [1, 1, 1])
    with pytest.raises(ValueError, match="not all 0"):
        asyncload.Mix([Tagged("a", 1)], [0])
    with pytest.raises(ValueError, match="stop must be"):
        asyncload.Mix([Tagged("a", 1)], stop="last")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="samples=N"):
        len(asyncload.Mix([Tagged("a", 1)]))
    assert len(asyncload.Mix([Tagged("a", 1)], samples=7)) == 7


def test_another_num_workers_is_refused_and_the_error_says_why() -> None:
    """A Mix over an iterable that is not elastic resumes per worker: same num_workers only."""

    def make(workers: int) -> asyncload.DataLoader[Any]:
        mix = asyncload.Mix([Tagged("a", 40), TaggedStream("b", 40)], seed=9, stop="all")
        return _load(mix, num_workers=workers)

    it = iter(loader := make(1))
    next(it)
    state = loader.state_dict()
    del it
    assert "readers" not in state
    refused = r"num_workers=1.*Mix of map-style datasets and TarShards.*ElasticIterable"
    with pytest.raises(ValueError, match=refused):
        make(2).load_state_dict(state)
