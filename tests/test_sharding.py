"""asyncload.shard and rank detection, without processes."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import asyncload
from asyncload import _sharding


def _as(worker: int, workers: int, rank: int = 0, world: int = 1) -> None:
    _sharding._set_worker_info(
        asyncload.WorkerInfo(
            id=worker, num_workers=workers, seed=0, dataset=None, rank=rank, world_size=world
        )
    )


@pytest.fixture(autouse=True)
def _clear_worker_info() -> object:
    yield
    _sharding._set_worker_info(None)


@pytest.mark.parametrize(("workers", "world"), [(1, 1), (2, 1), (3, 1), (2, 2), (3, 4)])
def test_shards_partition_sequences_iterables_and_arrays(workers: int, world: int) -> None:
    items = list(range(101))
    parts_list, parts_iter, parts_np, parts_async = [], [], [], []
    for rank in range(world):
        for w in range(workers):
            _as(w, workers, rank, world)
            parts_list.extend(asyncload.shard(items))
            parts_iter.extend(asyncload.shard(iter(items)))
            parts_np.extend(asyncload.shard(np.arange(101)).tolist())

            async def collect() -> list[int]:
                async def gen():  # type: ignore[no-untyped-def]
                    for i in items:
                        yield i

                return [i async for i in asyncload.shard(gen())]

            parts_async.extend(asyncio.run(collect()))
    for parts in (parts_list, parts_iter, parts_np, parts_async):
        assert sorted(parts) == items


def test_main_process_uses_rank_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert asyncload.shard(list(range(10))) == [1, 4, 7]
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(ValueError, match="RANK=3"):
        asyncload.shard([1])


def test_no_environment_means_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert asyncload.shard([1, 2, 3]) == [1, 2, 3]
    assert asyncload.get_worker_info() is None
