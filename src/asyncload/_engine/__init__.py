"""The engine: one event loop fetching up to ``max_concurrency`` samples at once, across batches.

The same ``Engine`` runs in a worker process and, for ``num_workers=0``, in a background
thread of the main process (both in ``_workers/child.py``). It reads tasks from an asyncio queue,
starts one coroutine per sample, collates a batch the moment its last sample lands and hands it to
``put``. Every task gets exactly one reply; see NOTE [ Data flow and shutdown ] in
``_protocol/messages.py``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from .._protocol.messages import IndexTask, IterTask, PassStarted, Peers, Shutdown, StartPass
from .._stats import recorder as _metrics
from ._core import WorkerConfig
from ._iter import IterFetching
from ._map import MapFetching
from .options import WorkerOptions

__all__ = ["Engine", "WorkerConfig", "WorkerOptions"]


class Engine(MapFetching, IterFetching):
    """Fetches, collates and hands over batches for one worker (process or thread).

    Args:
        cfg: The worker's configuration.
        put: Delivers a reply message to the main process; must not block for long.
        where: Names this worker in error messages ("in DataLoader worker 1 (pid 123)").
        recorder: Its counters; a new one by default.

    Its state and replies live in ``_engine/_core.py``, map-style fetching in ``_engine/_map.py``
    and iterable-style fetching in ``_engine/_iter.py``.
    """

    # ── main loop ──────────────────────────────────────────────────────────────────────────

    async def run(self, inbox: asyncio.Queue[object]) -> None:
        # The pass's CPU counts from here, before its first task: its first batch and the
        # connections it opens are the pass's (a persistent worker's next passes restart the
        # clocks at StartPass). Counted from the first stats instead, the first batch's CPU
        # was left out: bench_wholerun's default and fixed rows, whose first batches differ,
        # were compared on different shares of their passes.
        self._restart_cpu_clocks()
        with _metrics.use(self.recorder):  # tasks started from here on inherit it
            await self._run(inbox)

    async def _run(self, inbox: asyncio.Queue[object]) -> None:
        try:
            while True:
                msg = await inbox.get()
                if isinstance(msg, Peers):
                    self._sem.merge(msg.state)
                elif isinstance(msg, IndexTask):
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
                    self._restart_cpu_clocks()
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
        starters = []
        for attr in ("_iter_task", "_starter"):
            task = getattr(self, attr)
            if task is not None:
                starters.append(task)
                setattr(self, attr, None)
        # Set before anything is cancelled: _pump catches its own cancellation and only gives
        # up (rather than wait on a full queue) because _as_failure re-raises while this is set.
        self._cancelling = True
        self._refill_ok = False  # the next pass's starter opens it again
        self._line.clear()  # a slot that outlives its cancellation must not go on to these
        try:
            # What starts fetches stops first (the iterable pump with it): then no fetch can
            # start that this snapshot of the fetches misses.
            await _cancel_and_wait(starters)
            await _cancel_and_wait(list(self._tasks))
        finally:
            self._cancelling = False
        self._tasks.clear()
        self._iter_requests = asyncio.Queue()
        self._batches = asyncio.Queue()
        # A new pass gets new slots; an adaptive limit starts where this one got to.
        self._sem = self._sem.renewed()
        self.recorder.on_throttle = self._sem.throttled
        self.recorder.in_flight = 0


async def _cancel_and_wait(tasks: list[asyncio.Task[Any]]) -> None:
    for t in tasks:
        t.cancel()
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)
