"""The engine: one event loop fetching up to ``max_concurrency`` samples at once, across batches.

The same ``Engine`` runs in a worker process and, for ``num_workers=0``, in a background
thread of the main process (both in ``_worker.py``). It reads tasks from an asyncio queue, starts
one coroutine per sample, collates a batch the moment its last sample lands and hands it to
``put``. Every task gets exactly one reply; see NOTE [ Data flow and shutdown ] in
``_protocol.py``.
"""

from __future__ import annotations

import asyncio
import inspect
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _datapipes, _elastic_iter, _metrics
from ._budget import SkippedSample
from ._dataset import aiter_for, batch_fetcher_for, fetcher_for
from ._protocol import (
    Exhausted,
    Failure,
    IndexTask,
    IterTask,
    PassStarted,
    RemoteError,
    Result,
    Shutdown,
    StartPass,
)

__all__ = ["Engine", "WorkerConfig"]

# Stats ride along with results at most this often (seconds), so they cost nothing per sample.
_STATS_EVERY = 0.2


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Everything a worker needs, sent once when it starts."""

    worker_id: int
    num_workers: int
    base_seed: int
    dataset: Any
    is_iterable: bool
    auto_collation: bool
    batch_size: int | None
    drop_last: bool
    collate_fn: Callable[[Any], Any]
    worker_init_fn: Callable[[int], None] | None
    max_concurrency: int
    rank: int
    world_size: int
    storage_config: object
    main_pid: int
    environ: dict[str, str] | None = None
    """The main process's environment when the pass started (see worker_main)."""
    skip: int = 0
    """Samples of an iterable dataset to skip on the first pass (resuming a checkpoint)."""
    shm_token: str = ""
    """Names the worker's block pool (NOTE [ Reused shared memory ]); empty: no pool."""
    shm_blocks: int = 0
    """At most this many blocks in the pool."""
    shared_seed: int | None = None
    """An ``IterDataPipe``'s shuffle seed, the same in every worker (torch's shared seed)."""
    skip_sample_errors: bool = False
    """Leave a failing sample out of its batch instead of failing the batch (``_budget``)."""
    plan: Any = None
    """The units this worker reads on its first pass, re-dealt from a checkpoint taken with
    another number of readers (``_elastic_iter``); ``None``: its ordinary share."""


class _Batch:
    """A map-style batch being fetched: samples land in their slot as they complete."""

    __slots__ = ("failed", "remaining", "samples", "skipped", "task")

    def __init__(self, task: IndexTask, n: int) -> None:
        self.task = task
        self.samples: list[Any] = [None] * n
        self.remaining = n
        self.failed = False
        self.skipped: list[SkippedSample] = []  # left out (sample_errors='skip'/'warn')


class Engine:
    """Fetches, collates and hands over batches for one worker (process or thread).

    Args:
        cfg: The worker's configuration.
        put: Delivers a reply message to the main process; must not block for long.
        where: Names this worker in error messages ("in DataLoader worker 1 (pid 123)").
        recorder: Its counters; a new one by default.
    """

    def __init__(
        self,
        cfg: WorkerConfig,
        put: Callable[[object], None],
        where: str,
        recorder: _metrics.Recorder | None = None,
    ) -> None:
        self.cfg = cfg
        # This engine's counters; run() makes them current for every task of its loop, so
        # storage notes made by its fetches land here (and nowhere else).
        self.recorder = recorder if recorder is not None else _metrics.Recorder()
        self._put = put
        self._where = where
        self._fetch = None if cfg.is_iterable else fetcher_for(cfg.dataset)
        # torch calls __getitems__ for a whole batch when a dataset defines it; so do we, as
        # one unit of concurrency per batch.
        self._fetch_batch = (
            batch_fetcher_for(cfg.dataset) if not cfg.is_iterable and cfg.auto_collation else None
        )
        self._generation = 0
        self._sem = asyncio.Semaphore(cfg.max_concurrency)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._iter_requests: asyncio.Queue[IterTask] = asyncio.Queue()
        self._iter_task: asyncio.Task[None] | None = None
        # Index batches wait here for the starter task, so that control messages (StartPass,
        # Shutdown) are handled at once even while every fetch slot is taken.
        self._batches: asyncio.Queue[IndexTask] = asyncio.Queue()
        self._starter: asyncio.Task[None] | None = None
        self._cancelling = False  # True while the engine itself cancels its tasks
        self._last_stats = 0.0
        self._skip = cfg.skip
        self._plan = cfg.plan
        # Items come with tags saying which sample they are, for elastic checkpoints.
        self._tagged = cfg.is_iterable and _elastic_iter.supports(cfg.dataset)
        # torch's DataLoader shards a DataPipe across every worker of every rank, and seeds
        # its shuffles with a seed all workers share (a new one every pass).
        self._datapipe = _datapipes.Placement(
            cfg.worker_id, cfg.num_workers, cfg.rank, cfg.world_size
        )
        self._datapipe.seed(cfg.dataset, cfg.shared_seed)
        self._datapipe.shard(cfg.dataset)

    # ── stats ──────────────────────────────────────────────────────────────────────────────

    def _stats(self, force: bool = False) -> _metrics.RecorderSnapshot | None:
        now = time.monotonic()
        if force or now - self._last_stats >= _STATS_EVERY:
            self._last_stats = now
            return self.recorder.snapshot()
        return None

    # ── main loop ──────────────────────────────────────────────────────────────────────────

    async def run(self, inbox: asyncio.Queue[object]) -> None:
        with _metrics.use(self.recorder):  # tasks started from here on inherit it
            await self._run(inbox)

    async def _run(self, inbox: asyncio.Queue[object]) -> None:
        try:
            while True:
                msg = await inbox.get()
                if isinstance(msg, IndexTask):
                    if msg.generation == self._generation:
                        if self._starter is None:
                            self._starter = asyncio.get_running_loop().create_task(self._start())
                        self._batches.put_nowait(msg)
                elif isinstance(msg, IterTask):
                    if msg.generation == self._generation:
                        self._ensure_iterating()
                        self._iter_requests.put_nowait(msg)
                elif isinstance(msg, StartPass):
                    await self._cancel_all()
                    # loader.stats() is per pass, and its clock starts again with this one.
                    self.recorder.reset()
                    self._generation = msg.generation
                    # The worker's dataset is a copy: carry the new epoch over (torch doesn't,
                    # so persistent workers there shuffle every epoch the same way).
                    set_epoch = getattr(self.cfg.dataset, "set_epoch", None)
                    if msg.epoch is not None and callable(set_epoch):
                        set_epoch(msg.epoch)
                    if msg.shared_seed is not None:  # torch reseeds every pass
                        self._datapipe.seed(self.cfg.dataset, msg.shared_seed)
                    self._put(PassStarted(msg.generation, self.cfg.worker_id))
                elif isinstance(msg, Shutdown):
                    return
        finally:
            await self._cancel_all()

    async def _cancel_all(self) -> None:
        tasks = list(self._tasks)
        for attr in ("_iter_task", "_starter"):
            task = getattr(self, attr)
            if task is not None:
                tasks.append(task)
                setattr(self, attr, None)
        self._cancelling = True
        try:
            for t in tasks:
                t.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            self._cancelling = False
        self._tasks.clear()
        self._iter_requests = asyncio.Queue()
        self._batches = asyncio.Queue()
        self._sem = asyncio.Semaphore(self.cfg.max_concurrency)
        self.recorder.in_flight = 0

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        """Start *coro*, tracked so that a new epoch or shutdown can cancel it."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _fail(self, send_idx: int, exc: BaseException, index: Any = None) -> None:
        self.recorder.errors[type(exc).__name__] += 1
        if index is None:
            where = f"{self._where} while producing batch {send_idx}"
        elif isinstance(index, list):
            where = f"{self._where} while fetching samples {index!r}"
        else:
            where = f"{self._where} while fetching sample {index!r}"
        self._put(
            Failure(
                send_idx,
                self._generation,
                self.cfg.worker_id,
                RemoteError.capture(exc, where),
                self._stats(force=True),
            )
        )

    def _deliver(
        self,
        send_idx: int,
        samples: Any,
        skipped: list[SkippedSample] | None = None,
        tags: tuple[Any, ...] = (),
    ) -> None:
        count = -1  # samples in this batch, counted towards a fractional error budget
        if self.cfg.skip_sample_errors:  # an empty batch is not collated, only reported
            count = len(samples) if self.cfg.auto_collation else int(not skipped)
        try:
            data = self.cfg.collate_fn(samples) if count != 0 else None
        except Exception as exc:
            self._fail(send_idx, exc)
            return
        # Idle after this batch (e.g. the epoch's last): send final counts, else throttle.
        stats = self._stats(force=self.recorder.in_flight == 0 or bool(skipped))
        self._put(
            Result(
                send_idx,
                self._generation,
                self.cfg.worker_id,
                data,
                stats,
                tuple(skipped or ()),
                count,
                tags,
            )
        )

    def _skip_sample(self, exc: Exception, index: Any) -> SkippedSample:
        # Counted by the main process (LoaderStats.skipped), not as an error that reached it.
        return SkippedSample.capture(exc, index)

    # ── map-style ──────────────────────────────────────────────────────────────────────────

    async def _start(self) -> None:
        while True:
            await self._start_batch(await self._batches.get())

    def _as_failure(self, exc: BaseException) -> Exception:
        """The error to report for a sample that raised *exc*.

        A CancelledError the engine did not cause (raised by the dataset, or by a task it
        awaited) is a failure of that sample; one the engine caused is re-raised.
        """
        if isinstance(exc, Exception):
            return exc
        task = asyncio.current_task()
        if (
            not isinstance(exc, asyncio.CancelledError)
            or self._cancelling
            or (task is not None and sys.version_info >= (3, 11) and task.cancelling())
        ):
            raise exc
        error = RuntimeError(f"the sample's coroutine was cancelled from inside: {exc!r}")
        error.__cause__ = exc
        return error

    async def _start_batch(self, task: IndexTask) -> None:
        indices = task.indices
        if not self.cfg.auto_collation:
            indices = [indices]
        elif isinstance(indices, np.ndarray):
            indices = indices.tolist()
        batch = _Batch(task, len(indices))
        if not indices:
            self._deliver(task.send_idx, [])
            return
        if self._fetch_batch is not None:
            await self._sem.acquire()
            self.recorder.in_flight += 1
            self._spawn(self._fetch_many(batch, indices))
            return
        for pos, index in enumerate(indices):
            # Waiting here is the backpressure: the next batch starts as soon as slots free up,
            # before this one completes.
            await self._sem.acquire()
            if batch.failed:
                self._sem.release()
                return
            self.recorder.in_flight += 1
            self._spawn(self._fetch_one(batch, pos, index))

    async def _fetch_many(self, batch: _Batch, indices: list[Any]) -> None:
        assert self._fetch_batch is not None
        t0 = time.perf_counter()
        try:
            samples = await self._fetch_batch(indices)
            if len(samples) != len(indices):
                raise ValueError(
                    f"__getitems__ returned {len(samples)} samples for {len(indices)} indices"
                )
        except (Exception, asyncio.CancelledError) as exc:
            error = self._as_failure(exc)
            if self.cfg.skip_sample_errors:  # which sample failed is unknown: all of them
                self._deliver(
                    batch.task.send_idx, [], [self._skip_sample(error, i) for i in indices]
                )
            else:
                self._fail(batch.task.send_idx, error, indices)
            return
        finally:
            self._sem.release()
            self.recorder.in_flight -= 1
        per_sample = (time.perf_counter() - t0) / len(indices)
        for _ in indices:
            self.recorder.note_sample(per_sample)
        self._deliver(batch.task.send_idx, list(samples))

    async def _fetch_one(self, batch: _Batch, pos: int, index: Any) -> None:
        assert self._fetch is not None
        t0 = time.perf_counter()
        try:
            sample = await self._fetch(index)
        except (Exception, asyncio.CancelledError) as exc:
            error = self._as_failure(exc)
            if self.cfg.skip_sample_errors:
                batch.skipped.append(self._skip_sample(error, index))
                batch.samples[pos] = _LEFT_OUT
                sample = _LEFT_OUT
            elif not batch.failed:
                batch.failed = True
                self._fail(batch.task.send_idx, error, index)
                return
            else:
                return
        finally:
            self._sem.release()
            self.recorder.in_flight -= 1
        if sample is not _LEFT_OUT:
            self.recorder.note_sample(time.perf_counter() - t0)
        if batch.failed:
            return
        batch.samples[pos] = sample
        batch.remaining -= 1
        if batch.remaining == 0:
            if batch.skipped:
                kept = [x for x in batch.samples if x is not _LEFT_OUT]
                self._deliver(batch.task.send_idx, kept, batch.skipped)
            else:
                self._deliver(
                    batch.task.send_idx, batch.samples if self.cfg.auto_collation else sample
                )

    # ── iterable-style ─────────────────────────────────────────────────────────────────────

    def _ensure_iterating(self) -> None:
        if self._iter_task is None:
            self._iter_task = asyncio.get_running_loop().create_task(self._iterate())

    async def _iterate(self) -> None:
        """Answer IterTasks in order from one pass over the dataset.

        A pump runs ahead of the requests by up to ``max_concurrency`` items; items that are
        awaitables are started immediately, so their fetches overlap, and taken in order.
        """
        ahead: asyncio.Queue[Any] = asyncio.Queue(maxsize=self.cfg.max_concurrency)
        end = object()
        skip, self._skip = self._skip, 0
        plan, self._plan = self._plan, None
        if self._tagged:
            it = self.cfg.dataset.elastic_iter(plan, skip)
        else:
            it = _skipping(self.cfg.dataset, skip)
        pump = asyncio.get_running_loop().create_task(self._pump(it, ahead, end))
        want = self.cfg.batch_size if self.cfg.auto_collation else 1
        exhausted = False
        position = skip  # of the next item in this worker's stream (names skipped samples)
        try:
            while True:
                req = await self._iter_requests.get()
                if exhausted:
                    self._put(Exhausted(req.send_idx, self._generation, self.cfg.worker_id))
                    continue
                samples: list[Any] = []
                # Left-out samples still count towards the batch, so every batch takes the
                # same number of items from the stream and a resume skips exactly that many.
                skipped: list[SkippedSample] = []
                tags: list[Any] = []
                try:
                    while len(samples) + len(skipped) < (want or 1):
                        item = await ahead.get()
                        if item is end:
                            exhausted = True
                            break
                        if isinstance(item, _Raised):  # the dataset's iterator raised
                            exhausted = True
                            raise item.exc
                        position += 1
                        if self._tagged:
                            tag, item = item
                            tags.append(tag)
                        if isinstance(item, asyncio.Future):
                            try:
                                item = await item
                            except Exception as exc:
                                if not self.cfg.skip_sample_errors:
                                    raise
                                skipped.append(self._skip_sample(exc, position - 1))
                                continue
                        samples.append(item)
                except Exception as exc:
                    self._fail(req.send_idx, exc)
                    continue
                taken = len(samples) + len(skipped)
                if not taken or (exhausted and self.cfg.drop_last and taken < (want or 1)):
                    self._put(Exhausted(req.send_idx, self._generation, self.cfg.worker_id))
                    continue
                if skipped:
                    self._deliver(req.send_idx, samples, skipped, tuple(tags))
                    continue
                self._deliver(
                    req.send_idx,
                    samples if self.cfg.auto_collation else samples[0],
                    tags=tuple(tags),
                )
        finally:
            pump.cancel()
            await asyncio.gather(pump, return_exceptions=True)

    async def _pump(self, it: AsyncIterator[Any], ahead: asyncio.Queue[Any], end: object) -> None:
        try:
            async for got in it:
                tag, item = got if self._tagged else (None, got)
                if inspect.isawaitable(item):
                    await self._sem.acquire()
                    self.recorder.in_flight += 1
                    item = self._spawn(self._await_one(item))
                else:
                    self.recorder.note_sample(0.0)
                await ahead.put((tag, item) if self._tagged else item)
        except (Exception, asyncio.CancelledError) as exc:
            await ahead.put(_Raised(self._as_failure(exc)))
            return
        await ahead.put(end)

    async def _await_one(self, aw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            result = await aw
        except asyncio.CancelledError as exc:
            raise self._as_failure(exc) from exc
        finally:
            self._sem.release()
            self.recorder.in_flight -= 1
        self.recorder.note_sample(time.perf_counter() - t0)
        return result


async def _skipping(dataset: Any, skip: int) -> AsyncIterator[Any]:
    """Iterate *dataset* from sample *skip* on: its own ``aiter_from`` if it has one (it may
    know a cheaper way), else by discarding; awaitables skipped are closed, never fetched."""
    aiter_from = getattr(dataset, "aiter_from", None)
    if skip and callable(aiter_from):
        async for item in aiter_from(skip):
            yield item
        return
    async for item in aiter_for(dataset):
        if skip:
            skip -= 1
            if inspect.iscoroutine(item):
                item.close()
            continue
        yield item


_LEFT_OUT: Any = object()  # a batch slot whose sample failed and was skipped


@dataclass(frozen=True, slots=True)
class _Raised:
    exc: Exception
