"""Shared-memory blocks that a worker reuses from batch to batch.

NOTE [ Reused shared memory ]
=============================

torch's workers collate every batch into a fresh shared-memory segment: ``shm_open``,
``ftruncate``, ``mmap``, a page fault on the first write to every 4 KiB page, and then a
file-descriptor handshake per batch (the main process connects to the worker's resource-sharer
thread, which has to win the worker's GIL). At 50 ms and 100 KB samples that was a third of a
worker's CPU time. asyncload's workers keep a pool of memfd blocks instead, already mapped on
both sides::

    worker process                                    main process
    ──────────────                                    ────────────
    collate_fn → UntypedStorage._new_shared(n)
       └ a free block b, use number s
    pack: tensor → BlockRef(b, s); b's fd rides
          beside the message until the main
          process has b mapped (it opens
          /proc/<worker>/fd/<fd>, ProcFd)   ── Packed ──►   map b once, cache it; the batch
                                                              views the mapping, no copy
                                                              ...the training loop drops it...
                                                              storage freed → finalizer
    block b free again  ◄── (b, s) in the next task's ``freed`` ──┘

Rules that keep it safe:

* A block is reused only when both sides are done with it: the worker's own storage is gone and
  the main process has said that the storage it built for use ``s`` is gone. A release for an
  older use number is ignored, so a late or repeated release can never free a block in use. A
  block named in a message being pickled is not free even if its storage dies meanwhile (a view
  of it that torch pickles its own way moves the storage out).
* Finalizers run in whatever thread drops the last reference, also inside a garbage collection
  that started while the pool's lock was held: they only append to a deque, drained under the
  lock.
* Descriptors are attached after a message pickled successfully, so a batch that fails to pickle
  leaves none behind.
* Views of one ordinary storage are copied once, as one block, so they still share it after the
  crossing, as with torch's own path.
* When the pool is full (a training loop keeping many batches, or batches too big for it),
  allocation falls back to torch's own shared memory: slower, never wrong. torch names such a
  segment and unlinks the name once it is mapped; a worker killed in between leaves it in
  ``/dev/shm`` for good, so the stop unlinks what a worker killed by a signal left
  (:func:`sweep_dead`).
* Large tensors that are not in shared memory (a ``collate_fn`` that builds ordinary tensors)
  are copied into a block when they are pickled, instead of into a fresh segment.
* memfd blocks have no name: whatever process dies, nothing is left in ``/dev/shm``, and a
  small ``/dev/shm`` (Docker's 64 MB) does not limit them.
* Blocks a worker drops to make room are named in the next ``Packed``, and the main process
  drops its mapping of them.
* A message whose pickle is large without tensors (``collate_fn=list`` over blobs, strings,
  arrays pickled by value) is *stashed*: its pickle is copied into a block and the ``Packed``
  names the block instead of carrying the bytes, so it does not cross the result queue's pipe
  in 64 KiB pieces. The main process unpickles it straight from its mapping (what that builds
  is a copy) and gives the block back at once. A pool may hold ``STASH_BLOCKS`` such blocks
  beyond its own count, since the look-ahead lets a worker run many batches ahead.

Where ``os.memfd_create`` is missing (macOS, Windows) workers use torch's path unchanged.
Batches built on blocks report ``is_shared() == False``; ``share_memory_()`` or sending them
to another process moves them into torch's shared memory as for any tensor.
"""

from __future__ import annotations

import os
from typing import Any

import torch

# The main side (the mappings of every worker's blocks) lives in _shm_mirror, the worker's pool
# in _shm_pool; both re-exported here.
from .block_mirror import (
    _freed,
    _maps,
    forget_blocks,
    freed_uses,
    load_stashed,
    map_blocks,
    register_token,
    take_freed,
    unpickling,
    unregister_token,
)
from .block_pool import MAX_POOL_BYTES, BlockPool, BlockRef, ProcFd

__all__ = [
    "MAX_POOL_BYTES",
    "BlockPool",
    "BlockRef",
    "ProcFd",
    "forget_blocks",
    "freed_uses",
    "install_pool",
    "load_stashed",
    "map_blocks",
    "pool",
    "reduce_tensor",
    "register_token",
    "sweep_dead",
    "take_freed",
    "unpickling",
    "unregister_token",
]


def supported() -> bool:
    return hasattr(os, "memfd_create")


_SHM_DIR = "/dev/shm"


def sweep_dead(pid: int, shm_dir: str = _SHM_DIR) -> list[str]:
    """Unlink the segments torch's own path left named by worker *pid*, killed by a signal;
    their names.

    torch calls a segment ``torch_<pid>_<random>_<n>`` and, with the ``file_descriptor`` sharing
    strategy (Linux's default), unlinks the name as soon as it has mapped it: a name of a dead
    process is one it was killed in the middle of making (seen: an 800 KB batch, after a SIGKILL
    on a loaded machine). Not with ``file_system``, whose names live as long as their storages,
    which this process may hold, and not while a process has *pid*: a dead worker's was reaped
    before the stop, so that one is new, and the names may be its own.
    """
    strategy = torch.multiprocessing.get_sharing_strategy()  # type: ignore[no-untyped-call]
    if strategy != "file_descriptor":
        return []
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        pass  # gone, as a dead worker is once reaped
    except OSError:  # in use again, by another user's process
        return []
    else:  # in use again
        return []
    prefix = f"torch_{pid}_"
    try:
        names = [n for n in os.listdir(shm_dir) if n.startswith(prefix)]
    except OSError:  # no /dev/shm (macOS): torch names its segments elsewhere
        return []
    swept = []
    for name in names:
        try:
            os.unlink(os.path.join(shm_dir, name))
        except OSError:  # gone meanwhile, or not ours to remove
            continue
        swept.append(name)
    return swept


# ── the worker process's pool and torch's hooks ──────────────────────────────────────────────


pool: BlockPool | None = None
"""This worker process's pool, once ``install_pool`` ran."""


def _after_fork_in_child() -> None:
    # A process forked from a worker must not allocate from the worker's blocks, and one forked
    # from the main process (a worker under "fork") has no use for the main's mappings.
    global pool
    pool = None
    _maps.clear()
    _freed.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

# torch's own UntypedStorage._new_shared. Per process: install_pool patches torch's class,
# which is the process's, and saves the original once: a later call must not wrap the wrapper.
_torch_new_shared: Any = None


def _pooled_new_shared(cls: Any, size: int, *, device: Any = "cpu") -> Any:
    # default_collate asks for shared memory for a worker's batch: hand it a pooled block, or
    # ordinary memory when the batch is small enough to be copied into the message anyway.
    if pool is not None and size > 0 and torch.device(device).type == "cpu":
        if size <= pool.min_bytes:
            return cls(size)
        storage = pool.allocate(int(size))
        if storage is not None:
            return storage
    return _torch_new_shared.__func__(cls, size, device=device)


def install_pool(token: str, *, max_blocks: int, min_bytes: int) -> BlockPool | None:
    """Give this worker process a pool and route ``_new_shared`` through it (worker only).

    Storages of at most *min_bytes* (those the pickler copies into the message) stay in
    ordinary memory.
    """
    global pool, _torch_new_shared
    if not supported():
        return None
    pool = BlockPool(token, max_blocks=max_blocks, min_bytes=min_bytes)
    if _torch_new_shared is None:
        _torch_new_shared = torch.UntypedStorage._new_shared
        torch.UntypedStorage._new_shared = classmethod(_pooled_new_shared)  # type: ignore[assignment,method-assign]
    return pool


def reduce_tensor(t: torch.Tensor) -> tuple[Any, ...] | None:
    """How to pickle *t* through the pool, or None for torch's own way."""
    if pool is None:
        return None
    # A storage from the pool (default_collate's output), or else an ordinary storage copied
    # into a warm block: one copy instead of torch's copy into a fresh segment.
    ref = pool.ref_for(t) or pool.copy_ref(t)
    if ref is None:
        return None
    return _rebuild, (ref, t.dtype, t.storage_offset(), tuple(t.shape), tuple(t.stride()))


def _rebuild(
    storage: torch.UntypedStorage,
    dtype: torch.dtype,
    offset: int,
    shape: tuple[int, ...],
    stride: tuple[int, ...],
) -> torch.Tensor:
    return torch.empty((), dtype=dtype).set_(storage, offset, shape, stride)
