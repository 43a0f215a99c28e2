"""The one call every sample fetch goes through: ``checked_fetch``.

It refuses a sample that is itself a coroutine (an ``await`` forgotten in ``__getitem__``), and its
frame marks "a sample being fetched" on a stack: the engine's watchdogs
(``asyncload._engine.watchdog``) blame the sample found there for a blocked loop, and name the
one that awaits for ever.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["checked_fetch", "describe_dataset"]


def describe_dataset(dataset: Any) -> str:
    inner = getattr(dataset, "dataset", None)
    name = type(dataset).__qualname__
    return f"{name} of {describe_dataset(inner)}" if inner is not None else name


def checked_fetch(
    fetch: Callable[[Any], Awaitable[Any]], dataset: Any
) -> Callable[[Any], Awaitable[Any]]:
    """``fetch``, refusing a sample that is a coroutine; its frames mark a sample being fetched."""
    name = describe_dataset(dataset)

    async def _asyncload_fetch_sample(index: Any) -> Any:
        value = await fetch(index)
        if inspect.iscoroutine(value):
            value.close()  # never awaited: no "coroutine was never awaited" warning on top
            raise TypeError(
                f"{name}.__getitem__({index!r}) returned a coroutine: missing await? "
                "Write `return await ...` (or `x = await ...`) for every coroutine you call "
                "inside async def __getitem__."
            )
        return value

    return _asyncload_fetch_sample


_FETCH_CODE = checked_fetch(lambda i: None, None).__code__  # type: ignore[arg-type,return-value]
