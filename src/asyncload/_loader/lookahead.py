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
so that the bound holds once they land too.

The bound holds for the fixed window too, once a batch's size is known: only
``always_out_per_worker`` batches per worker may be out whatever their size, torch's 2 by
default, or the whole window where ``prefetch_factor`` is given (as torch has it). Before that,
the whole window goes out: a pass needs its full concurrency from the start, behind its first
batch's slowest sample (sending only torch's 2 per worker until the first batch landed,
``bench_tails``' log-normal row gave 2,379 samples/s against 2,753, one run each). Sizes are
counted over the loader's passes (``BatchSizes``), so from its second pass on the bound holds
from the start.

Before, the whole window was always out whatever its bytes: 9 batches per worker of 64 x 3 MiB
float tensors, read by a training loop slower than the workers, held 5.6 GiB (private memory
and /dev/shm) against torch's 1.5-1.6 GiB. Batches of up to ``prefetch_bytes`` / window bytes
(57 MiB for 2 workers at the default limit) are not affected.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import torch

__all__ = ["DEFAULT_PREFETCH_BYTES", "BatchSizes", "LookAhead", "batch_nbytes"]

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


class BatchSizes:
    """The bytes of the batches that arrived, over every pass of one loader: a pass's bound
    holds from its start when an earlier pass has seen how large its batches are."""

    __slots__ = ("count", "total")

    def __init__(self) -> None:
        self.count = 0
        self.total = 0

    def add(self, nbytes: int) -> None:
        self.count += 1
        self.total += nbytes


class LookAhead:
    """Decides whether a pass may send one more batch, and counts undelivered bytes.

    Args:
        window: The fixed window: batches that may be out (sent, or finished and not yet
            yielded) whatever bytes they hold where *limit_bytes* is 0.
        limit_bytes: ``prefetch_bytes``: bytes that the batches out may hold, beyond
            *always*; 0 keeps the fixed window whatever the bytes.
        always: Batches that may be out whatever bytes they hold (at most *window*; ``None``:
            the whole window).
        sizes: Where the batches' sizes are counted: the loader's, shared by its passes.

    Examples:
        >>> la = LookAhead(window=8, limit_bytes=1000, always=2)
        >>> la.may_send(pending=7, ready=0)  # no size known yet: the whole window
        True
        >>> la.arrived(400, held=False)
        >>> la.may_send(pending=2, ready=0)  # 3 x 400 > 1000, beyond *always*
        False
    """

    __slots__ = ("always", "held_bytes", "limit_bytes", "sizes", "window")

    def __init__(
        self,
        window: int,
        limit_bytes: int,
        always: int | None = None,
        sizes: BatchSizes | None = None,
    ) -> None:
        self.window = window
        self.limit_bytes = limit_bytes
        self.always = window if always is None else min(always, window)
        self.sizes = BatchSizes() if sizes is None else sizes
        self.held_bytes = 0
        """Bytes of batches finished and waiting to be yielded (the reorder buffer)."""

    def may_send(self, pending: int, ready: int) -> bool:
        """One more batch, with *pending* out and *ready* finished but not yielded?"""
        out = pending + ready
        if out < self.always:
            return True
        sizes = self.sizes
        if self.limit_bytes <= 0 or sizes.count == 0:
            # 0: the fixed window. No size known yet: the window too, which a pass needs at
            # full concurrency from its start (behind its first batch's slowest sample).
            return out < self.window
        if out >= self.window + _MAX_EXTRA_BATCHES:
            return False
        mean = sizes.total / sizes.count
        return self.held_bytes + (pending + 1) * mean <= self.limit_bytes

    def arrived(self, nbytes: int, held: bool) -> None:
        """A batch of *nbytes* arrived; *held*: it waits in the reorder buffer."""
        self.sizes.add(nbytes)
        if held:
            self.held_bytes += nbytes

    def released(self, nbytes: int) -> None:
        """A held batch was yielded."""
        self.held_bytes -= nbytes
