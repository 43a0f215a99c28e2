"""Async dataset base classes, and how a worker calls any dataset without blocking its loop.

``asyncload.Dataset`` and ``asyncload.IterableDataset`` subclass torch's classes, so samplers,
``len()``, ``ConcatDataset`` and type checks keep working. The worker adapts every kind of dataset
to two coroutine shapes with ``fetcher_for`` and ``aiter_for``:

* async ``__getitem__``      → awaited on the worker's event loop;
* sync ``__getitem__``       → run in the worker's thread pool (the loop keeps fetching);
* ``__getitems__``           → called once per batch, as torch does (``batch_fetcher_for``);
* ``Subset``/``ConcatDataset`` → looked through to the datasets inside (not a subclass that
  overrides ``__getitem__`` or ``__getitems__``: torch calls the override, and so do we);
* async ``__aiter__``        → iterated on the loop; yielded awaitables run concurrently;
* sync ``__iter__``          → ``next()`` runs in the thread pool.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, Generic, TypeVar

import torch.utils.data

from .calling import checked_fetch  # asyncload-guard hook

__all__ = [
    "Dataset",
    "IterableDataset",
    "aclose_quietly",
    "aiter_for",
    "batch_fetcher_for",
    "fetcher_for",
]

T_co = TypeVar("T_co", covariant=True)


class Dataset(torch.utils.data.Dataset[T_co], Generic[T_co]):
    """A map-style dataset whose ``__getitem__`` is a coroutine.

    Subclasses implement ``async def __getitem__(self, index)`` and ``__len__``. The loader keeps up
    to ``max_concurrency`` of these coroutines in flight per worker, across batches.

    Examples:
        >>> import asyncload
        >>> class Pages(asyncload.Dataset):
        ...     def __init__(self, urls):
        ...         self.urls = urls
        ...     def __len__(self):
        ...         return len(self.urls)
        ...     async def __getitem__(self, index):
        ...         return await asyncload.read(self.urls[index])
    """

    async def __getitem__(self, index: Any) -> T_co:  # type: ignore[override]
        raise NotImplementedError(f"{type(self).__name__} must implement async __getitem__")

    def __len__(self) -> int:
        raise NotImplementedError(f"{type(self).__name__} must implement __len__")

    def __getitems__(self, indices: list[Any]) -> list[Any]:
        # Only torch's own DataLoader calls this (asyncload's worker awaits __getitem__ instead,
        # see batch_fetcher_for): run the coroutines one at a time on a private loop, so a plain
        # DataLoader (as trainers build) still gets samples, not coroutines. See _plain.py.
        from .plain import getitems_sync

        return getitems_sync(self, indices)


class IterableDataset(torch.utils.data.IterableDataset[T_co], Generic[T_co]):
    """An iterable-style dataset whose ``__aiter__`` is an async generator.

    Every worker iterates its own copy; use [`asyncload.shard`][asyncload.shard] so each item is
    yielded by one worker (and one rank) only. A generator may yield *awaitables* instead of
    samples: the worker then runs up to ``max_concurrency`` of them at once and keeps their order.

    Examples:
        >>> import asyncload
        >>> class Lines(asyncload.IterableDataset):
        ...     def __init__(self, urls):
        ...         self.urls = urls
        ...     async def __aiter__(self):
        ...         for url in asyncload.shard(self.urls):
        ...             yield asyncload.read(url)   # an awaitable: fetched concurrently
    """

    def __aiter__(self) -> AsyncIterator[T_co]:
        raise NotImplementedError(f"{type(self).__name__} must implement async __aiter__")

    def __iter__(self) -> Iterator[T_co]:
        raise TypeError(
            f"{type(self).__name__} is asynchronous: iterate it with asyncload.DataLoader "
            "or `async for`"
        )


def fetcher_for(dataset: Any) -> Callable[[Any], Awaitable[Any]]:
    """Return ``async fetch(index)`` for a map-style dataset of either kind.

    A sample that is itself a coroutine (``await`` forgotten) is refused with a clear error.
    """
    return checked_fetch(_fetcher_for(dataset), dataset)


def _fetcher_for(dataset: Any) -> Callable[[Any], Awaitable[Any]]:
    """``async fetch(index)`` without the check; see :func:`fetcher_for`.

    A synchronous ``__getitem__`` runs in the running loop's default executor, which the worker
    sets to its thread pool. torch's ``Subset`` and ``ConcatDataset`` are looked through, so
    that the async datasets inside them are awaited on the loop rather than from a thread.
    """
    if _plain(dataset, torch.utils.data.Subset):
        inner, indices = _fetcher_for(dataset.dataset), dataset.indices
        return lambda index: inner(indices[index])
    if _plain(dataset, torch.utils.data.ConcatDataset):
        parts = [_fetcher_for(d) for d in dataset.datasets]
        ends = dataset.cumulative_sizes

        def concat_fetch(index: Any) -> Awaitable[Any]:
            if index < 0:
                index += len(dataset)
            part = bisect.bisect_right(ends, index)
            return parts[part](index - (ends[part - 1] if part else 0))

        return concat_fetch
    getitem = type(dataset).__getitem__
    if inspect.iscoroutinefunction(getitem):
        return dataset.__getitem__  # type: ignore[no-any-return]

    async def fetch_in_thread(index: Any) -> Any:
        result = await asyncio.get_running_loop().run_in_executor(None, getitem, dataset, index)
        if inspect.isawaitable(result):
            result = await result
        return result

    return fetch_in_thread


def batch_fetcher_for(dataset: Any) -> Callable[[list[Any]], Awaitable[list[Any]]] | None:
    """``async fetch(indices)`` when the dataset defines ``__getitems__`` (torch's batched
    access, which Hugging Face datasets implement), else ``None``."""
    getitems = getattr(type(dataset), "__getitems__", None)
    if (
        getitems is None
        or getitems is Dataset.__getitems__  # only for torch's own loader (see _plain.py)
        or _plain(dataset, torch.utils.data.Subset)
    ):
        return None  # looked through per sample by fetcher_for
    if inspect.iscoroutinefunction(getitems):
        return dataset.__getitems__  # type: ignore[no-any-return]

    async def fetch_in_thread(indices: list[Any]) -> list[Any]:
        loop = asyncio.get_running_loop()
        result = await loop.run_in_executor(None, getitems, dataset, indices)
        return [await r if inspect.isawaitable(r) else r for r in result]

    return fetch_in_thread


def _plain(dataset: Any, cls: type) -> bool:
    """*dataset* is a *cls* whose item access is *cls*'s own, so looking through it is exact."""
    kind = type(dataset)
    return isinstance(dataset, cls) and all(
        getattr(kind, name, None) is getattr(cls, name, None)
        for name in ("__getitem__", "__getitems__")
    )


async def _sync_to_async(it: Iterator[Any]) -> AsyncIterator[Any]:
    loop = asyncio.get_running_loop()
    done = object()
    while True:
        item = await loop.run_in_executor(None, next, it, done)
        if item is done:
            return
        yield item


def aiter_for(dataset: Any) -> AsyncIterator[Any]:
    """Return an async iterator over an iterable-style dataset of either kind."""
    if hasattr(dataset, "__aiter__"):
        return dataset.__aiter__()  # type: ignore[no-any-return]
    return _sync_to_async(iter(dataset))


async def aclose_quietly(it: AsyncIterator[Any] | None) -> None:
    """Close *it* (an iterator from ``aiter_for``) if it can be closed, so that its ``finally``
    blocks (open files, streams) run now, in this loop; what closing raises is dropped: the
    caller is already ending the iteration for a reason of its own."""
    close = getattr(it, "aclose", None)
    if close is not None:
        with contextlib.suppress(Exception):
            await close()
