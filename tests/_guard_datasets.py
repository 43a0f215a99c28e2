"""Datasets that make issue 12's mistakes: blocking calls in async code, a missing await."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Coroutine
from typing import Any

import asyncload


class Blocking(asyncload.Dataset[int]):
    """Indices in `slow` block the event loop with time.sleep(delay); index `lag` awaits a bit."""

    def __init__(self, n: int, slow: tuple[int, ...], delay: float, lag: int = -1) -> None:
        self.n, self.slow, self.delay, self.lag = n, slow, delay, lag

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, index: int) -> int:
        if index == self.lag:
            await asyncio.sleep(0.3)
        if index in self.slow:
            mark = os.environ.get("ASYNCLOAD_TEST_MARK")
            if mark:
                with open(mark, "a") as f:  # noqa: ASYNC230 - blocking on purpose
                    f.write(f"{os.getpid()}\n")
            time.sleep(self.delay)  # the blocking line
        return index


class Busy(asyncload.Dataset[int]):
    """Every sample spends `cpu` seconds of CPU without awaiting: a decode done inline."""

    def __init__(self, n: int, cpu: float) -> None:
        self.n, self.cpu = n, cpu

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, index: int) -> int:
        began = time.thread_time()
        while time.thread_time() - began < self.cpu:
            pass
        return index


class ForgetsAwait(asyncload.Dataset[int]):
    """Index `bad` returns a coroutine it should have awaited."""

    def __init__(self, n: int, bad: int) -> None:
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, index: int) -> Any:
        if index == self.bad:
            return _value(index)  # missing await
        return index


async def _value(index: int) -> int:
    await asyncio.sleep(0)
    return index


class SyncReturnsCoroutine(asyncload.Dataset[int]):
    """A sync __getitem__ returning a coroutine: awaited, as before."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> Coroutine[Any, Any, int]:  # type: ignore[override]
        return _value(index)


def _refuse_to_rebuild() -> None:
    raise AttributeError("Can't get attribute 'Vanished' on <module '__mp_main__'>")


class FailsToUnpickle(asyncload.Dataset[int]):
    """Pickles fine, but can't be unpickled (as a class the worker can't import)."""

    def __len__(self) -> int:
        return 4

    async def __getitem__(self, index: int) -> int:
        return index

    def __reduce__(self) -> tuple[Any, ...]:
        return (_refuse_to_rebuild, ())


class AwaitsForever(asyncload.Dataset[int]):
    """Sample *stuck* awaits an event nobody sets (the loop keeps turning); the others are their
    index."""

    def __init__(self, n: int, stuck: int) -> None:
        self.n, self.stuck = n, stuck

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, index: int) -> int:
        if index == self.stuck:
            await asyncio.Event().wait()  # never set
        return index
