"""Map-style fetching: one coroutine per sample (or one per batch with ``__getitems__``).

A batch starts as soon as fetch slots free up, before the previous one completes, and is
collated the moment its last sample lands. A pass's first batch starts alone (``HEAD_START``).
A slot is a task: when its sample is done it goes on to the next sample waiting in line, of
its batch or of the next one waiting (``_refill``).
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import numpy as np

from .._control import aside as _aside
from .._dataset import cpu as _cpu
from .._dataset.sample_errors import SkippedSample
from .._protocol.messages import IndexTask
from ._core import EngineCore
from .slots import Held

__all__ = ["HEAD_START", "MapFetching"]

# Seconds a pass's first batch has the worker to itself, at most (less if it completes sooner).
# At a pass start the whole window is new: sent together, the head batch's requests and those of
# every later batch come back together, and the batch the training loop waits for is read
# interleaved with up to max_concurrency others (0.10-0.11 s to a later epoch's first batch at
# 50 ms). Sent alone for about what a worker takes to connect for and send one batch (7-10 ms
# for 32 requests here), its responses land first; the rest of the pass starts at most 10 ms
# later, once per pass. (An iterable dataset's samples come one by one from its generator.)
HEAD_START = 0.01


class _Batch:
    """A map-style batch being fetched: samples land in their slot as they complete."""

    __slots__ = ("failed", "remaining", "samples", "skipped", "task")

    def __init__(self, task: IndexTask, n: int) -> None:
        self.task = task
        self.samples: list[Any] = [None] * n
        self.remaining = n
        self.failed = False
        self.skipped: list[SkippedSample] = []  # left out (sample_errors='skip'/'warn')


class MapFetching(EngineCore):
    """Answers ``IndexTask``s: the engine's map-style half."""

    async def _start(self) -> None:
        # A new pass's first batch, alone for HEAD_START: _refill_ok stays False meanwhile.
        head = await self._start_batch(await self._batches.get(), head=True)
        if head:
            await asyncio.wait(head, timeout=HEAD_START)
        while True:
            self._refill_ok = False  # the batch that comes next is this task's to start
            await self._start_batch(await self._batches.get())

    async def _start_batch(self, task: IndexTask, *, head: bool = False) -> list[asyncio.Task[Any]]:
        """Start fetching *task*'s samples, and those of the batches a holder moves into the
        line meanwhile (``_refill``); the tasks this started."""
        if self._fetch_batch is not None:
            batch, indices = self._batch_of(task)
            if not indices:
                return []
            granted = await self._sem.acquire()
            self.recorder.in_flight += 1
            return [self._spawn(self._fetch_many(batch, indices, granted))]
        started: list[asyncio.Task[Any]] = []
        line = self._line
        self._enqueue(task)
        self._refill_ok = not head
        while line:
            # Waiting here is the backpressure: the next batch starts as soon as slots free up,
            # before this one completes. A slot's holder takes the next sample in line itself
            # (_run_slot), so this wakes when the line is empty, when an adaptive limit grew,
            # and for the samples a holder refused its slot left in line (Held.keep).
            granted = await self._sem.acquire()
            item = self._next_in_line()
            if item is None:
                self._sem.release()
                break
            started.append(self._spawn(self._run_slot(item, granted)))
        return started

    def _batch_of(self, task: IndexTask) -> tuple[_Batch, list[Any]]:
        """*task* as a batch to fill and its indices; an empty one is answered here."""
        indices = task.indices
        if not self.cfg.auto_collation:
            indices = [indices]
        elif isinstance(indices, np.ndarray):
            indices = indices.tolist()
        if not indices:
            self._deliver(task.send_idx, [])
        return _Batch(task, len(indices)), indices

    def _enqueue(self, task: IndexTask) -> bool:
        """Put *task*'s samples in line; whether it has any."""
        batch, indices = self._batch_of(task)
        self._line.extend((batch, pos, index) for pos, index in enumerate(indices))
        return bool(indices)

    def _refill(self) -> bool:
        """Move the next batch waiting for the starter into the empty line, if the starter is
        busy (it waits for a slot) and the pass's head start is over; whether one was moved.

        A holder that found the line empty ended, and the starter took the next batch and
        started a task per slot again: at every batch the worker's tasks all ended and began
        anew (7 per batch of 32 on the in-memory store, and the starter woken for each).
        """
        batches = self._batches
        while self._refill_ok and not batches.empty():
            if self._enqueue(batches.get_nowait()):
                return True
        return False

    def _waiting(self) -> bool:
        """Whether a sample waits for a slot: in line, or in a batch ``_refill`` would move."""
        return bool(self._line) or (self._refill_ok and not self._batches.empty())

    def _next_in_line(self) -> tuple[_Batch, int, Any] | None:
        """The next sample waiting for a slot (counted in flight); ``None``: none waits."""
        line = self._line
        while not self._cancelling and (line or self._refill()):
            item: tuple[_Batch, int, Any] = line.popleft()
            if not item[0].failed:  # a failed batch's other samples are not fetched
                self.recorder.in_flight += 1
                return item
        return None

    async def _run_slot(self, first: tuple[_Batch, int, Any], granted: float) -> None:
        """Fetch *first*, then the samples next in line (of this batch and, once they are
        all started, of the next ones: ``_refill``), in this task, holding one slot.

        Keeping the slot for the next sample, rather than releasing it to the starter that
        then starts a task, saves the next sample two turns of a busy loop (1-2 ms of its ~55
        at 50 ms). An adaptive limit that shrank below the samples in flight, or a sample
        waiting to take a slot again after a retry's backoff, takes the slot instead
        (``Held.keep``): this task then ends, and leaves the line as it was.
        """
        item: tuple[_Batch, int, Any] | None = first
        ok: bool | None = None
        slot = Held(self._sem, granted)
        _aside.seat.set(slot)  # this task's samples: their retries wait outside the slot
        try:
            while item is not None:
                ok = await self._fetch_one(*item)
                # Asked before the next sample is taken from the line: a task that waited for
                # a slot holding it made every later one wait in turn (Held.keep).
                if not self._waiting() or not slot.keep(ok):
                    break
                ok = None  # told by keep
                item = self._next_in_line()
                if item is None:
                    break
                if _cancelled_within():
                    # A sample left a cancellation caught and not withdrawn on this task: the
                    # next one gets a task of its own, as _as_failure reads that count.
                    self._spawn(self._run_slot(item, slot.hand_over()))
                    return
        except BaseException:
            slot.release(None)
            raise
        slot.release(ok)

    async def _fetch_many(self, batch: _Batch, indices: list[Any], granted: float) -> None:
        assert self._fetch_batch is not None
        _cpu.priority.set(batch.task.send_idx)  # this batch's CPU work, in batch order
        slot = Held(self._sem, granted)
        _aside.seat.set(slot)  # its retries wait outside the slot
        t0 = time.perf_counter()
        ok: bool | None = None
        try:
            samples = await self._fetch_batch(indices)
            if len(samples) != len(indices):
                raise ValueError(
                    f"__getitems__ returned {len(samples)} samples for {len(indices)} indices"
                )
        except (Exception, asyncio.CancelledError) as exc:
            error = self._as_failure(exc)
            if self.cfg.options.skip_sample_errors:  # which sample failed is unknown: all of them
                self._deliver(
                    batch.task.send_idx, [], [self._skip_sample(error, i) for i in indices]
                )
            else:
                self._fail(batch.task.send_idx, error, indices)
            ok = False
            return
        else:
            ok = True
        finally:
            slot.release(ok)
            self.recorder.in_flight -= 1
        per_sample = (time.perf_counter() - t0) / len(indices)
        for _ in indices:
            self.recorder.note_sample(per_sample)
        self._deliver(batch.task.send_idx, list(samples))

    async def _fetch_one(self, batch: _Batch, pos: int, index: Any) -> bool:
        """Fetch one sample into its batch; whether it was fetched (not failed)."""
        assert self._fetch is not None
        _cpu.priority.set(batch.task.send_idx)  # its CPU work goes in batch order
        t0 = time.perf_counter()
        try:
            sample = await self._fetch(index)
        except (Exception, asyncio.CancelledError) as exc:
            error = self._as_failure(exc)
            if self.cfg.options.skip_sample_errors:
                batch.skipped.append(self._skip_sample(error, index))
                batch.samples[pos] = _LEFT_OUT
                sample = _LEFT_OUT
            elif not batch.failed:
                batch.failed = True
                self._fail(batch.task.send_idx, error, index)
                return False
            else:
                return False
        finally:
            self.recorder.in_flight -= 1
        fetched = sample is not _LEFT_OUT
        if fetched:
            self.recorder.note_sample(time.perf_counter() - t0)
        if batch.failed:
            return fetched
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
        return fetched


def _cancelled_within() -> bool:
    task = asyncio.current_task()
    return sys.version_info >= (3, 11) and task is not None and task.cancelling() > 0


_LEFT_OUT: Any = object()  # a batch slot whose sample failed and was skipped
