"""Reused shared-memory blocks: NOTE [ Reused shared memory ] in ``_shm.py``."""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Any

import pytest
import torch
import torch.utils.data

import asyncload
from asyncload import _shm
from asyncload._protocol import Result
from asyncload._queues import INLINE_MAX, Packed, pack, unpack

pytestmark = [
    pytest.mark.usefixtures("no_leaks"),
    pytest.mark.skipif(not _shm.supported(), reason="no memfd_create on this platform"),
]

ROWS = 128  # a sample is ROWS × 1 KiB: twice the inline limit, so it takes the block path


def sample(i: int) -> torch.Tensor:
    """Sample i: every byte of row r is (i * 7 + r) % 251, so any mix-up shows."""
    rows = (torch.arange(ROWS, dtype=torch.int64) + i * 7) % 251
    return rows.to(torch.uint8)[:, None].expand(ROWS, 1024).contiguous()


class Images(asyncload.Dataset[torch.Tensor]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, index: int) -> torch.Tensor:
        return sample(index)


def expected(indices: list[int]) -> torch.Tensor:
    return torch.stack([sample(i) for i in indices])


def mapped_blocks() -> int:
    """Blocks the main process has mapped, over every live worker pool."""
    return sum(len(blocks) for blocks in _shm._maps.values())


# ── through the DataLoader ────────────────────────────────────────────────────────────────────


def test_blocks_are_reused_across_batches_and_epochs() -> None:
    n, batch = 96, 4
    loader = asyncload.DataLoader(
        Images(n), batch_size=batch, num_workers=2, max_concurrency=8, persistent_workers=True
    )
    most = 0
    for _ in range(3):
        for k, got in enumerate(loader):
            assert torch.equal(got, expected(list(range(k * batch, (k + 1) * batch))))
            assert not got.is_shared()  # a pooled block, not a fresh torch segment
            most = max(most, mapped_blocks())
    # 72 batches crossed; each worker's pool holds at most 4 × outstanding + 8 = 20 blocks.
    assert 0 < most <= 2 * 20
    del loader
    assert mapped_blocks() == 0  # the pools' tokens are forgotten with their workers


def test_batches_kept_by_the_loop_stay_intact_when_the_pool_runs_out() -> None:
    n, batch = 160, 2
    loader = asyncload.DataLoader(Images(n), batch_size=batch, num_workers=2, max_concurrency=2)
    kept = list(loader)  # 80 batches held: more than the pools have blocks (2 × 16)
    # Workers exited at the end of the pass; their blocks stay mapped while batches view them.
    for k, got in enumerate(kept):
        assert torch.equal(got, expected([2 * k, 2 * k + 1])), f"batch {k} was overwritten"
    # Once the pools were full, batches went through torch's own shared memory.
    assert any(b.is_shared() for b in kept)
    assert any(not b.is_shared() for b in kept)


class _Mixed(torch.utils.data.Dataset[int]):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> int:
        return index


def mixed_collate(indices: list[int]) -> dict[str, Any]:
    """Ordinary tensors, views into a pooled batch, two views of one storage, small labels."""
    pooled = torch.utils.data.default_collate([sample(i) for i in indices])
    return {
        "ordinary": torch.stack([sample(i) for i in indices]).float(),
        "view": pooled[:, 1:, ::2],
        "first": pooled[0],
        "pooled": pooled,
        "labels": torch.tensor(indices),
    }


def test_views_ordinary_tensors_and_shared_storages_cross_intact() -> None:
    loader = asyncload.DataLoader(_Mixed(), batch_size=3, num_workers=1, collate_fn=mixed_collate)
    for k, got in enumerate(loader):
        want = mixed_collate(list(range(3 * k, 3 * k + 3)))
        for key, value in want.items():
            assert got[key].shape == value.shape, key
            assert got[key].stride() == value.stride(), key
            assert torch.equal(got[key], value), key
        # Views of one batch still share its storage after the crossing, as under torch.
        assert (
            got["view"].untyped_storage().data_ptr() == got["pooled"].untyped_storage().data_ptr()
        )
        assert (
            got["first"].untyped_storage().data_ptr() == got["pooled"].untyped_storage().data_ptr()
        )


def test_a_pooled_batch_can_move_to_torch_shared_memory() -> None:
    loader = asyncload.DataLoader(Images(8), batch_size=4, num_workers=1)
    batches = list(loader)
    first = batches[0].clone()
    batches[0].share_memory_()  # copies out of the block, as for any ordinary tensor
    assert batches[0].is_shared()
    assert torch.equal(batches[0], first)


# ── the pool's rules, in one process ──────────────────────────────────────────────────────────


def _send(pool: _shm.BlockPool, storage: torch.UntypedStorage) -> tuple[Any, tuple[int, ...]]:
    """Pickle one tensor on *storage* as a worker would; returns (payload, evicted)."""
    t = torch.empty((), dtype=torch.uint8).set_(storage)
    ref = pool.ref_for(t)
    assert ref is not None
    pool.begin()
    reduced = pool.reduce_ref(ref)
    evicted = pool.end(sent=True)
    fd = reduced[1][5]
    if fd is not None:  # what the main process does with a block's first descriptor
        os.close(fd.detach())
    return reduced, evicted


def test_a_block_is_reused_only_when_both_sides_let_go() -> None:
    pool = _shm.BlockPool("t", max_blocks=4)
    s = pool.allocate(10_000)
    assert s is not None
    (_, args), _ = _send(pool, s)
    block_id, seq = args[1], args[2]
    assert args[5] is not None  # the block's descriptor travels until the main process has it
    del s  # the worker's storage is gone, but the main process still has the batch
    assert pool.allocate(10_000) is not None
    assert pool.created == 2
    assert pool.hits == 0
    pool.release((block_id, seq + 1))  # a release for another use changes nothing
    pool.release((block_id, seq))
    pool.release((block_id, seq))  # nor does a repeated one
    assert pool._blocks[block_id].fd == -1  # mapped in the main process: descriptor closed
    again = pool.allocate(10_000)
    assert again is not None
    assert pool.hits == 1
    assert pool.created == 2


def test_a_full_pool_falls_back_then_evicts_free_blocks_of_other_sizes() -> None:
    pool = _shm.BlockPool("t", max_blocks=2)
    a, b = pool.allocate(5_000), pool.allocate(5_000)
    assert a is not None
    assert b is not None
    assert pool.allocate(5_000) is None  # both in use: torch's path
    assert pool.fallbacks == 1
    (_, args), _ = _send(pool, a)
    del a
    pool.release((args[1], args[2]))
    c = pool.allocate(50_000)  # a new size: the free block of the old size makes room
    assert c is not None
    _, evicted = _send(pool, c)
    assert evicted == (args[1],)


def test_a_pool_keeps_few_free_blocks_after_a_burst() -> None:
    pool = _shm.BlockPool("t", max_blocks=8)  # keeps 8 // 4 + 2 = 4 free blocks
    storages = [pool.allocate(5_000) for _ in range(8)]  # a loop that kept 8 batches
    uses = []
    for s in storages:
        assert s is not None
        (_, args), _ = _send(pool, s)
        uses += [args[1], args[2]]
    del storages, s
    pool.release(tuple(uses))  # ...then let them all go
    assert len(pool._free) == 4
    assert len(pool._blocks) == 4
    fresh = pool.allocate(5_000)
    assert fresh is not None
    _, evicted = _send(pool, fresh)
    assert len(evicted) == 4  # the main process unmaps what the worker dropped


def test_the_main_process_maps_a_block_once_and_unmaps_evicted_ones() -> None:
    token = "test-main"
    _shm.register_token(token)
    pool = _shm.BlockPool(token, max_blocks=4, min_bytes=INLINE_MAX)
    saved = _shm.pool
    _shm.pool = pool
    try:
        storage = pool.allocate(100_000)
        assert storage is not None
        t = torch.empty((), dtype=torch.uint8).set_(storage)
        t.fill_(7)
        msg = pack(Result(0, 0, 0, t))
        assert isinstance(msg, Packed)
        got = unpack(msg).data
        assert torch.equal(got, torch.full((100_000,), 7, dtype=torch.uint8))
        assert len(_shm._maps[token]) == 1
        del got  # the main process is done: the release waits for the next task
        freed = _shm.take_freed(token)
        assert len(freed) == 2
        pool.release(freed)
        del t, storage
        # Reused, and the main process has it mapped: no descriptor travels any more.
        again = pool.allocate(100_000)
        assert again is not None
        assert pool.hits == 1
        (_, args), _ = _send(pool, again)
        assert args[5] is None
        _shm.forget_blocks(token, (0,))
        assert _shm._maps[token] == {}
    finally:
        _shm.pool = saved
        _shm.unregister_token(token)


def test_a_batch_outlives_its_killed_worker() -> None:
    loader = asyncload.DataLoader(Images(400), batch_size=4, num_workers=1)
    it = iter(loader)
    first = next(it)
    assert not first.is_shared()  # on a pooled block
    os.kill(it._workers[0].pid, signal.SIGKILL)
    with contextlib.suppress(asyncload.WorkerError):  # unless every batch was already out
        for _ in it:
            pass
    del it
    assert torch.equal(first, expected([0, 1, 2, 3]))  # the memfd lives while mapped here
