"""asyncload.DataLoader against torch's DataLoader, over a real loopback HTTP server."""

from __future__ import annotations

import asyncio
import collections
import time
import warnings
from typing import Any

import pytest
import torch
import torch.utils.data

import asyncload
from asyncload._storage import api as _storage

from .._datasets import (
    AsyncBatched,
    Batched,
    InFlight,
    LocalFiles,
    Numbers,
    ShardedNumbers,
    SyncIterable,
    SyncNumbers,
    WhoAmI,
    put_numbers,
)

pytestmark = pytest.mark.usefixtures("no_leaks")


def _as_lists(batches: Any) -> list[Any]:
    return [b.tolist() if isinstance(b, torch.Tensor) else b for b in batches]


def _torch_batches(n: int, seed: int | None, **kwargs: Any) -> list[Any]:
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return _as_lists(torch.utils.data.DataLoader(list(range(n)), generator=gen, **kwargs))


def _ours(base: str, n: int, seed: int | None, **kwargs: Any) -> list[Any]:
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return _as_lists(asyncload.DataLoader(Numbers(base, n), generator=gen, **kwargs))


@pytest.mark.parametrize(
    ("num_workers", "batch_size", "shuffle", "drop_last"),
    [
        (0, 1, False, False),
        (0, 7, True, False),
        (0, 32, True, True),
        (1, 5, False, True),
        (1, 16, True, False),
        (2, 1, True, False),
        (2, 7, False, False),
        (2, 32, True, True),
        (2, None, True, False),
    ],
)
def test_same_batches_as_torch(
    http_server: Any, num_workers: int, batch_size: int | None, shuffle: bool, drop_last: bool
) -> None:
    n = 203
    base = put_numbers(http_server, n)
    http_server.jitter = 0.005  # completions arrive out of order
    kwargs = {"batch_size": batch_size, "shuffle": shuffle, "drop_last": drop_last}
    expected = _torch_batches(n, 1234, **kwargs)
    got = _ours(base, n, 1234, num_workers=num_workers, **kwargs)
    assert got == expected


@pytest.mark.parametrize("num_workers", [0, 2])
def test_custom_sampler_batch_sampler_and_collate(http_server: Any, num_workers: int) -> None:
    n = 60
    base = put_numbers(http_server, n)
    sampler = list(range(n - 1, -1, -3))
    got = _ours(base, n, None, sampler=sampler, batch_size=4, num_workers=num_workers)
    assert got == _torch_batches(n, None, sampler=sampler, batch_size=4)

    batch_sampler = [[1, 2, 3], [50], [7, 7, 8], [0, 59, 30, 31]]
    got = _ours(base, n, None, batch_sampler=batch_sampler, num_workers=num_workers)
    assert got == _torch_batches(n, None, batch_sampler=batch_sampler)

    got = _ours(base, n, 3, batch_size=5, shuffle=True, collate_fn=sorted, num_workers=num_workers)
    assert got == _torch_batches(n, 3, batch_size=5, shuffle=True, collate_fn=sorted)


def test_in_order_false_yields_the_same_multiset(http_server: Any) -> None:
    n = 150
    base = put_numbers(http_server, n)
    http_server.jitter = 0.01
    got = _ours(base, n, 7, batch_size=6, shuffle=True, num_workers=2, in_order=False)
    expected = _torch_batches(n, 7, batch_size=6, shuffle=True)
    key = collections.Counter(tuple(b) for b in got)
    assert key == collections.Counter(tuple(b) for b in expected)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_every_index_exactly_once_per_epoch(http_server: Any, num_workers: int) -> None:
    n = 1000
    base = put_numbers(http_server, n)
    http_server.jitter = 0.01
    loader = asyncload.DataLoader(
        Numbers(base, n), batch_size=32, shuffle=True, num_workers=num_workers, max_concurrency=64
    )
    for _epoch in range(2):
        seen = [i for batch in loader for i in batch.tolist()]
        assert sorted(seen) == list(range(n))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_many_samples_in_flight_across_batches(http_server: Any, num_workers: int) -> None:
    n = 256
    base = put_numbers(http_server, n)
    http_server.latency = 0.05
    loader = asyncload.DataLoader(
        InFlight(base, n),
        batch_size=8,
        num_workers=num_workers,
        max_concurrency=64,
        collate_fn=list,
    )
    peak = max(active for batch in loader for _, active in batch)
    # Batches of 8 with 64 in flight: the worker must overlap many batches, not one at a time.
    assert peak > 3 * 8, peak
    assert peak <= 64


@pytest.mark.asyncio
@pytest.mark.parametrize("num_workers", [0, 2])
async def test_async_for_does_not_block_the_running_loop(
    http_server: Any, num_workers: int
) -> None:
    n = 64
    base = put_numbers(http_server, n)
    http_server.latency = 0.02
    ticks = 0
    stop = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await asyncio.sleep(0.005)

    task = asyncio.create_task(ticker())
    seen: list[int] = []
    loader = asyncload.DataLoader(Numbers(base, n), batch_size=4, num_workers=num_workers)
    async for batch in loader:
        seen.extend(batch.tolist())
    stop.set()
    await task
    assert seen == list(range(n))
    assert ticks >= 5  # the loop kept running while the loader waited for data


@pytest.mark.parametrize("num_workers", [1, 2, 3])
@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_iterable_with_shard_yields_each_item_once(
    http_server: Any, num_workers: int, lazy: bool
) -> None:
    n = 100
    base = put_numbers(http_server, n)
    loader = asyncload.DataLoader(
        ShardedNumbers(base, n, lazy=lazy), batch_size=8, num_workers=num_workers
    )
    seen = [i for batch in loader for i in batch.tolist()]
    assert sorted(seen) == list(range(n))


def test_iterable_order_matches_torch_round_robin(http_server: Any) -> None:
    n = 50
    loader = asyncload.DataLoader(SyncIterable(n), batch_size=4, num_workers=2)
    expected = _as_lists(torch.utils.data.DataLoader(SyncIterable(n), batch_size=4, num_workers=2))
    assert _as_lists(loader) == expected
    loader = asyncload.DataLoader(SyncIterable(n), batch_size=4, num_workers=2, drop_last=True)
    expected = _as_lists(
        torch.utils.data.DataLoader(SyncIterable(n), batch_size=4, num_workers=2, drop_last=True)
    )
    assert _as_lists(loader) == expected


@pytest.mark.parametrize("num_workers", [0, 2])
def test_plain_torch_datasets_work_unchanged(num_workers: int) -> None:
    got = _as_lists(
        asyncload.DataLoader(SyncNumbers(40, delay=0.001), batch_size=6, num_workers=num_workers)
    )
    assert got == _torch_batches(40, None, batch_size=6)
    got = _as_lists(asyncload.DataLoader(SyncIterable(23), batch_size=5, num_workers=num_workers))
    assert sorted(i for b in got for i in b) == list(range(23))


def test_worker_info_seeds_and_init_fn() -> None:
    loader = asyncload.DataLoader(
        WhoAmI(40),
        batch_size=4,
        num_workers=2,
        collate_fn=list,
        generator=torch.Generator().manual_seed(5),
    )
    rows = [row for batch in loader for row in batch]
    by_worker = collections.defaultdict(set)
    for _index, pid, ours, theirs, _rand in rows:
        assert ours == theirs
        by_worker[ours].add(pid)
    assert set(by_worker) == {0, 1}
    assert all(len(pids) == 1 for pids in by_worker.values())
    assert by_worker[0] != by_worker[1]
    # Seeds: per worker, and the same again for the same generator seed.
    again = asyncload.DataLoader(
        WhoAmI(40),
        batch_size=4,
        num_workers=2,
        collate_fn=list,
        generator=torch.Generator().manual_seed(5),
    )
    assert [r[4] for b in again for r in b] == [r[4] for r in rows]
    assert asyncload.get_worker_info() is None


def test_len_and_torch_isinstance(http_server: Any) -> None:
    loader = asyncload.DataLoader(Numbers("http://127.0.0.1:1", 10), batch_size=3)
    assert len(loader) == 4
    assert isinstance(loader, torch.utils.data.DataLoader)
    with pytest.raises(ValueError, match="max_concurrency"):
        asyncload.DataLoader(Numbers("http://127.0.0.1:1", 10), max_concurrency=0)
    with pytest.raises(ValueError, match="prefetch_factor"):
        asyncload.DataLoader(Numbers("http://127.0.0.1:1", 10), prefetch_factor=2)


def test_pin_memory_without_accelerator_warns_and_carries_on(http_server: Any) -> None:
    if torch.accelerator.is_available():
        pytest.skip("an accelerator is present: pinning really happens")
    base = put_numbers(http_server, 10)
    with pytest.warns(UserWarning, match="pin_memory"):
        got = _ours(base, 10, None, batch_size=5, pin_memory=True)
    assert got == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _ours(base, 10, None, batch_size=5, pin_memory=True)  # warned once only


def test_stats_count_samples_and_wait(http_server: Any) -> None:
    base = put_numbers(http_server, 64)
    http_server.latency = 0.01
    loader = asyncload.DataLoader(Numbers(base, 64), batch_size=8, num_workers=2)
    for _ in loader:
        pass
    s = loader.stats()
    assert s.batches == 8
    assert s.samples == 64
    assert s.bytes > 0
    assert s.latency_p50 >= 0.01
    assert s.latency_p50 <= s.latency_p95 <= s.latency_p99
    assert s.wait_s > 0
    assert len(s.in_flight) == 2
    # The pass is over: its clock stopped, so the rates don't decay while nobody iterates.
    time.sleep(0.2)
    assert loader.stats().elapsed_s == s.elapsed_s
    # Worker start-up is time the training loop waited for data.
    assert s.wait_s >= 0.5 * s.elapsed_s


def test_tensors_of_every_size_and_dtype_cross_intact() -> None:
    loader = asyncload.DataLoader(_Tensors(), batch_size=2, num_workers=1, collate_fn=list)
    got = [t for batch in loader for t in batch]
    want = [_Tensors.make(i) for i in range(len(_Tensors()))]
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype
        assert a.shape == b.shape
        assert torch.equal(a, b)


class _Tensors(asyncload.Dataset[torch.Tensor]):
    """Small (sent inline) and large (sent through shared memory) tensors, odd layouts too."""

    @staticmethod
    def make(i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(i)
        kinds = [
            lambda: torch.tensor(i),  # 0-dim
            lambda: torch.empty(0, 3),
            lambda: torch.rand(5, 7, generator=g).t(),  # non-contiguous
            lambda: torch.randint(0, 255, (3, 256, 256), generator=g, dtype=torch.uint8),
            lambda: torch.rand(4, generator=g, dtype=torch.float64).to(torch.bfloat16),
            lambda: torch.tensor([True, False, True]),
            lambda: torch.complex(torch.rand(3, generator=g), torch.rand(3, generator=g)).conj(),
            lambda: torch.rand(300, 300, generator=g),  # larger than the inline limit
        ]
        return kinds[i % len(kinds)]()

    def __len__(self) -> int:
        return 16

    async def __getitem__(self, index: int) -> torch.Tensor:
        return self.make(index)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_connection_pool_admits_max_concurrency(http_server: Any, num_workers: int) -> None:
    n = 400
    base = put_numbers(http_server, n)
    http_server.latency = 0.1
    # Hedges (up to 5% more requests, tested in storage/test_hedge.py) are not samples: off here, so
    # the server counts the loader's own requests only.
    asyncload.configure(http_server.url, hedge=None)
    loader = asyncload.DataLoader(
        Numbers(base, n), batch_size=10, num_workers=num_workers, max_concurrency=100
    )
    assert sorted(i for b in loader for i in b.tolist()) == list(range(n))
    # More than the storage layer's default pool of 64 reached the server at once.
    assert http_server.peak_active > 64, http_server.peak_active
    assert http_server.peak_active <= 100


@pytest.mark.parametrize("num_workers", [0, 1])
def test_getitems_is_called_per_batch_as_torch_does(num_workers: int) -> None:
    expected = _as_lists(torch.utils.data.DataLoader(Batched(), batch_size=4, collate_fn=list))
    assert expected[0] == ["batch4:0", "batch4:1", "batch4:2", "batch4:3"]
    for ds in (Batched(), AsyncBatched()):
        loader = asyncload.DataLoader(ds, batch_size=4, num_workers=num_workers, collate_fn=list)
        assert _as_lists(loader) == expected


@pytest.mark.parametrize("num_workers", [0, 2])
def test_subset_and_concat_of_async_datasets(http_server: Any, num_workers: int) -> None:
    base = put_numbers(http_server, 30)
    subset = torch.utils.data.Subset(Numbers(base, 30), [29, 3, 7, 11, 0])
    concat = torch.utils.data.ConcatDataset([Numbers(base, 30), subset])
    got = _as_lists(asyncload.DataLoader(concat, batch_size=7, num_workers=num_workers))
    plain = torch.utils.data.ConcatDataset([list(range(30)), [29, 3, 7, 11, 0]])
    assert got == _as_lists(torch.utils.data.DataLoader(plain, batch_size=7))


class _PoolProbe(asyncload.Dataset):
    """Reads its URL and answers the connection-pool size its clients are built with."""

    def __init__(self, url: str) -> None:
        self.url = url

    def __len__(self) -> int:
        return 4

    async def __getitem__(self, index: int) -> int:
        assert await asyncload.read(self.url) == b"x"
        return _storage.pool_size()


@pytest.mark.usefixtures("clean_storage")
def test_thread_mode_sizes_its_loops_pool_and_leaves_the_processs(http_server: Any) -> None:
    # num_workers=0: the loop thread's clients admit its requests in flight, as a worker's do,
    # without the loader changing the pool size of every other reader in this process.
    before = _storage.pool_size()
    probe = _PoolProbe(http_server.put("x", b"x"))
    loader = asyncload.DataLoader(probe, batch_size=None, max_concurrency=before + 100)
    assert list(loader) == [before + 100] * 4
    assert _storage.pool_size() == before


def test_thread_mode_stats_count_the_loaders_reads_only(tmp_path: Any) -> None:
    # num_workers=0 runs the engine in a thread of this process: its stats must not include
    # the application's own reads, made during the pass or after it (design.md B2).
    paths = []
    for i in range(6):
        p = tmp_path / f"{i}.bin"
        p.write_bytes(b"x" * 100)
        paths.append(str(p))
    loader = asyncload.DataLoader(LocalFiles(paths), batch_size=3, collate_fn=list)
    it = iter(loader)
    next(it)
    asyncio.run(asyncload.read(paths[0]))  # the application's read, mid-pass
    list(it)
    asyncio.run(asyncload.read(paths[1]))  # and after it
    stats = loader.stats()
    assert stats.samples == 6
    assert stats.bytes == 600


class _Index(asyncload.Dataset[int]):
    def __len__(self) -> int:
        return 4

    async def __getitem__(self, index: int) -> int:
        return index


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("num_workers", "persistent"), [(0, False), (2, False), (2, True)])
def test_next_on_a_finished_iterator_raises_stop_iteration_again(
    num_workers: int, persistent: bool
) -> None:
    # The iterator protocol, and torch: a finished iterator keeps saying so.
    loader = asyncload.DataLoader(
        _Index(), batch_size=2, num_workers=num_workers, persistent_workers=persistent
    )
    it = iter(loader)
    assert len(list(it)) == len(loader)
    for _ in range(2):
        with pytest.raises(StopIteration):
            next(it)
