"""Datasets used by the loader tests. Module level, so forkserver workers can import them."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

import asyncload
from asyncload._control import turns as _turns
from asyncload._engine import WorkerConfig, WorkerOptions


def worker_config(dataset: Any, **changes: Any) -> WorkerConfig:
    """What an engine run in the test's own process gets: worker 0 of 1, batches of 3 collated
    with ``list``, 4 samples in flight; *changes* replace any field, or any of the
    ``WorkerOptions`` (``max_concurrency``, ``cpu_threads``, ``skip_sample_errors``)."""
    option_names = {f.name for f in dataclasses.fields(WorkerOptions)}
    options = {"max_concurrency": 4} | {k: changes.pop(k) for k in option_names & changes.keys()}
    fields: dict[str, Any] = {
        "worker_id": 0,
        "num_workers": 1,
        "base_seed": 0,
        "dataset": dataset,
        "is_iterable": False,
        "auto_collation": True,
        "batch_size": 3,
        "drop_last": False,
        "collate_fn": list,
        "worker_init_fn": None,
        "options": WorkerOptions(**options),
        "rank": 0,
        "world_size": 1,
        "storage_config": None,
        "main_pid": 0,
    }
    return WorkerConfig(**(fields | changes))


def spin(seconds: float) -> None:
    """Hold this thread on a CPU for *seconds* of its own CPU clock, as a decode does.

    The thread's clock, not the wall's: the code under test reads CPU time (the loop's turns,
    the CPU-bound measure, ``worker_cpu_s``), and a wall-clock spin that a busy machine
    descheduled for part of its time is that much less CPU (one CI run read a 6 ms wall-clock
    spin as under a 5 ms CPU budget)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def put_numbers(server: Any, n: int) -> str:
    """Store objects ``n/0 .. n/{n-1}`` holding their own index; return the base URL."""
    for i in range(n):
        server.put(f"n/{i}", str(i).encode())
    return server.url_for("n")


class Numbers(asyncload.Dataset[int]):
    """Item i is fetched over HTTP from ``{base}/{i}`` and is the integer i."""

    def __init__(self, base: str, n: int, *, fail_on: tuple[int, ...] = ()) -> None:
        self.base = base
        self.n = n
        self.fail_on = np.asarray(fail_on, dtype=np.int64)

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, index: int) -> int:
        if index in self.fail_on:
            raise ValueError(f"bad sample {index}")
        body = await asyncload.read(f"{self.base}/{index}")
        return int(body)


class TurnRank(asyncload.Dataset[tuple[int, int]]):
    """Item i is ``(i, rank)``: where a read finishing now would queue for its worker's next
    turn of the loop (``_control/turns.py``), the batch order its worker wires in."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, index: int) -> tuple[int, int]:
        loop_turns = _turns.turns.get()
        assert loop_turns is not None, "no loop turns in this worker"
        return index, loop_turns._priority()  # the rank its line is sorted by


class InFlight(asyncload.Dataset[tuple[int, int]]):
    """Returns (index, samples in flight in this process when it finished): measures concurrency."""

    active = 0

    def __init__(self, base: str, n: int) -> None:
        self.base, self.n = base, n

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, index: int) -> tuple[int, int]:
        InFlight.active += 1
        try:
            await asyncload.read(f"{self.base}/{index}")
            return index, InFlight.active
        finally:
            InFlight.active -= 1


class SyncNumbers(torch.utils.data.Dataset[int]):
    """A plain torch dataset with a blocking __getitem__."""

    def __init__(self, n: int, delay: float = 0.0) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if self.delay:
            time.sleep(self.delay)
        return index


class ShardedNumbers(asyncload.IterableDataset[int]):
    """Iterable over HTTP objects 0..n-1, split with asyncload.shard()."""

    def __init__(self, base: str, n: int, *, lazy: bool = False) -> None:
        self.base, self.n, self.lazy = base, n, lazy

    async def _get(self, i: int) -> int:
        return int(await asyncload.read(f"{self.base}/{i}"))

    async def __aiter__(self) -> AsyncIterator[Any]:
        for i in asyncload.shard(range(self.n)):
            if self.lazy:
                yield self._get(i)  # an awaitable: the worker runs many at once
            else:
                yield await self._get(i)


class SyncIterable(torch.utils.data.IterableDataset[int]):
    """A plain torch iterable dataset sharded the torch way, with get_worker_info()."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        info = torch.utils.data.get_worker_info()
        start, step = (info.id, info.num_workers) if info is not None else (0, 1)
        return iter(range(start, self.n, step))


class WhoAmI(asyncload.Dataset[tuple[int, int, int, int, int]]):
    """Reports (index, pid, asyncload worker id, torch worker id, seed-derived random)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, index: int) -> tuple[int, int, int, int, int]:
        await asyncio.sleep(0)
        ours = asyncload.get_worker_info()
        theirs = torch.utils.data.get_worker_info()
        assert ours is not None
        assert theirs is not None
        assert ours.num_workers == theirs.num_workers
        return index, os.getpid(), ours.id, theirs.id, int(torch.randint(0, 2**30, ()).item())


class Sleepy(asyncload.Dataset[int]):
    """Sleeps `delay` seconds for index `slow`, else returns at once."""

    def __init__(self, n: int, slow: int, delay: float) -> None:
        self.n, self.slow, self.delay = n, slow, delay

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, index: int) -> int:
        if index == self.slow:
            await asyncio.sleep(self.delay)
        return index


class Segfault(asyncload.Dataset[int]):
    """Crashes its worker process with a segmentation fault at index `crash`."""

    def __init__(self, n: int, crash: int) -> None:
        self.n, self.crash = n, crash

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, index: int) -> int:
        if index == self.crash:
            import ctypes

            ctypes.string_at(0)
        return index


class DiesHoldingLocks(asyncload.Dataset[int]):
    """At index `die`, its worker takes every multiprocessing lock of its own it takes in its
    work (the write side of the result queue, the read side of its index queue, any lock behind
    the done signal), writes the time to the file `stamp`, and SIGKILLs itself: a worker killed
    at the worst moment. The other indices sleep a little, so that the other workers are busy
    sending results when it dies."""

    def __init__(self, n: int, die: int, stamp: str) -> None:
        self.n, self.die, self.stamp = n, die, stamp

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, index: int) -> int:
        if index != self.die:
            await asyncio.sleep(0.01)
            return index
        import gc
        import multiprocessing.synchronize as mp_sync
        import signal
        import sys

        # The worker's own objects, from its entry point's frame: under fork, copies of the
        # main process's other locks are reachable too, and taking those would wedge them.
        frame = sys._getframe()
        while frame.f_code.co_name != "worker_main":
            assert frame.f_back is not None, "not in a worker process"
            frame = frame.f_back
        own = frame.f_locals
        own["result_queue"]._wlock.acquire(True, 5)  # its feeder may hold it a moment
        own["index_queue"]._rlock.acquire(True, 5)  # its reader holds it while it polls
        behind, seen = [own["done_event"]], set()
        for _ in range(6):  # the done signal and what it holds (an Event's lock, once)
            found = [r for obj in behind for r in gc.get_referents(obj) if id(r) not in seen]
            seen.update(id(r) for r in found)
            for obj in found:
                if type(obj) in (mp_sync.Lock, mp_sync.RLock):
                    obj.acquire(False)
            behind = found
        Path(self.stamp).write_text(repr(time.time()))  # noqa: ASYNC240 - it dies next
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable")


def init_marks_worker(worker_id: int) -> None:
    """A worker_init_fn that leaves a mark the dataset can see."""
    os.environ["ASYNCLOAD_TEST_INIT"] = f"initialised {worker_id}"


class InitMark(asyncload.Dataset[str]):
    def __len__(self) -> int:
        return 4

    async def __getitem__(self, index: int) -> str:
        return os.environ.get("ASYNCLOAD_TEST_INIT", "missing")


class Blobs(torch.utils.data.Dataset[bytes]):
    """Returns `size` bytes at once: fills a result pipe fast when nobody reads it."""

    def __init__(self, n: int, size: int) -> None:
        self.n, self.size = n, size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> bytes:
        return bytes(self.size)


class BigTensors(asyncload.Dataset[torch.Tensor]):
    """100 KB tensors (sent through shared memory, not inline)."""

    def __len__(self) -> int:
        return 10_000

    async def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((100_000,), index % 256, dtype=torch.uint8)


class CancelsItself(asyncload.Dataset[int]):
    """Index `bad` raises CancelledError from inside the dataset (not a cancellation)."""

    def __init__(self, n: int, bad: int) -> None:
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, index: int) -> int:
        if index == self.bad:
            raise asyncio.CancelledError("dataset's own cancellation")
        return index


class Stuck(asyncload.Dataset[int]):
    """Every index but 0 waits an hour: all fetch slots end up taken."""

    def __len__(self) -> int:
        return 1000

    async def __getitem__(self, index: int) -> int:
        if index:
            await asyncio.sleep(3600)
        return index


class Batched(torch.utils.data.Dataset[str]):
    """Defines __getitems__ as Hugging Face datasets do: torch calls it once per batch."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int) -> str:
        return f"one:{index}"

    def __getitems__(self, indices: list[int]) -> list[str]:
        return [f"batch{len(indices)}:{i}" for i in indices]


class AsyncBatched(asyncload.Dataset[str]):
    def __len__(self) -> int:
        return 10

    async def __getitem__(self, index: int) -> str:
        return f"one:{index}"

    async def __getitems__(self, indices: list[int]) -> list[str]:
        await asyncio.sleep(0)
        return [f"batch{len(indices)}:{i}" for i in indices]


class FrozenCount(asyncload.Dataset[int]):
    """Reports how many objects the worker moved out of the cyclic collector's reach."""

    def __len__(self) -> int:
        return 2

    async def __getitem__(self, index: int) -> int:
        import gc

        return gc.get_freeze_count()


# ── torch drop-in behaviours (tests/test_dropin.py): in memory, no server ──────────────────────


class Doubled(torch.utils.data.Subset[int]):
    """A Subset subclass whose own item access doubles the value: torch calls the override."""

    def __getitem__(self, index: int) -> int:  # type: ignore[override]
        return int(self.dataset[self.indices[index]]) * 2

    def __getitems__(self, indices: list[int]) -> list[int]:  # type: ignore[override]
        return [self[i] for i in indices]


class Negated(torch.utils.data.ConcatDataset[int]):
    """A ConcatDataset subclass overriding __getitem__."""

    def __getitem__(self, index: int) -> int:
        return -int(super().__getitem__(index))


class OverReported(torch.utils.data.IterableDataset[int]):
    """Yields ``n`` items but says it has ``reported`` (torch warns past the reported length)."""

    def __init__(self, n: int, reported: int) -> None:
        self.n, self.reported = n, reported

    def __len__(self) -> int:
        return self.reported

    def __iter__(self) -> Iterator[int]:
        return iter(asyncload.shard(range(self.n)))


class NoLength(torch.utils.data.IterableDataset[int]):
    """``__len__`` raises TypeError, as an IterDataPipe without a length does."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        raise TypeError(f"{type(self).__name__} instance doesn't have valid length")

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))


def nested_collate(samples: list[int]) -> torch.Tensor:
    """A batch as a nested tensor of ragged rows (row i has ``samples[i] + 1`` elements)."""
    return torch.nested.as_nested_tensor(
        [torch.full((s + 1,), float(s)) for s in samples], layout=torch.jagged
    )


def strided_nested_collate(samples: list[int]) -> torch.Tensor:
    """Like :func:`nested_collate`, with torch's older strided nested layout."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "nested tensors are a prototype"
        return torch.nested.nested_tensor([torch.full((s + 1,), float(s)) for s in samples])


class FailsAt(torch.utils.data.Dataset[int]):
    """Returns the index, except at ``bad``, where it raises ValueError."""

    def __init__(self, n: int, bad: int) -> None:
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if index == self.bad:
            raise ValueError(f"sample {index} is bad")
        return index


class LocalFiles(asyncload.Dataset[bytes]):
    """Reads ``paths[i]`` with ``asyncload.read`` (the storage layer counts the bytes)."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    async def __getitem__(self, index: int) -> bytes:
        return await asyncload.read(self.paths[index])


class GcThreshold(asyncload.Dataset[tuple[int, int, int]]):
    """The cyclic collector's thresholds where the sample is fetched."""

    def __len__(self) -> int:
        return 2

    async def __getitem__(self, index: int) -> tuple[int, int, int]:
        import gc

        return gc.get_threshold()


def init_sets_gc_threshold(worker_id: int) -> None:
    """A worker_init_fn with its own idea of the collector's thresholds."""
    import gc

    gc.set_threshold(1234, 5, 6)


class StoresBuilt(asyncload.Dataset[tuple[int, int]]):
    """The obstore stores the worker had built when the sample was asked for, and once the
    store for ``s3://asyncload-standby`` was looked up as a read would."""

    def __len__(self) -> int:
        return 2

    async def __getitem__(self, index: int) -> tuple[int, int]:
        from asyncload._storage import api as _storage

        backend: Any = _storage.backend_for("s3://asyncload-standby")
        before = len(backend._stores)
        backend._store("s3", "asyncload-standby", _storage.options_for("s3://asyncload-standby/k"))
        return before, len(backend._stores)


def init_sets_aws_region(worker_id: int) -> None:
    """A worker_init_fn that changes what an S3 store reads from the environment."""
    os.environ["AWS_REGION"] = f"worker-{worker_id}"


class SharedCounter(asyncload.Dataset[int]):
    """Counts its samples in objects multiprocessing hands to a child only as it starts
    ("through inheritance"): a synchronized Value under a Lock, a Queue, an Event, and (where
    given) a Manager's dict proxy."""

    def __init__(self, n: int, ctx: Any, shared: Any = None) -> None:
        self.n = n
        self.count = ctx.Value("i", 0)
        self.lock = ctx.Lock()
        self.seen = ctx.Queue()
        self.started = ctx.Event()
        self.shared = shared

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, index: int) -> int:
        with self.lock:
            self.count.value += 1
        self.started.set()
        if index == 0:
            self.seen.put(os.getpid())
        if self.shared is not None:
            self.shared[index] = os.getpid()
        return index


class InitCounts:
    """A worker_init_fn holding a synchronized Value: how many workers started."""

    def __init__(self, ctx: Any) -> None:
        self.started = ctx.Value("i", 0)

    def __call__(self, worker_id: int) -> None:
        with self.started.get_lock():
            self.started.value += 1
