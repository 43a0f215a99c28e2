"""Samples that await for ever: :class:`SampleWatch`, on the worker's loop itself.

Every quarter threshold (at most every 5 s) it walks the loop's tasks down their ``await``
chains to the sample fetches (``_dataset.calling``): a fetch seen at the last look and still
there has not finished since. One that has awaited ``ASYNCLOAD_STUCK_SAMPLE`` seconds (300 by
default, ``0`` turns it off) while the loop turned is reported once per worker
(:class:`SampleStuck`), with the coroutine's stack at its current ``await``; the main process
raises a :class:`~asyncload.StuckSampleWarning` (``_loader.stalls``). Nothing is added to a
sample's own path. A loop that does not turn is the blocked-loop monitor's (``watchdog``).
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._dataset.calling import _FETCH_CODE
from .watchdog import seconds_setting

__all__ = ["SampleStuck", "SampleWatch", "start_sample_watch", "stuck_sample_threshold"]

ENV_STUCK_SAMPLE = "ASYNCLOAD_STUCK_SAMPLE"
DEFAULT_STUCK_SAMPLE = 300.0


def stuck_sample_threshold() -> float | None:
    """Seconds a sample may await before it is reported; ``None``: don't watch."""
    return seconds_setting(ENV_STUCK_SAMPLE, DEFAULT_STUCK_SAMPLE, "stuck-sample warning")


@dataclass(frozen=True, slots=True)
class SampleStuck:
    """Worker → main: a sample's fetch has awaited for *waited_s* seconds, the loop turning."""

    worker_id: int
    waited_s: float
    dataset: str
    index: str
    stack: str

    def warning_text(self) -> str:
        return (
            f"asyncload: sample {self.index} of {self.dataset} in DataLoader worker "
            f"{self.worker_id} has awaited for {self.waited_s:.0f} s without finishing (the "
            "event loop runs: something it awaits never completes, such as a request without a "
            "timeout, a future nobody sets or a lock never released). With timeout=0 the "
            "DataLoader waits for it for ever; give the await a timeout "
            "(`async with asyncio.timeout(...)`), or DataLoader(timeout=...). "
            f"{ENV_STUCK_SAMPLE}=<seconds> sets the threshold (0: off). Where it waits:\n"
            f"{self.stack}"
        )


def _await_chain(coro: Any) -> list[Any]:
    """*coro* and what it awaits, outermost first (coroutines, generators, async generators)."""
    chain: list[Any] = []
    while coro is not None and len(chain) < 200:
        chain.append(coro)
        coro = (
            getattr(coro, "cr_await", None)
            or getattr(coro, "gi_yieldfrom", None)
            or getattr(coro, "ag_await", None)
        )
    return chain


def _describe_await(chain: list[Any]) -> str:
    lines = []
    for c in chain:
        frame = getattr(c, "cr_frame", None) or getattr(c, "gi_frame", None)
        frame = frame or getattr(c, "ag_frame", None)
        if frame is not None:
            code = frame.f_code
            lines.append(f'  File "{code.co_filename}", line {frame.f_lineno}, in {code.co_name}')
        else:
            lines.append(f"  awaiting {type(c).__qualname__}: {c!r:.200}")
    return "\n".join(lines)


class SampleWatch:
    """Reports, through *put*, the first sample fetch that awaits longer than *threshold*.

    Runs on the loop (a timer every quarter threshold, at most every 5 s): the fetches it saw
    last time and still sees have not finished since; nothing is added to a sample's path.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        put: Callable[[object], None],
        worker_id: int,
        threshold: float,
    ) -> None:
        self._loop = loop
        self._put = put
        self._worker_id = worker_id
        self._threshold = threshold
        self._interval = min(threshold / 4, 5.0)
        self._seen: dict[int, tuple[float, weakref.ref[Any]]] = {}
        self._handle: asyncio.TimerHandle | None = None
        self._warned = False

    def start(self) -> None:
        self._handle = self._loop.call_later(self._interval, self._check)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()

    def _check(self) -> None:
        now = time.monotonic()
        seen: dict[int, tuple[float, weakref.ref[Any]]] = {}
        oldest: tuple[float, list[Any]] | None = None
        for task in asyncio.all_tasks(self._loop):
            chain = _await_chain(task.get_coro())
            pos = next(
                (i for i, c in enumerate(chain) if getattr(c, "cr_code", None) is _FETCH_CODE),
                None,
            )
            if pos is None:
                continue
            coro = chain[pos]
            key = id(coro)
            known = self._seen.get(key)
            since = known[0] if known is not None and known[1]() is coro else now
            seen[key] = (since, weakref.ref(coro))
            if oldest is None or since < oldest[0]:
                oldest = (since, chain[pos:])
        self._seen = seen
        if oldest is not None and now - oldest[0] >= self._threshold and not self._warned:
            self._warned = True  # once per worker
            fetch = oldest[1][0]
            local = fetch.cr_frame.f_locals if fetch.cr_frame is not None else {}
            self._put(
                SampleStuck(
                    self._worker_id,
                    now - oldest[0],
                    str(local.get("name", "")),
                    repr(local.get("index")),
                    _describe_await(oldest[1]),
                )
            )
        if not self._warned:
            self._handle = self._loop.call_later(self._interval, self._check)


def start_sample_watch(
    loop: asyncio.AbstractEventLoop, put: Callable[[object], None], worker_id: int
) -> SampleWatch | None:
    """Start a :class:`SampleWatch` on *loop*, unless turned off."""
    threshold = stuck_sample_threshold()
    if threshold is None:
        return None
    watch = SampleWatch(loop, put, worker_id, threshold)
    watch.start()
    return watch
