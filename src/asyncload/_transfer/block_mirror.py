"""The main process's side of NOTE [ Reused shared memory ] (in ``_transfer/shm.py``): every
worker's
blocks mapped once, views handed to unpickled batches, and the uses the main process is done
with queued for the worker that owns the block.

Keyed by the worker's pool name (its *token*), because a pickled batch names its pool and
unpickling must find the mapping from that name alone.

A mapping holds no descriptor: Python's ``mmap.mmap`` keeps a duplicate of the one it maps
(``trackfd`` turns that off only from 3.13), which with hundreds of blocks in flight ran the
main process into its descriptor limit. Blocks are mapped with ``mmap(2)`` through ctypes
instead, and unmapped when the last view of them is gone.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import mmap
import os
import pickle
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

__all__ = [
    "forget_blocks",
    "freed_uses",
    "load_stashed",
    "map_blocks",
    "register_token",
    "take_freed",
    "unpickling",
    "unregister_token",
]

_main_lock = threading.Lock()
Mapping = ctypes.Array[ctypes.c_ubyte]
_maps: dict[str, dict[int, Mapping]] = {}
_freed: dict[str, collections.deque[int]] = {}
_views: weakref.WeakValueDictionary[tuple[str, int, int], np.ndarray] = (
    weakref.WeakValueDictionary()
)


def register_token(token: str) -> None:
    """Start accepting blocks from the worker that owns *token*."""
    with _main_lock:
        _maps.setdefault(token, {})
        _freed.setdefault(token, collections.deque())


def unregister_token(token: str) -> None:
    """Forget a stopped worker's blocks; batches still alive keep their mappings."""
    with _main_lock:
        _maps.pop(token, None)
        _freed.pop(token, None)


def freed_uses(token: str) -> int:
    """How many uses of *token*'s blocks wait for ``take_freed``."""
    return len(_freed.get(token, ())) // 2


def take_freed(token: str) -> tuple[int, ...]:
    """Uses of *token*'s blocks the main process is done with, to send to that worker."""
    dq = _freed.get(token)
    if not dq:
        return ()
    out: list[int] = []
    while True:
        try:
            out.append(dq.popleft())  # deque ops are atomic: finalizers append from any thread
        except IndexError:
            return tuple(out)


def forget_blocks(token: str, block_ids: tuple[int, ...]) -> None:
    """The worker dropped these blocks: unmap them once no batch views them."""
    with _main_lock:
        blocks = _maps.get(token)
        if blocks is not None:
            for block_id in block_ids:
                blocks.pop(block_id, None)


def _release(token: str, block_id: int, seq: int) -> None:
    dq = _freed.get(token)
    if dq is not None:
        dq.append(block_id)
        dq.append(seq)


# Per process: the process's libc with mmap/munmap's prototypes set, built at the first mapping
# and kept (a cache; no state of its own).
_libc: Any = None


def _map_shared(fd: int, size: int) -> Mapping:
    """Map *size* bytes of *fd* shared, read-write; the mapping does not keep *fd* open.

    The returned buffer owns the mapping: ``munmap`` runs when it is collected, which numpy
    views of it (their ``base``) postpone until they are gone too.
    """
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        libc.munmap.restype = ctypes.c_int
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc = libc
    addr = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == ctypes.c_void_p(-1).value:
        err = ctypes.get_errno()
        raise OSError(err, f"asyncload: mmap of a shared-memory block failed: {os.strerror(err)}")
    buf = (ctypes.c_ubyte * size).from_address(addr)
    # Not at exit: a tensor on the block may still be read then; the process's end unmaps it.
    weakref.finalize(buf, _libc.munmap, addr, size).atexit = False
    return buf


_unpacking = threading.local()  # the mappings of the message being unpickled in this thread


def map_blocks(token: str, fds: tuple[tuple[int, int, Any], ...]) -> dict[int, Mapping]:
    """Map the blocks a message brings descriptors for (``(id, size, ProcFd or DupFd)``), once each.

    Returns the message's new mappings; ``unpickling`` makes them visible to
    ``_open_block`` also when *token* is no longer registered.
    """
    new: dict[int, Mapping] = {}
    for block_id, cap, dup in fds:
        fd = dup.detach()  # always: the worker's resource sharer holds the duplicate till then
        try:
            with _main_lock:
                blocks = _maps.get(token)
                if blocks is not None and block_id in blocks:
                    continue
                mm = new[block_id] = _map_shared(fd, cap)
                if blocks is not None:
                    blocks[block_id] = mm
        finally:
            os.close(fd)
    return new


@contextlib.contextmanager
def unpickling(token: str, new: dict[int, Mapping]) -> Iterator[None]:
    """``with unpickling(token, map_blocks(...)): pickle.loads(...)``."""
    _unpacking.state = (token, new)
    try:
        yield
    finally:
        _unpacking.state = None


def _mapping(token: str, block_id: int) -> Mapping:
    with _main_lock:
        blocks = _maps.get(token)
        mm = blocks.get(block_id) if blocks is not None else None
    if mm is None:
        state = getattr(_unpacking, "state", None)
        if state is not None and state[0] == token:
            mm = state[1].get(block_id)
    if mm is None:
        raise RuntimeError(
            f"asyncload: shared-memory block {block_id} of a worker's pool is not mapped in "
            "this process: a batch was unpickled after its loader shut down, or outside "
            "the loader (batches from a worker are for the process that started it)"
        )
    return mm


def load_stashed(token: str, block_id: int, seq: int, nbytes: int) -> Any:
    """Unpickle a message the worker stashed in a block (``BlockPool.stash``), and give the
    block back: what ``pickle.loads`` builds is a copy (bytes, arrays), never a view of it."""
    with memoryview(_mapping(token, block_id)) as view, view[:nbytes] as payload:
        try:
            return pickle.loads(payload)
        finally:
            _release(token, block_id, seq)


def _open_block(token: str, block_id: int, seq: int, nbytes: int) -> torch.UntypedStorage:
    """Unpickling a pooled storage in the main process."""
    key = (token, block_id, seq)
    arr = _views.get(key)
    if arr is None:
        mm = _mapping(token, block_id)
        arr = np.frombuffer(memoryview(mm), dtype=np.uint8, count=nbytes)
        _views[key] = arr
        weakref.finalize(arr, _release, token, block_id, seq)
    return torch.from_numpy(arr).untyped_storage()
