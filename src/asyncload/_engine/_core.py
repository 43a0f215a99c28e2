"""What every part of the engine shares: its configuration, its state, and the replies it sends.

``EngineCore`` holds the state that ``Engine`` (``__init__.py``) and its two ways of fetching
(``_engine/_map.py``, ``_engine/_iter.py``) work on, and the helpers that answer a task:
``_deliver`` collates a
batch and puts a ``Result``, ``_fail`` puts a ``Failure``. Every task gets exactly one reply; see
NOTE [ Data flow and shutdown ] in ``_protocol/messages.py``.
"""

from __future__ import annotations

import asyncio
import collections
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._checkpoint import elastic_iter as _elastic_iter
from .._control import LimitState
from .._dataset import cpu as _cpu
from .._dataset import datapipes as _datapipes
from .._dataset.base import batch_fetcher_for, fetcher_for
from .._dataset.sample_errors import SkippedSample
from .._protocol.messages import Failure, IndexTask, IterTask, RemoteError, Result
from .._stats import recorder as _metrics
from .options import WorkerOptions
from .slots import Slots, auto_ceiling, initial_limit

__all__ = ["EngineCore", "WorkerConfig"]

_DEFAULT_OPTIONS = WorkerOptions()  # frozen: one shared default

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
    plan: Any = None
    """The units this worker reads on its first pass, re-dealt from a checkpoint taken with
    another number of readers (``_checkpoint.elastic_iter``); ``None``: its ordinary share."""
    options: WorkerOptions = _DEFAULT_OPTIONS
    """The loader's arguments every worker reads as given (``_engine/options.py``)."""
    learned_limit: Any = None
    """Where an adaptive limit starts (a ``_control.LimitState`` the main process combined from
    the last pass's workers); ``None``: from ``slots.initial_limit``."""


class EngineCore:
    """The engine's state and the replies it sends; ``Engine`` documents the arguments."""

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
        self._sem = Slots(
            cfg.options.max_concurrency,
            initial=initial_limit(cfg.batch_size),
            learned=cfg.learned_limit,
            ceiling=auto_ceiling(cfg.num_workers),
        )
        # A storage attempt told "too many" cuts the adaptive limit at once (slots.py).
        self.recorder.on_throttle = self._sem.throttled
        self._tasks: set[asyncio.Task[Any]] = set()
        self._iter_requests: asyncio.Queue[IterTask] = asyncio.Queue()
        self._iter_task: asyncio.Task[None] | None = None
        # Index batches wait here for the starter task, so that control messages (StartPass,
        # Shutdown) are handled at once even while every fetch slot is taken.
        self._batches: asyncio.Queue[IndexTask] = asyncio.Queue()
        # Samples of the batch being started that wait for a slot (_map.MapFetching._run_slot).
        self._line: collections.deque[Any] = collections.deque()
        # Whether a slot's holder that finds the line empty moves the next batch waiting in
        # _batches into it itself (_map.MapFetching._refill): not while a pass's first batch
        # has the worker to itself (HEAD_START), nor while the starter waits for one.
        self._refill_ok = False
        self._starter: asyncio.Task[None] | None = None
        self._cancelling = False  # True while the engine itself cancels its tasks
        self._last_stats = 0.0
        # The CPU clocks when this pass began (_stats, loader.stats()'s stage figures): set
        # when the engine starts running (Engine.run) and at each StartPass.
        self._own_process = os.getpid() != cfg.main_pid
        self._cpu_base = self._lane_base = 0.0
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
            self._note_cpu()
            self.recorder.limit = self._sem.limit
            self.recorder.cpu_bound_s = self._sem.cpu_bound_s
            return self.recorder.snapshot()
        return None

    def _learned(self) -> LimitState | None:
        """Where the adaptive limit got to, for the next pass's workers (``slots.learned_from``);
        ``None`` with a fixed one."""
        controller = self._sem.controller
        return None if controller is None else controller.export()

    def _cpu_clocks(self) -> tuple[float, float]:
        """(CPU seconds of this worker so far, of which on its lane)."""
        lane = _cpu.current()
        lane_s = lane.busy_s if lane is not None else 0.0
        if self._own_process:
            return time.process_time(), lane_s
        # A thread worker shares its process with the training loop: count only its loop's
        # thread (stats are taken there) and its lane.
        return time.thread_time() + lane_s, lane_s

    def _restart_cpu_clocks(self) -> None:
        self._cpu_base, self._lane_base = self._cpu_clocks()

    def _note_cpu(self) -> None:
        cpu_s, lane_s = self._cpu_clocks()
        self.recorder.cpu_s = cpu_s - self._cpu_base
        self.recorder.lane_s = lane_s - self._lane_base

    # ── replies ────────────────────────────────────────────────────────────────────────────

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
                self._learned(),
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
        if self.cfg.options.skip_sample_errors:  # an empty batch is not collated, only reported
            count = len(samples) if self.cfg.auto_collation else int(not skipped)
        try:
            data = self.cfg.collate_fn(samples) if count != 0 else None
        except Exception as exc:
            self._fail(send_idx, exc)
            return
        # Idle after this batch (e.g. the epoch's last): send final counts, else throttle;
        # news for the other workers (``LimitController.news``) goes at once.
        controller = self._sem.controller
        stats = self._stats(
            force=self.recorder.in_flight == 0
            or bool(skipped)
            or (controller is not None and controller.news)
        )
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
                self._learned() if stats is not None else None,
            )
        )

    def _skip_sample(self, exc: Exception, index: Any) -> SkippedSample:
        # Counted by the main process (LoaderStats.skipped), not as an error that reached it.
        return SkippedSample.capture(exc, index)

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
