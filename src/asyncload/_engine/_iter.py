"""Iterable-style fetching: ``IterTask``s answered in order from one pass over the dataset."""

from __future__ import annotations

import asyncio
import functools
import inspect
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from .._control import aside as _aside
from .._dataset.base import aclose_quietly, aiter_for
from .._dataset.sample_errors import SkippedSample
from .._protocol.messages import Exhausted
from ._core import EngineCore
from .slots import Held, most_in_flight

__all__ = ["IterFetching"]


class IterFetching(EngineCore):
    """Answers ``IterTask``s: the engine's iterable-style half."""

    def _ensure_iterating(self) -> None:
        if self._iter_task is None:
            self._iter_task = asyncio.get_running_loop().create_task(self._iterate())

    async def _iterate(self) -> None:
        """Answer IterTasks in order from one pass over the dataset.

        A pump runs ahead of the requests by up to ``max_concurrency`` items; items that are
        awaitables are started immediately, so their fetches overlap, and taken in order.
        """
        ahead: asyncio.Queue[Any] = asyncio.Queue(
            maxsize=most_in_flight(self.cfg.options.max_concurrency, self.cfg.num_workers)
        )
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
                                if not self.cfg.options.skip_sample_errors:
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
                    try:
                        granted = await self._sem.acquire()
                    except BaseException:
                        _close_unawaited(item)
                        raise
                    self.recorder.in_flight += 1
                    slot = _Slot(Held(self._sem, granted), item)
                    item = self._spawn(self._await_one(slot))
                    item.add_done_callback(functools.partial(self._never_ran, slot))
                else:
                    self.recorder.note_sample(0.0)
                await ahead.put((tag, item) if self._tagged else item)
        except (Exception, asyncio.CancelledError) as exc:
            await aclose_quietly(it)
            await ahead.put(_Raised(self._as_failure(exc)))
            return
        await ahead.put(end)

    async def _await_one(self, slot: _Slot) -> Any:
        slot.ran = True
        _aside.seat.set(slot.held)  # this task's: its retries wait outside the slot
        t0 = time.perf_counter()
        try:
            result = await slot.awaitable
        except asyncio.CancelledError as exc:
            raise self._as_failure(exc) from exc
        except Exception:
            slot.ok = False
            raise
        else:
            slot.ok = True
        finally:
            # Here, not in a callback: the slot is free before whoever awaits this task runs
            # (the batch it completes sees in_flight == 0 and sends final counts).
            self._free(slot)
        self.recorder.note_sample(time.perf_counter() - t0)
        return result

    def _never_ran(self, slot: _Slot, task: asyncio.Task[Any]) -> None:
        """A task cancelled before its first step never runs its coroutine: neither the
        ``finally`` above nor the awaitable it was given. Free its slot and close that."""
        if not slot.ran:
            self._free(slot)
            _close_unawaited(slot.awaitable)

    def _free(self, slot: _Slot) -> None:
        slot.held.release(slot.ok)  # the pass's, taken in _pump (a new pass: new)
        self.recorder.in_flight -= 1


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


class _Slot:
    """One fetch slot taken for an awaitable the dataset yielded."""

    __slots__ = ("awaitable", "held", "ok", "ran")

    def __init__(self, held: Held, awaitable: Any) -> None:
        self.held, self.awaitable, self.ran = held, awaitable, False
        self.ok: bool | None = None  # the awaitable's outcome, for an adaptive limit


def _close_unawaited(item: Any) -> None:
    """Close *item* if it is a coroutine never awaited (a no-op on one that ran), or cancel it
    if it is a future, so that dropping it loses nothing and warns nothing."""
    if inspect.iscoroutine(item):
        item.close()
    elif isinstance(item, asyncio.Future):
        item.cancel()


@dataclass(frozen=True, slots=True)
class _Raised:
    exc: Exception
