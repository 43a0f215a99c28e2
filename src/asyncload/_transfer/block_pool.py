"""The worker's side of NOTE [ Reused shared memory ] (in ``_transfer/shm.py``): its ``BlockPool``.

A pool hands out memfd blocks as storages, takes them back when both sides are done with a use,
and pickles the blocks a message names as references whose descriptors travel beside it.
``_transfer/shm.py`` installs one pool per worker process and re-exports ``BlockPool`` and
``BlockRef``.
"""

from __future__ import annotations

import collections
import mmap
import os
import threading
import weakref
from collections.abc import Sequence
from multiprocessing.reduction import DupFd
from typing import Any, NamedTuple

import numpy as np
import torch

from .block_mirror import _open_block

__all__ = ["MAX_POOL_BYTES", "BlockPool", "BlockRef", "ProcFd"]

_PAGE = mmap.PAGESIZE
MAX_POOL_BYTES = 1 << 30
"""A worker's blocks never add up to more than this; beyond it, torch's shared memory is used."""
STASH_BLOCKS = 256
"""Blocks a pool may hold for pickled messages (``BlockPool.stash``), besides its storages."""


class ProcFd(NamedTuple):
    """A block's descriptor as the main process opens it itself: ``/proc/<pid>/fd/<fd>``.

    ``DupFd`` hands a descriptor over through the worker's resource-sharer thread, which must
    win the worker's GIL while its loop is busiest (a new worker's first batches): 10-25 ms
    per new block. A process may open the descriptors of its own children (same user) through
    /proc without their help; the worker keeps *fd* open until the main process says it mapped
    the block. ``ASYNCLOAD_PROC_FDS=0`` goes back to ``DupFd`` where /proc is restricted.
    """

    pid: int
    fd: int

    def detach(self) -> int:
        path = f"/proc/{self.pid}/fd/{self.fd}"
        try:
            return os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise OSError(
                exc.errno,
                f"asyncload: can't open a worker's shared-memory block through {path} "
                f"({exc.strerror}); if /proc is restricted here, set ASYNCLOAD_PROC_FDS=0 "
                "to pass descriptors through sockets instead",
            ) from exc


def _proc_fds() -> bool:
    return os.environ.get("ASYNCLOAD_PROC_FDS", "1") != "0" and os.path.isdir("/proc/self/fd")


def _round_up(n: int) -> int:
    return max(_PAGE, -(-n // _PAGE) * _PAGE)


def _size_class(n: int) -> int:
    """A block size for a copy of *n* bytes: eighths of a power of two, so that messages of
    similar sizes reuse one another's blocks (at most 1/8 wasted)."""
    step = max(_PAGE, (1 << (max(n, 1) - 1).bit_length()) // 8)
    return -(-n // step) * step


class _Block:
    __slots__ = (
        "addr",
        "cap",
        "fd",
        "id",
        "in_main",
        "in_worker",
        "mapped",
        "mm",
        "packing",
        "ref",
        "seq",
        "stash",
    )

    def __init__(self, block_id: int, cap: int, stash: bool) -> None:
        self.id = block_id
        self.cap = cap
        self.stash = stash  # holds pickled messages (BlockPool.stash), never a storage
        self.fd = os.memfd_create(f"asyncload-{block_id}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, cap)
            self.mm = mmap.mmap(self.fd, cap)
        except BaseException:
            os.close(self.fd)
            raise
        self.addr = np.frombuffer(self.mm, dtype=np.uint8).ctypes.data
        self.seq = 0
        self.in_worker = False  # a storage of this process views the block
        self.in_main = False  # the main process has a batch on it (use ``seq``)
        self.packing = False  # named in the message being pickled: not free whatever happens
        self.mapped = False  # the main process has told us it mapped the block
        self.ref: BlockRef | None = None

    def close_fd(self) -> None:
        """Once the main process has the block mapped, its descriptor is needed no more."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def close(self) -> None:
        self.close_fd()
        # Views the worker still holds keep the mapping alive; the pool just lets go of it.
        self.mm = None  # type: ignore[assignment]


class BlockRef:
    """What a pooled storage pickles as; one object per use, so pickle's memo shares it."""

    __slots__ = ("block", "nbytes", "seq")

    def __init__(self, block: _Block, seq: int, nbytes: int) -> None:
        self.block, self.seq, self.nbytes = block, seq, nbytes


class BlockPool:
    """A worker's reusable shared-memory blocks (see NOTE [ Reused shared memory ]).

    Args:
        token: Names this worker's pool in the main process.
        max_blocks: At most this many blocks exist at once; about a quarter of that many are
            kept when free.
        min_bytes: Storages up to this size are not pooled (they travel inside the message).
        max_bytes: Blocks add up to at most this many bytes.
        stash_blocks: At most this many more blocks hold pickled messages (``stash``).

    Blocks that held pickled messages are kept when free (up to *max_bytes*): the look-ahead
    decides how many batches run ahead of the training loop, and so how many such blocks are
    in use at once (their bytes are bounded by ``prefetch_bytes``); dropping them after a
    burst only to map new ones at the next cost a worker ~3x the CPU per batch.
    """

    def __init__(
        self,
        token: str,
        *,
        max_blocks: int,
        min_bytes: int = 0,
        max_bytes: int = MAX_POOL_BYTES,
        stash_blocks: int = STASH_BLOCKS,
    ) -> None:
        self.token = token
        self.min_bytes = min_bytes
        self.max_blocks = max_blocks
        self.max_free = max_blocks // 4 + 2
        self.max_bytes = max_bytes
        self.stash_blocks = stash_blocks
        self._proc_fds = _proc_fds()
        self._lock = threading.Lock()
        self._blocks: dict[int, _Block] = {}
        self._by_addr: dict[int, _Block] = {}
        self._free: collections.OrderedDict[int, _Block] = collections.OrderedDict()
        self._free_stash: collections.OrderedDict[int, _Block] = collections.OrderedDict()
        self._stashes = 0  # blocks with .stash, free or not
        self._bytes = 0
        self._next_id = 0
        self._evicted: list[int] = []
        self._packing: list[_Block] | None = None
        self._keepalive: list[torch.UntypedStorage] = []  # copies made while pickling a message
        self._copies: dict[tuple[int, int], BlockRef] = {}  # source storage → its copy's block
        # Worker-side storages that died, as (id, use): appended by a finalizer, which may run
        # in any thread *and* inside a garbage collection that started while this thread held
        # the lock, so it must not take the lock itself; drained under the lock.
        self._dropped: collections.deque[tuple[int, int]] = collections.deque()
        self.hits = 0
        self.created = 0
        self.fallbacks = 0

    # allocation

    def allocate(self, nbytes: int) -> torch.UntypedStorage | None:
        """A storage of *nbytes* on a pooled block, or None when the pool is full."""
        with self._lock:
            block = self._new_use(_round_up(nbytes), nbytes, stash=False)
            if block is None:
                return None
            block.in_worker = True
            seq = block.seq
        arr = np.frombuffer(block.mm, dtype=np.uint8, count=nbytes)
        weakref.finalize(arr, self._worker_done, block.id, seq)
        return torch.from_numpy(arr).untyped_storage()

    def _new_use(self, cap: int, nbytes: int, *, stash: bool) -> _Block | None:
        """A free block of *cap* bytes or a new one, for its next use; under the lock."""
        self._drain_dropped()
        free = self._free_stash if stash else self._free
        block = self._take_free(free, cap) or self._create(cap, stash=stash)
        if block is None:
            self.fallbacks += 1
            return None
        block.seq += 1
        block.ref = BlockRef(block, block.seq, nbytes)
        return block

    def _take_free(self, free: dict[int, _Block], cap: int) -> _Block | None:
        for block in free.values():  # oldest first: every block stays warm in turn
            if block.cap == cap:
                del free[block.id]
                self.hits += 1
                return block
        return None

    def _full(self, cap: int, stash: bool) -> bool:
        if self._bytes + cap > self.max_bytes:
            return True
        if stash:
            return self._stashes >= self.stash_blocks
        return len(self._blocks) - self._stashes >= self.max_blocks

    def _create(self, cap: int, *, stash: bool) -> _Block | None:
        own, other = (self._free_stash, self._free) if stash else (self._free, self._free_stash)
        while self._full(cap, stash):
            # The least recently freed of its kind; the other kind's only to make bytes.
            if own:
                self._drop(own.popitem(last=False)[1])
            elif other and self._bytes + cap > self.max_bytes:
                self._drop(other.popitem(last=False)[1])
            else:
                return None
        try:
            block = _Block(self._next_id, cap, stash)
        except OSError:  # out of memory or descriptors: torch's path may still work
            return None
        self._stashes += stash
        self._next_id += 1
        self._blocks[block.id] = block
        self._by_addr[block.addr] = block
        self._bytes += cap
        self.created += 1
        return block

    def _drop(self, block: _Block) -> None:
        self._stashes -= block.stash
        del self._blocks[block.id]
        del self._by_addr[block.addr]
        self._bytes -= block.cap
        self._evicted.append(block.id)  # the main process may have it mapped
        block.close()

    def _maybe_free(self, block: _Block) -> None:
        if (
            not block.in_worker
            and not block.in_main
            and not block.packing
            and block.id in self._blocks
        ):
            block.ref = None
            if block.stash:  # kept: see the class docstring
                self._free_stash[block.id] = block
                return
            self._free[block.id] = block
            # After a burst (a loop that kept many batches, then let go) don't stay resident:
            # keep about what the batches in flight need.
            while len(self._free) > self.max_free:
                _, old = self._free.popitem(last=False)
                self._drop(old)

    def _worker_done(self, block_id: int, seq: int) -> None:
        self._dropped.append((block_id, seq))  # no lock: see _dropped

    def _drain_dropped(self) -> None:
        while True:
            try:
                block_id, seq = self._dropped.popleft()
            except IndexError:
                return
            block = self._blocks.get(block_id)
            if block is not None and block.seq == seq:
                block.in_worker = False
                self._maybe_free(block)

    def release(self, freed: tuple[int, ...]) -> None:
        """The main process is done with these uses: ``(id0, seq0, id1, seq1, ...)``."""
        with self._lock:
            self._drain_dropped()
            for i in range(0, len(freed) - 1, 2):
                block = self._blocks.get(freed[i])
                if block is not None and block.seq == freed[i + 1] and block.in_main:
                    block.mapped = True
                    block.close_fd()
                    block.in_main = False
                    self._maybe_free(block)

    # pickling (pack runs in the loop thread, one message at a time)

    def ref_for(self, tensor: torch.Tensor) -> BlockRef | None:
        """The block reference of a tensor whose storage is a pooled block in use, if any."""
        storage = tensor.untyped_storage()
        block = self._by_addr.get(storage.data_ptr())
        if block is None or block.ref is None or block.in_main:
            return None  # not ours, or already sent in an earlier batch
        if storage.nbytes() != block.ref.nbytes:
            return None
        return block.ref

    def begin(self) -> None:
        self._packing = []

    def reduce_ref(self, ref: BlockRef) -> tuple[Any, ...]:
        """Pickle a block use as its id: the descriptor, if needed, travels beside the message
        (``end``), so a message that fails to pickle leaves no descriptor behind."""
        block = ref.block
        with self._lock:
            block.packing = True  # a view going torch's way may free our storage mid-pickle
        if self._packing is not None:
            self._packing.append(block)
        return _open_block, (self.token, block.id, ref.seq, ref.nbytes)

    def copy_ref(self, t: torch.Tensor) -> BlockRef | None:
        """A block holding a copy of *t*'s whole storage, one per storage per message, so views
        of one storage still share it after the crossing (as with torch's own path)."""
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        ref = self._copies.get(key)
        if ref is not None:
            return ref
        if storage.is_shared() or storage.nbytes() <= self.min_bytes:
            return None
        copy = self.allocate(storage.nbytes())
        if copy is None:
            return None
        copy.copy_(storage)
        self._keepalive.append(copy)  # until the message is pickled
        block = self._by_addr[copy.data_ptr()]
        assert block.ref is not None
        self._copies[key] = block.ref
        return block.ref

    def stash(self, parts: Sequence[memoryview], nbytes: int) -> BlockRef | None:
        """Copy *parts* (a pickled message, *nbytes* in all, in the pieces its pickler wrote)
        into a block that the message being pickled names; None when the pool is full. The
        main process reads it once and gives it back."""
        with self._lock:
            block = self._new_use(_size_class(nbytes), nbytes, stash=True)
            if block is None:
                return None
            block.packing = True
        if self._packing is not None:  # end() frees it, even if a copy below fails
            self._packing.append(block)
        offset = 0
        for part in parts:
            end = offset + part.nbytes
            block.mm[offset:end] = part
            offset = end
        return block.ref

    def end(self, sent: bool) -> tuple[tuple[tuple[int, int, Any], ...], tuple[int, ...]]:
        """Finish a message: its blocks now belong to the main process if it was *sent*.

        Returns the descriptors of blocks the main process has not mapped yet, as
        ``(id, size, ProcFd or DupFd)``, and the ids of blocks dropped since the last message,
        for the main process to unmap.
        """
        packed, self._packing = self._packing or [], None
        fds: list[tuple[int, int, Any]] = []
        with self._lock:
            self._drain_dropped()
            for block in packed:
                block.packing = False
                if sent:
                    block.in_main = True
                    if not block.mapped:
                        fds.append((block.id, block.cap, self._descriptor(block.fd)))
                else:
                    self._maybe_free(block)
            evicted, self._evicted = tuple(self._evicted), []
        # Only now: dropping a copy frees its block unless the main process has it.
        self._keepalive.clear()
        self._copies.clear()
        return tuple(fds), evicted

    def _descriptor(self, fd: int) -> Any:
        return ProcFd(os.getpid(), fd) if self._proc_fds else DupFd(fd)

    def unsend_evicted(self, evicted: tuple[int, ...]) -> None:
        """*evicted* (from ``end``) did not reach the main process: name them again later."""
        with self._lock:
            self._evicted[:0] = evicted
