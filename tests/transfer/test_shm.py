"""Reused shared-memory blocks: NOTE [ Reused shared memory ] in ``_shm.py``."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import pickle
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data

import asyncload
from asyncload._protocol.messages import Failure, Result
from asyncload._transfer import shm as _shm
from asyncload._transfer.pickling import INLINE_MAX, Packed, pack, unpack

pytestmark = [
    pytest.mark.usefixtures("no_leaks"),
    pytest.mark.skipif(not _shm.supported(), reason="no memfd_create on this platform"),
]


@pytest.fixture(autouse=True)
def _no_blocked_loop_check(monkeypatch: pytest.MonkeyPatch) -> None:
    # Four workers on two cores: the blocked-loop watchdog (tested in engine/test_watchdog.py) can
    # take a worker's wait for the GIL or a core for a blocked loop. These tests are about
    # shared memory, so its warning (an error under filterwarnings) is switched off here.
    monkeypatch.setenv("ASYNCLOAD_SLOW_CALLBACK", "0")


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
    # The pools' tokens are forgotten with their workers, which the reaper stops: the finalizer
    # only hands it the job (NOTE [ Who stops workers ]).
    deadline = time.monotonic() + 10
    while mapped_blocks() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert mapped_blocks() == 0


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


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")  # 2-core CI
def test_the_main_process_keeps_no_descriptor_per_mapped_block() -> None:
    # Issue 12 item 18: mmap.mmap kept a duplicate descriptor per block (161 with these options).
    n, batch = 1024, 2
    loader = asyncload.DataLoader(Images(n), batch_size=batch, num_workers=4, max_concurrency=256)
    before = open_fds()
    most, blocks = 0, 0
    for k, got in enumerate(loader):
        if k % 16 == 0:
            assert torch.equal(got, expected([batch * k, batch * k + 1]))
        most = max(most, open_fds())
        blocks = max(blocks, mapped_blocks())
    assert blocks > 100  # many blocks were mapped at once...
    assert most - before < 40, f"{most - before} descriptors opened during the pass"  # ...not fds


class _Mixed(torch.utils.data.Dataset[int]):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> int:
        return index


def mixed_collate(indices: list[int]) -> dict[str, Any]:
    """Ordinary tensors, views into a pooled batch, two views of one storage, small labels."""
    pooled = torch.utils.data.default_collate([sample(i) for i in indices])
    ordinary = torch.stack([sample(i) for i in indices]).float()
    return {
        "ordinary": ordinary,
        "ordinary_rows": ordinary[:, 2:, :],
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
        ordinary = got["ordinary"].untyped_storage().data_ptr()
        assert got["ordinary_rows"].untyped_storage().data_ptr() == ordinary


class _Complex(torch.utils.data.Dataset[int]):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> int:
        return index


def complex_collate(indices: list[int]) -> dict[str, torch.Tensor]:
    """A pooled batch and a conjugate view of it: the view goes torch's way while pickling."""
    x = torch.utils.data.default_collate(
        [torch.full((8192,), complex(i, -i), dtype=torch.complex64) for i in indices]
    )
    return {"x": x, "x_conj": x.conj()}


def test_a_view_pickled_torchs_way_does_not_free_the_block_mid_message() -> None:
    loader = asyncload.DataLoader(
        _Complex(), batch_size=2, num_workers=1, collate_fn=complex_collate, max_concurrency=4
    )
    kept = list(loader)  # every batch kept: a block freed too early would be overwritten
    for k, got in enumerate(kept):
        want = complex_collate([2 * k, 2 * k + 1])
        assert torch.equal(got["x"], want["x"]), f"batch {k} was overwritten"


def test_a_pooled_batch_can_move_to_torch_shared_memory() -> None:
    loader = asyncload.DataLoader(Images(8), batch_size=4, num_workers=1)
    batches = list(loader)
    first = batches[0].clone()
    batches[0].share_memory_()  # copies out of the block, as for any ordinary tensor
    assert batches[0].is_shared()
    assert torch.equal(batches[0], first)


# ── the pool's rules, in one process ──────────────────────────────────────────────────────────


def _send(
    pool: _shm.BlockPool, storage: torch.UntypedStorage
) -> tuple[tuple[Any, ...], tuple[Any, ...], tuple[int, ...]]:
    """Pickle one tensor on *storage* as a worker would.

    Returns the block's pickled arguments ``(token, id, use, nbytes)``, the descriptors that
    travel beside the message and the evicted block ids.
    """
    t = torch.empty((), dtype=torch.uint8).set_(storage)
    ref = pool.ref_for(t)
    assert ref is not None
    pool.begin()
    _, args = pool.reduce_ref(ref)
    fds, evicted = pool.end(sent=True)
    for _, _, dup in fds:  # what the main process does with a block's first descriptor
        os.close(dup.detach())
    return args, fds, evicted


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
@pytest.mark.parametrize("proc_fds", ["1", "0"])
def test_a_new_blocks_descriptor_is_opened_through_proc_or_handed_over(
    proc_fds: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Through /proc the main process needs nothing of the worker (whose resource-sharer thread
    # would have to win its GIL); ASYNCLOAD_PROC_FDS=0 hands it over through a socket instead.
    monkeypatch.setenv("ASYNCLOAD_PROC_FDS", proc_fds)
    pool = _shm.BlockPool("t", max_blocks=4)
    storage = pool.allocate(10_000)
    assert storage is not None
    torch.empty((), dtype=torch.uint8).set_(storage).fill_(42)
    t = torch.empty((), dtype=torch.uint8).set_(storage)
    ref = pool.ref_for(t)
    assert ref is not None
    pool.begin()
    pool.reduce_ref(ref)
    ((_, _, dup),), _ = pool.end(sent=True)
    assert isinstance(dup, _shm.ProcFd) == (proc_fds == "1")
    fd = dup.detach()
    try:
        assert os.pread(fd, 4, 0) == b"\x2a" * 4  # the block's own bytes
    finally:
        os.close(fd)


def test_a_descriptor_that_cannot_be_opened_through_proc_says_what_to_do() -> None:
    with pytest.raises(OSError, match="ASYNCLOAD_PROC_FDS=0"):
        _shm.ProcFd(os.getpid(), 10**6).detach()


def test_a_block_is_reused_only_when_both_sides_let_go() -> None:
    pool = _shm.BlockPool("t", max_blocks=4)
    s = pool.allocate(10_000)
    assert s is not None
    args, fds, _ = _send(pool, s)
    block_id, seq = args[1], args[2]
    assert len(fds) == 1  # the block's descriptor travels until the main process has it
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
    args, _, _ = _send(pool, a)
    del a
    pool.release((args[1], args[2]))
    c = pool.allocate(50_000)  # a new size: the free block of the old size makes room
    assert c is not None
    _, _, evicted = _send(pool, c)
    assert evicted == (args[1],)


def test_a_pool_keeps_few_free_blocks_after_a_burst() -> None:
    pool = _shm.BlockPool("t", max_blocks=8)  # keeps 8 // 4 + 2 = 4 free blocks
    storages = [pool.allocate(5_000) for _ in range(8)]  # a loop that kept 8 batches
    uses = []
    for s in storages:
        assert s is not None
        args, _, _ = _send(pool, s)
        uses += [args[1], args[2]]
    del storages, s
    pool.release(tuple(uses))  # ...then let them all go
    assert len(pool._free) == 4
    assert len(pool._blocks) == 4
    fresh = pool.allocate(5_000)
    assert fresh is not None
    _, _, evicted = _send(pool, fresh)
    assert len(evicted) == 4  # the main process unmaps what the worker dropped


@contextlib.contextmanager
def worker_pool(token: str, **options: Any) -> Iterator[_shm.BlockPool]:
    """A worker's pool installed in this process, whose main side is this process too."""
    _shm.register_token(token)
    pool = _shm.BlockPool(token, min_bytes=INLINE_MAX, **options)
    saved = _shm.pool
    _shm.pool = pool
    try:
        yield pool
    finally:
        _shm.pool = saved
        _shm.unregister_token(token)


def test_the_main_process_maps_a_block_once_and_unmaps_evicted_ones() -> None:
    with worker_pool("test-main", max_blocks=4) as pool:
        storage = pool.allocate(100_000)
        assert storage is not None
        t = torch.empty((), dtype=torch.uint8).set_(storage)
        t.fill_(7)
        msg = pack(Result(0, 0, 0, t))
        assert isinstance(msg, Packed)
        got = unpack(msg).data
        assert torch.equal(got, torch.full((100_000,), 7, dtype=torch.uint8))
        assert len(_shm._maps[pool.token]) == 1
        del got  # the main process is done: the release waits for the next task
        freed = _shm.take_freed(pool.token)
        assert len(freed) == 2
        pool.release(freed)
        del t, storage
        # Reused, and the main process has it mapped: no descriptor travels any more.
        again = pool.allocate(100_000)
        assert again is not None
        assert pool.hits == 1
        _, fds, _ = _send(pool, again)
        assert fds == ()
        _shm.forget_blocks(pool.token, (0,))
        assert _shm._maps[pool.token] == {}


def test_a_large_pickled_batch_travels_in_a_block_and_the_block_is_reused() -> None:
    # A batch of bytes (collate_fn=list over blobs) has no tensor for the block path: its
    # pickle goes into a block instead of the pipe, and the main process gives it back at once.
    with worker_pool("test-stash", max_blocks=4) as pool:
        blobs = [bytes([i]) * 100_000 for i in range(8)]  # 800 KB > STASH_MIN
        msg = pack(Result(3, 0, 0, blobs))
        assert isinstance(msg, Packed)
        assert msg.stashed is not None
        assert msg.payload == b""
        assert len(msg.fds) == 1  # the block's descriptor, the first time
        got = unpack(msg)
        assert (got.send_idx, got.data) == (3, blobs)
        block_id, use, _ = msg.stashed
        freed = _shm.take_freed(pool.token)
        assert freed == (block_id, use)  # given back as soon as it was read
        pool.release(freed)
        again = pack(Result(4, 0, 0, blobs[::-1]))
        assert isinstance(again, Packed)
        assert again.stashed is not None
        assert again.stashed[:2] == (block_id, use + 1)  # the same block, the next use
        assert again.fds == ()  # already mapped in the main process
        assert unpack(again).data == blobs[::-1]
        assert pool.created == 1
        # Small messages still travel inline.
        small = pack(Result(5, 0, 0, [b"x" * 100]))
        assert isinstance(small, Packed)
        assert small.stashed is None


def test_a_stashed_batch_of_mixed_pieces_comes_back_whole() -> None:
    # The pickler hands large payloads to its file as they are and frames the rest: the block
    # must hold them in order, whatever their type.
    batch = {
        "blobs": [bytes([i]) * (60_000 + 7_000 * i) for i in range(6)],
        "mutable": bytearray(b"b" * 200_000),
        "array": np.arange(30_000, dtype=np.int32),
        "text": "t" * 100_000,
        "small": [1, 2.5, None, "x", b"y"],
    }
    with worker_pool("test-stash-mixed", max_blocks=4) as pool:
        for sent in range(2):  # the second time in the block the first one freed
            msg = pack(Result(sent, 0, 0, batch))
            assert isinstance(msg, Packed)
            assert msg.stashed is not None
            got = unpack(msg).data
            assert got.keys() == batch.keys()
            for key in ("blobs", "mutable", "text", "small"):
                assert got[key] == batch[key]
            assert np.array_equal(got["array"], batch["array"])
            pool.release(_shm.take_freed(pool.token))


def test_pieces_count_bytes_whatever_the_buffers_format() -> None:
    # Under pickle protocol 5 (Python 3.14's default) the pickler hands an array's own buffer
    # to write(): 300 rows of float64, whose len() is 300.
    from asyncload._transfer.pickling import _Pieces

    array = np.ones((300, 300))
    out = _Pieces()
    pickle.Pickler(out, protocol=5).dump(array)
    assert any(part.nbytes != len(part) for part in out.parts)
    whole = pickle.dumps(array, protocol=5)
    assert out.nbytes == len(whole)
    assert b"".join(out.parts) == whole
    with worker_pool("test-stash-formats", max_blocks=4) as pool:
        pool.begin()
        ref = pool.stash(out.parts, out.nbytes)
        assert ref is not None
        assert bytes(ref.block.mm[: out.nbytes]) == whole
        pool.end(sent=False)


def test_a_large_pickled_batch_travels_inline_when_the_pool_is_full() -> None:
    with worker_pool("test-stash-full", max_blocks=4, stash_blocks=1) as pool:
        blobs = [bytes([i]) * 100_000 for i in range(4)]
        first = pack(Result(0, 0, 0, blobs))
        second = pack(Result(1, 0, 0, blobs))  # the one block is still the main process's
        assert isinstance(first, Packed)
        assert first.stashed is not None
        assert isinstance(second, Packed)
        assert second.stashed is None
        assert second.payload
        assert unpack(second).data == blobs
        assert unpack(first).data == blobs
        assert pool.fallbacks == 1


def test_stashed_messages_have_their_own_blocks() -> None:
    # Blocks for pickled messages neither count against the storages' max_blocks nor are
    # dropped when free (the look-ahead, not the pool, decides how many are in use).
    pool = _shm.BlockPool("t", max_blocks=1, stash_blocks=8)
    storage = pool.allocate(100_000)
    assert storage is not None
    refs = []
    for _ in range(8):
        pool.begin()
        ref = pool.stash([memoryview(b"m" * 300_000)], 300_000)
        assert ref is not None
        refs.append(ref)
        fds, _ = pool.end(sent=True)
        for _, _, dup in fds:
            os.close(dup.detach())
    assert pool.allocate(100_000) is None  # the one storage block is in use
    pool.begin()
    # Eight stashes are in the main process.
    assert pool.stash([memoryview(b"m" * 300_000)], 300_000) is None
    pool.end(sent=False)
    pool.release(tuple(x for r in refs for x in (r.block.id, r.seq)))
    assert len(pool._free_stash) == 8  # all kept for the next burst
    pool.begin()
    assert pool.stash([memoryview(b"m" * 300_000)], 300_000) is not None
    pool.end(sent=False)
    assert pool.created == 1 + 8
    del storage


class Blobs(asyncload.Dataset[bytes]):
    def __len__(self) -> int:
        return 96

    async def __getitem__(self, index: int) -> bytes:
        return index.to_bytes(4, "little") * 25_000


def test_batches_of_bytes_from_workers_arrive_whole() -> None:
    loader = asyncload.DataLoader(Blobs(), batch_size=16, num_workers=2, collate_fn=list)
    for epoch in range(2):
        seen = [blob for batch in loader for blob in batch]
        assert seen == [i.to_bytes(4, "little") * 25_000 for i in range(96)], epoch


class SmallBlobs(asyncload.Dataset[bytes]):
    def __len__(self) -> int:
        return 3200

    async def __getitem__(self, index: int) -> bytes:
        await asyncio.sleep(0.01)  # a remote read: the training loop keeps up
        return index.to_bytes(4, "little") * 10_000


def test_blocks_go_back_to_their_worker_without_waiting_for_a_task() -> None:
    # All 400 batches are sent at once (the look-ahead allows it), so no task carries the
    # main process's releases back: they travel on their own, and each worker cycles
    # through a few blocks instead of mapping one per batch it stashes.
    loader = asyncload.DataLoader(
        SmallBlobs(), batch_size=8, num_workers=2, collate_fn=list, max_concurrency=16
    )
    most = 0
    for k, batch in enumerate(loader):
        assert batch[0] == (8 * k).to_bytes(4, "little") * 10_000
        most = max(most, mapped_blocks())
    assert 0 < most <= 2 * 24, most


def test_a_batch_outlives_its_killed_worker() -> None:
    loader = asyncload.DataLoader(Images(400), batch_size=4, num_workers=1)
    it = iter(loader)
    first = next(it)
    assert not first.is_shared()  # on a pooled block
    os.kill(it.worker_pids[0], signal.SIGKILL)
    with contextlib.suppress(asyncload.WorkerError):  # unless every batch was already out
        for _ in it:
            pass
    del it
    assert torch.equal(first, expected([0, 1, 2, 3]))  # the memfd lives while mapped here


def test_a_batch_that_fails_to_pickle_leaves_no_descriptor_behind() -> None:
    token = "test-fail"
    pool = _shm.BlockPool(token, max_blocks=4, min_bytes=INLINE_MAX)
    saved = _shm.pool
    _shm.pool = pool
    try:
        fds_before = 0
        for attempt in range(20):
            if attempt == 1:  # after the first: lazily opened files are open by now
                fds_before = len(os.listdir("/proc/self/fd"))
            storage = pool.allocate(100_000)
            assert storage is not None
            batch = [torch.empty((), dtype=torch.uint8).set_(storage), lambda: None]
            reply = pack(Result(0, 0, 0, batch))
            del batch, storage
            assert isinstance(reply, Failure)
        assert len(os.listdir("/proc/self/fd")) == fds_before
        assert pool.created == 1  # the one block, freed after every failure
        assert pool.hits == 19
    finally:
        _shm.pool = saved


def test_a_batch_collected_while_the_pool_is_busy_does_not_deadlock() -> None:
    # The finalizer of a pooled storage may run inside a garbage collection that starts while
    # the pool's own thread holds its lock (a batch in a reference cycle, e.g. a traceback).
    pool = _shm.BlockPool("t", max_blocks=8)
    storage = pool.allocate(100_000)
    holder = [torch.empty((), dtype=torch.uint8).set_(storage)]
    del storage
    fired: list[bool] = []

    def make_garbage(phase: str, info: dict[str, Any]) -> None:
        if phase == "start" and pool._lock.locked() and holder:
            cycle: list[Any] = [holder.pop()]
            cycle.append(cycle)
            fired.append(True)

    def churn() -> None:
        for _ in range(2000):
            pool.allocate(100_000)

    gc.callbacks.append(make_garbage)
    threshold = gc.get_threshold()
    gc.set_threshold(1)
    try:
        worker = threading.Thread(target=churn, daemon=True)
        worker.start()
        worker.join(10)
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(make_garbage)
    assert fired, "no collection ran under the lock: the test did not exercise the case"
    assert not worker.is_alive(), "pool.allocate() deadlocked on its own lock"


def test_a_forked_child_does_not_inherit_the_pool_or_mappings() -> None:
    token = "test-fork"
    _shm.register_token(token)
    saved = _shm.pool
    _shm.pool = _shm.BlockPool(token, max_blocks=2)
    try:
        pid = os.fork()
        if pid == 0:  # the child: exit at once with what it sees, never return into pytest
            os._exit(0 if _shm.pool is None and token not in _shm._maps else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert _shm.pool is not None  # the parent keeps its own
    finally:
        _shm.pool = saved
        _shm.unregister_token(token)


# -- what a killed worker left of torch's own path ------------------------------------------


# Above PID_MAX_LIMIT (2**22): no process ever has it.
_DEAD = 4_194_305


def test_sweep_dead_unlinks_the_dead_workers_torch_segments_only(tmp_path: Any) -> None:
    d = _DEAD
    names = [f"torch_{d}_9_1", f"torch_{d}_77_2", f"torch_{d}1_9_1", f"torch_{d // 10}_3_4"]
    for name in [*names, "sem.mp-x"]:
        (tmp_path / name).write_bytes(b"")
    assert sorted(_shm.sweep_dead(d, str(tmp_path))) == sorted(names[:2])
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([*names[2:], "sem.mp-x"])


def test_sweep_dead_leaves_a_live_pids_names(tmp_path: Any) -> None:
    # The pid in use again (the dead worker's was reaped long ago): the names may be the new
    # process's, between its shm_open and its unlink.
    (tmp_path / f"torch_{os.getpid()}_9_1").write_bytes(b"")
    assert _shm.sweep_dead(os.getpid(), str(tmp_path)) == []
    assert (tmp_path / f"torch_{os.getpid()}_9_1").exists()


def test_sweep_dead_leaves_file_system_segments_named(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Under file_system a name lives as long as its storage, which this process may hold.
    monkeypatch.setattr(torch.multiprocessing, "get_sharing_strategy", lambda: "file_system")
    (tmp_path / f"torch_{_DEAD}_9_1").write_bytes(b"")
    assert _shm.sweep_dead(_DEAD, str(tmp_path)) == []
    assert (tmp_path / f"torch_{_DEAD}_9_1").exists()
