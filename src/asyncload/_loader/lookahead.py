"""How far a pass may run ahead of the training loop: a memory bound, not a batch count.

With ``in_order=True`` a batch that waits on one slow sample (an object-store request 10-50x
slower than the median) is the head of the queue: the training loop can't have the batches
behind it. A fixed window of ``ceil(max_concurrency / batch_size) + 1`` batches per worker
then fills up with finished batches and every request slot idles until the straggler returns.
So the pass keeps sending batches while the bytes they will hold, once finished but not yet
yielded, stay under ``prefetch_bytes``: the workers keep fetching behind the straggler, and
memory, not a batch count, bounds how far.

Bytes are counted in the main process, from the batches that arrived (``batch_nbytes``): the
finished-but-undelivered batches by their size, and batches still out by the mean size so far,
so that the bound holds once they land too. Until the first batch arrives, and always at least,
the fixed window may be out (the minimum to make progress at full concurrency).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import torch

__all__ = ["DEFAULT_PREFETCH_BYTES", "LookAhead", "batch_nbytes"]

DEFAULT_PREFETCH_BYTES = 1 << 30
"""1 GiB per pass: a 2 s straggler at 500 MB/s of look-ahead (e.g. 2 workers x 128 in flight
x 100 KB at 50 ms)."""

# Batches out beyond the fixed window, at most: index messages are small, but a sampler read
# far ahead is work thrown away by a new epoch or a restore.
_MAX_EXTRA_BATCHES = 1024

# A long list is sized from its first items (homogeneous batches: 32 images, 32 blobs).
_SAMPLE_ITEMS = 64


def batch_nbytes(obj: Any, _depth: int = 0) -> int:
    """Roughly the payload bytes of a collated batch: tensors, arrays, bytes and strings, in
    nested lists, tuples and dicts; other objects by ``sys.getsizeof``."""
    if isinstance(obj, torch.Tensor):
        return int(obj.element_size() * obj.nelement())
    if isinstance(obj, np.ndarray):
        return int(obj.nbytes)
    if isinstance(obj, bytes | bytearray | str):
        return len(obj)
    if isinstance(obj, memoryview):
        return obj.nbytes
    if _depth < 4 and isinstance(obj, dict):
        return sum(batch_nbytes(v, _depth + 1) for v in obj.values())
    if _depth < 4 and isinstance(obj, list | tuple):
        n = len(obj)
        if n <= _SAMPLE_ITEMS:
            return sum(batch_nbytes(v, _depth + 1) for v in obj)
        head = sum(batch_nbytes(v, _depth + 1) for v in obj[:_SAMPLE_ITEMS])
        return head * n // _SAMPLE_ITEMS
    return sys.getsizeof(obj)


class LookAhead:
    """Decides whether a pass may send one more batch, and counts undelivered bytes.

    Args:
        window: Batches that may always be out (sent, or finished and not yet yielded).
        limit_bytes: ``prefetch_bytes``: bytes that finished-but-undelivered batches may hold
            beyond that window; 0 keeps the fixed window.
    """

    __slots__ = ("_arrived", "_arrived_bytes", "held_bytes", "limit_bytes", "window")

    def __init__(self, window: int, limit_bytes: int) -> None:
        self.window = window
        self.limit_bytes = limit_bytes
        self.held_bytes = 0
        """Bytes of batches finished and waiting to be yielded (the reorder buffer)."""
        self._arrived = 0
        self._arrived_bytes = 0

    def may_send(self, pending: int, ready: int) -> bool:
        """One more batch, with *pending* out and *ready* finished but not yielded?"""
        out = pending + ready
        if out < self.window:
            return True
        if self.limit_bytes <= 0 or self._arrived == 0 or out >= self.window + _MAX_EXTRA_BATCHES:
            return False
        mean = self._arrived_bytes / self._arrived
        return self.held_bytes + (pending + 1) * mean <= self.limit_bytes

    def arrived(self, nbytes: int, held: bool) -> None:
        """A batch of *nbytes* arrived; *held*: it waits in the reorder buffer."""
        self._arrived += 1
        self._arrived_bytes += nbytes
        if held:
            self.held_bytes += nbytes

    def released(self, nbytes: int) -> None:
        """A held batch was yielded."""
        self.held_bytes -= nbytes
