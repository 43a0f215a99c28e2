"""asyncload.shard and rank detection, without processes."""

from __future__ import annotations

import asyncio
import inspect
import logging

import numpy as np
import pytest

import asyncload
from asyncload._dataset import sharding as _sharding


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


# ── DataLoader(auto_shard=...) under torchrun ────────────────────────────────────────────────


def _as_rank(monkeypatch: pytest.MonkeyPatch, rank: int, world: int) -> None:
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setattr(_sharding, "_announced", False)


def test_auto_shard_logs_the_partition_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _as_rank(monkeypatch, rank=1, world=2)
    caplog.set_level(logging.INFO, logger="asyncload")
    loader = asyncload.DataLoader(list(range(8)), batch_size=None)
    assert [int(x) for x in loader] == [1, 3, 5, 7]
    asyncload.DataLoader(list(range(8)), batch_size=None)
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(infos) == 1
    assert "WORLD_SIZE=2" in infos[0]
    assert "rank 1's share" in infos[0]
    assert "4 of 8 samples" in infos[0]
    assert "auto_shard=False" in infos[0]


def test_auto_shard_never_pads_silently(monkeypatch: pytest.MonkeyPatch) -> None:
    _as_rank(monkeypatch, rank=1, world=2)
    with pytest.warns(asyncload.AsyncloadWarning, match=r"repeats 1 of them.*auto_shard=False"):
        loader = asyncload.DataLoader(list(range(5)), batch_size=None)
    assert [int(x) for x in loader] == [1, 3, 0]  # 0 is a repeat: the warning said so


def test_auto_shard_false_reads_everything_as_torch(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _as_rank(monkeypatch, rank=1, world=2)
    caplog.set_level(logging.DEBUG, logger="asyncload")
    loader = asyncload.DataLoader(list(range(5)), batch_size=2, auto_shard=False)
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4]]
    assert not [r for r in caplog.records if "share" in r.getMessage()]
    param = inspect.signature(asyncload.DataLoader).parameters["auto_shard"]
    assert param.kind is inspect.Parameter.KEYWORD_ONLY
