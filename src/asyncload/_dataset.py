"""Async dataset base classes, and how a worker calls any dataset without blocking its loop.

``asyncload.Dataset`` and ``asyncload.IterableDataset`` subclass torch's classes, so samplers,
``len()``, ``ConcatDataset`` and type checks keep working. The worker adapts every kind of dataset
to two coroutine shapes with :func:`fetcher_for` and :func:`aiter_for`:

* async ``__getitem__``      → awaited on the worker's event loop;
* sync ``__getitem__``       → run in the worker's thread pool (the loop keeps fetching);
* async ``__aiter__``        → iterated on the loop; yielded awaitables run concurrently;
* sync ``__iter__``          → ``next()`` runs in the thread pool.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, Generic, TypeVar

import torch.utils.data

__all__ = ["Dataset", "IterableDataset", "aiter_for", "fetcher_for", "is_async_dataset"]

T_co = TypeVar("T_co", covariant=True)


class Dataset(torch.utils.data.Dataset[T_co], Generic[T_co]):
    """A map-style dataset whose ``__getitem__`` is a coroutine.

    Subclasses implement ``async def __getitem__(self, index)`` and ``__len__``. The loader keeps up
    to ``max_concurrency`` of these coroutines in flight per worker, across batches.

    Example:
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


class IterableDataset(torch.utils.data.IterableDataset[T_co], Generic[T_co]):
    """An iterable-style dataset whose ``__aiter__`` is an async generator.

    Every worker iterates its own copy; use :func:`asyncload.shard` so each item is yielded by one
    worker (and one rank) only. A generator may yield *awaitables* instead of samples: the worker
    then runs up to ``max_concurrency`` of them at once and keeps their order.

    Example:
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


def is_async_dataset(dataset: object) -> bool:
    """True when the dataset's items come from coroutines (async getitem or async iterator)."""
    getitem = getattr(type(dataset), "__getitem__", None)
    return inspect.iscoroutinefunction(getitem) or hasattr(dataset, "__aiter__")


def fetcher_for(dataset: Any) -> Callable[[Any], Awaitable[Any]]:
    """Return ``async fetch(index)`` for a map-style dataset of either kind.

    A synchronous ``__getitem__`` runs in the running loop's default executor, which the worker
    sets to its thread pool.
    """
    getitem = type(dataset).__getitem__
    if inspect.iscoroutinefunction(getitem):
        return dataset.__getitem__  # type: ignore[no-any-return]

    async def fetch_in_thread(index: Any) -> Any:
        result = await asyncio.get_running_loop().run_in_executor(None, getitem, dataset, index)
        if inspect.isawaitable(result):
            result = await result
        return result

    return fetch_in_thread


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
