"""``asyncload demo``'s data: CIFAR-10 binary records, read by two datasets that differ only in
how ``__getitem__`` waits (``AsyncRecords`` awaits, ``BlockingRecords`` blocks), the sample
order both loaders are asked for, and the embedded object store that serves the records.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.utils.data

from .._dataset.base import Dataset
from .._storage import api as _storage
from ..datasets import RemoteFiles
from . import demo_server as _demo_server
from . import loopback

__all__ = ["AsyncRecords", "BlockingRecords", "decode_record", "embedded_store", "sample_order"]

RECORD_SIZE = _demo_server.RECORD_SIZE
NUM_CLASSES = _demo_server.NUM_CLASSES


def decode_record(index: int, data: bytes) -> tuple[torch.Tensor, int, int, int]:
    """``(image uint8[3,32,32], label, index, crc32)`` from one CIFAR-10 binary record."""
    if len(data) != RECORD_SIZE or data[0] >= NUM_CLASSES:
        raise ValueError(
            f"sample {index} is {len(data)} bytes (first byte {data[:1]!r}); the demo expects "
            f"CIFAR-10 binary records of {RECORD_SIZE} bytes: a label byte 0-9, then 3×32×32 "
            "uint8 pixels"
        )
    pixels = np.frombuffer(data, dtype=np.uint8, offset=1).reshape(3, 32, 32).copy()
    return torch.from_numpy(pixels), data[0], index, zlib.crc32(data)


class AsyncRecords(Dataset[Any]):
    """The asyncload side: ``async def __getitem__`` awaits ``asyncload.read``."""

    def __init__(self, urls: list[str]) -> None:
        self.files = RemoteFiles(urls)  # URLs in two NumPy arrays, not a list of str

    def __len__(self) -> int:
        return len(self.files)

    async def __getitem__(self, index: int) -> tuple[torch.Tensor, int, int, int]:
        return decode_record(index, await _storage.read(self.files.url(index)))


class BlockingRecords(torch.utils.data.Dataset[Any]):
    """The torch side: one blocking GET per ``__getitem__``, on a loop private to the worker."""

    def __init__(self, urls: list[str]) -> None:
        self.files = RemoteFiles(urls)
        self._loop: asyncio.AbstractEventLoop | None = None

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int, int, int]:
        if self._loop is None:  # created in the worker, reused for keep-alive connections
            self._loop = asyncio.new_event_loop()
        data = self._loop.run_until_complete(_storage.read(self.files.url(index)))
        return decode_record(index, data)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_loop": None}

    def close(self) -> None:
        if self._loop is not None:
            self._loop.run_until_complete(_storage.aclose())
            self._loop.close()
            self._loop = None


def sample_order(num_objects: int, count: int, seed: int) -> list[int]:
    """*count* indices: shuffled passes over the objects, the same for both loaders."""
    rng = np.random.default_rng(seed)
    passes = -(-count // num_objects)
    order = np.concatenate([rng.permutation(num_objects) for _ in range(passes)])[:count]
    return [int(i) for i in order]


class _DemoStore(loopback.ServerProcess):
    """``demo_server.py`` (the loopback store with the demo's records) in a child process."""

    def command(self) -> list[str]:
        return [sys.executable, str(Path(_demo_server.__file__)), *self._args]


@contextlib.contextmanager
def embedded_store(*, objects: int, latency: float, seed: int) -> Iterator[str]:
    """Run ``cli/demo_server.py`` in a child process; yield its dataset prefix URL."""
    args = [f"--objects={objects}", f"--latency={latency}", f"--seed={seed}"]
    with _DemoStore(args) as store:
        yield f"{store.base_url}/{_demo_server.PREFIX}/"
