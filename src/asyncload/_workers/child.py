"""Where an ``Engine`` runs: a worker process, or a thread.

For ``num_workers=0`` the engine runs in a thread of the main process (``ThreadWorker``).
``worker_main`` is the process entry point (module level, so every start method can pickle
it): it seeds the RNGs as torch does, installs the worker info, runs ``worker_init_fn``, starts a
uvloop loop with a thread pool as its default executor, and forwards tasks from the index queue
into the loop from a reader thread that also watches for the main process's death.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import concurrent.futures.thread as _futures_thread
import contextvars
import dataclasses
import functools
import gc
import inspect
import os
import pickle
import queue
import random
import signal
import threading
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.utils.data

from .._control import turns as _turns
from .._dataset import cpu as _cpu
from .._dataset import sharding as _sharding
from .._engine import Engine, WorkerConfig
from .._engine import sample_watch as _sample_watch
from .._engine import watchdog as _watchdog
from .._engine.slots import most_in_flight
from .._protocol import shipping as _shipping
from .._protocol.messages import POLL_INTERVAL, Failure, RemoteError, Result, Shutdown, Standing
from .._stats import recorder as _metrics
from .._storage import api as _storage
from .._transfer import shm as _shm
from .._transfer.pickling import INLINE_MAX, pack
from . import parent_watch as _parent_watch
from . import tuning as _tuning
from .parent_watch import parent_alive as _parent_alive

__all__ = ["ThreadWorker", "WorkerConfig", "new_event_loop", "worker_main"]


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A uvloop loop where uvloop is installed, else asyncio's default."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - Windows, or uvloop not installed
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


def _reseed(seed: int, worker_id: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    # Same derivation as torch's workers, so NumPy streams match torch's DataLoader.
    from torch.utils.data._utils.worker import _generate_state

    np.random.seed(_generate_state(seed - worker_id, worker_id))  # type: ignore[no-untyped-call]


def _install_worker_info(cfg: WorkerConfig) -> None:
    seed = cfg.base_seed + cfg.worker_id
    _sharding._set_worker_info(
        _sharding.WorkerInfo(
            id=cfg.worker_id,
            num_workers=cfg.num_workers,
            seed=seed,
            dataset=cfg.dataset,
            rank=cfg.rank,
            world_size=cfg.world_size,
        )
    )
    # torch.utils.data.get_worker_info() works too, and default_collate then allocates its
    # output in shared memory, so tensors cross to the main process without a copy.
    from torch.utils.data._utils import worker as torch_worker

    torch_worker._worker_info = torch_worker.WorkerInfo(
        id=cfg.worker_id, num_workers=cfg.num_workers, seed=seed, dataset=cfg.dataset
    )


# ── worker process ────────────────────────────────────────────────────────────────────────────


def _reader(
    index_queue: Any,
    loop: asyncio.AbstractEventLoop,
    inbox: asyncio.Queue[object],
    done_event: Any,
    main_pid: int,
    orphaned: threading.Event,
) -> None:
    """Forward tasks from the index queue into the loop; watch for the parent's death."""
    ppid = os.getppid()
    while True:
        freed: tuple[int, ...] = ()
        try:
            # (freed, message): the blocks the main process is done with ride on every send
            # (NOTE [ Reused shared memory ]); the messages themselves know nothing of them.
            freed, msg = index_queue.get(timeout=POLL_INTERVAL)
        except queue.Empty:
            if done_event.is_set():
                msg = Shutdown()
            elif not _parent_alive(main_pid, ppid):
                orphaned.set()
                msg = Shutdown()
            else:
                continue
        except (EOFError, OSError):  # the main process closed its end: it is gone
            orphaned.set()
            msg = Shutdown()
        except Exception:  # a task that can't be unpickled: stop, the main process reports it
            traceback.print_exc()
            msg = Shutdown()
        if freed and _shm.pool is not None:
            _shm.pool.release(freed)
        if msg is None:  # releases only
            continue
        try:
            loop.call_soon_threadsafe(inbox.put_nowait, msg)
        except RuntimeError:  # loop already closed
            return
        if isinstance(msg, Shutdown):
            return


def worker_main(sent: Any, index_queue: Any, result_queue: Any, done_event: Any) -> None:
    """Entry point of a worker process (module level so every start method can pickle it)."""
    # asyncload-guard hook: *sent* is a _shipping.Shipped WorkerConfig; a failure to unpickle it
    # is reported to the main process. A standby worker (_workers._standby) gets it later.
    if isinstance(sent, Standing):
        sent = _await_config(sent, index_queue, done_event)
        if sent is None:  # stopped before any pass took it
            return
    cfg: WorkerConfig | None = _shipping.received(sent, result_queue)
    if cfg is None:
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # asyncload-guard hook: exits even if the loop is stuck
    _parent_watch.watch_parent(cfg.main_pid)
    torch.set_num_threads(1)
    # Before worker_init_fn: the user's settings win.
    _tuning.tune_worker(most_in_flight(cfg.options.max_concurrency, cfg.num_workers))
    where = f"in DataLoader worker {cfg.worker_id} (pid {os.getpid()})"
    _reseed(cfg.base_seed + cfg.worker_id, cfg.worker_id)
    _install_worker_info(cfg)
    _metrics.recorder.reset()  # the one engine of this process counts into it
    if cfg.environ is not None:
        # A forkserver child inherits the server's environment, frozen when it started; give
        # it the main process's, as fork and spawn would (AWS_* set after the first loader).
        os.environ.clear()
        os.environ.update(cfg.environ)

    # Set when the main process died: nobody reads the results any more, so a full pipe must
    # not keep this process alive (NOTE [ Data flow and shutdown ]).
    orphaned = threading.Event()

    told = [_storage.PacingMemory()]  # what the main process knows (it sent it, below)

    def put(msg: object) -> None:
        if not done_event.is_set() and not orphaned.is_set():
            if isinstance(msg, Result | Failure) and msg.stats is not None:
                # What this worker's connections learned goes with its stats (at most every
                # few tenths of a second), when it changed: beside them, not in them.
                known = _storage.pacing_snapshot()
                if known != told[0]:
                    told[0] = known
                    msg = dataclasses.replace(msg, pacing=known)
            result_queue.put(pack(msg) if isinstance(msg, Result) else msg)

    if cfg.shm_token:
        _shm.install_pool(cfg.shm_token, max_blocks=cfg.shm_blocks, min_bytes=INLINE_MAX)
    try:
        _storage.import_config(
            cfg.storage_config,
            pool_size=most_in_flight(cfg.options.max_concurrency, cfg.num_workers),
            sharers=cfg.num_workers,
        )
        told[0] = _storage.pacing_snapshot()
        if cfg.worker_init_fn is not None:
            cfg.worker_init_fn(cfg.worker_id)
        _storage.forget_stale_clients()  # what a standby built, unless the environment changed
    except Exception as exc:
        put(Failure(-1, 0, cfg.worker_id, RemoteError.capture(exc, f"{where} during start-up")))
        _finish_queue(result_queue, done_event.is_set())
        return

    # Everything alive now (torch, the dataset, its URL arrays) lives as long as the worker:
    # move it out of the cyclic collector's reach. Each full collection would otherwise walk
    # every object torch created, and writing their headers is copy-on-write under fork.
    # Measured on the 50 ms benchmark: ~10% less worker CPU per sample.
    gc.freeze()

    def start_reader(loop: asyncio.AbstractEventLoop, inbox: asyncio.Queue[object]) -> None:
        threading.Thread(
            target=_reader,
            args=(index_queue, loop, inbox, done_event, cfg.main_pid, orphaned),
            name="asyncload-reader",
            daemon=True,
        ).start()

    try:
        run_engine(cfg, put, where, f"asyncload-w{cfg.worker_id}", start_reader, _metrics.recorder)
    finally:
        _finish_queue(result_queue, done_event.is_set() or orphaned.is_set())
    if orphaned.is_set():
        # No one will terminate us: don't wait at exit for a thread-pool fetch that may block
        # for ever (a sync __getitem__ stuck in I/O).
        os._exit(0)


def _await_config(standing: Standing, index_queue: Any, done_event: Any) -> Any:
    """A standby worker's wait for its pickled config; ``None`` when told to stop instead."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _parent_watch.watch_parent(standing.main_pid)
    # What every worker does first and needs no config for, done while nobody waits: a new
    # process's first seeding alone takes ~2 ms (its pages are copied on first write), an
    # obstore client 7-17 ms.
    torch.set_num_threads(1)
    _reseed(0, 0)
    if standing.environ is not None:  # clients read it: build them under the pass's, most likely
        os.environ.clear()
        os.environ.update(standing.environ)
    if standing.storage is not None:
        try:
            _storage.prewarm(standing.storage, standing.pool_size)
        except Exception:  # the pass builds its clients itself, and reports what fails
            pass
    while not done_event.is_set():
        try:
            _, msg = index_queue.get(timeout=POLL_INTERVAL)
        except queue.Empty:
            continue
        if msg is None:  # releases only (none yet): what the queue was opened with
            continue
        if isinstance(msg, bytes):
            return pickle.loads(msg)  # what Shipped became, as if it came with the process
        return None  # Shutdown
    return None


def run_engine(
    cfg: WorkerConfig,
    put: Callable[[object], None],
    where: str,
    thread_prefix: str,
    started: Callable[[asyncio.AbstractEventLoop, asyncio.Queue[object]], None],
    recorder: _metrics.Recorder,
) -> None:
    """Run an ``Engine`` on a new event loop in this thread until it gets ``Shutdown``.

    ``started(loop, inbox)`` is called once the engine can take messages; the caller feeds
    ``inbox`` through ``loop.call_soon_threadsafe``. Storage clients of the loop are closed and
    its thread pool released however the engine ends.
    """
    loop = new_event_loop()
    threads = min(32, most_in_flight(cfg.options.max_concurrency, cfg.num_workers))
    pool = _ContextPool(max_workers=threads, thread_name_prefix=thread_prefix)
    loop.set_default_executor(pool)
    asyncio.set_event_loop(loop)
    monitor = _watchdog.start_monitor(loop, put, cfg.worker_id)  # asyncload-guard hook
    watch = _sample_watch.start_sample_watch(loop, put, cfg.worker_id)
    # Decode and transforms (asyncload.cpu) run here, sized to the worker's share of the cores.
    lane_threads = cfg.options.cpu_threads or _cpu.default_threads(cfg.num_workers)
    lane = _cpu.CpuLane(lane_threads, name=f"{thread_prefix}-cpu")
    try:
        engine = loop.run_until_complete(_make_engine(cfg, put, where, recorder))
        inbox: asyncio.Queue[object] = asyncio.Queue()
        started(loop, inbox)
        # The engine's tasks copy this context: the lane, and the loop's turns that a read
        # yields to before an inline decode (_control/turns.py).
        loop_turns = _turns.LoopTurns(loop=loop, priority=_cpu.priority.get)
        with _cpu.using(lane), _turns.using(loop_turns):
            loop.run_until_complete(engine.run(inbox))
    finally:
        lane.shutdown(wait=False, cancel_futures=True)
        if monitor is not None:  # asyncload-guard hook
            monitor.stop()
        if watch is not None:
            watch.stop()
        try:
            # Async generators the engine left suspended (a dataset's, cut off by Shutdown)
            # run their finally blocks in this loop, not at a garbage collection without it.
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(_storage.aclose())
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
            loop.close()


async def _make_engine(
    cfg: WorkerConfig, put: Callable[[object], None], where: str, recorder: _metrics.Recorder
) -> Engine:
    return Engine(cfg, put, where, recorder)  # created inside the loop: its primitives bind to it


# ThreadPoolExecutor's work item as 3.10-3.13 build it (future, fn, args, kwargs); 3.14 changed
# it, and there _ContextPool falls back to the stock submit.
_WORK_ITEM_ARGS = ("future", "fn", "args", "kwargs")
_OWN_SUBMIT = tuple(inspect.signature(_futures_thread._WorkItem).parameters) == _WORK_ITEM_ARGS


class _ContextPool(concurrent.futures.ThreadPoolExecutor):
    """The loop's default executor: runs each call in the context it was submitted from, as
    ``asyncio.to_thread`` does, so a sync ``__getitem__``'s storage reads count for the engine
    that ran it (``_metrics.current()``).

    Its ``submit`` does not take ``concurrent.futures``' process-wide shutdown lock, which the
    stock one holds while it starts a new thread. A thread start can wait on threading's own
    lock, held by a thread that a garbage collection caught inside ``Thread.start`` (running
    finalizers there); every engine loop of the process that submitted meanwhile then waited on
    the shared lock, and so did the interpreter's exit (``tests/_scripts/finalizers.py`` hung so
    under load: dozens of loop threads stuck in ``submit``). With a lock of its own, one pool
    waits at worst, and exit does not.
    """

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
        if not _OWN_SUBMIT:
            return super().submit(call)
        if _futures_thread._shutdown:  # read without its lock: a flag that only turns on
            raise RuntimeError("cannot schedule new futures after interpreter shutdown")
        with self._shutdown_lock:
            if self._broken:
                raise _futures_thread.BrokenThreadPool(self._broken)
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            future: concurrent.futures.Future[Any] = concurrent.futures.Future()
            self._work_queue.put(_futures_thread._WorkItem(future, call, (), {}))
            self._adjust_thread_count()  # the stock helper: starts a thread if none is idle
        return future


def _finish_queue(result_queue: Any, abandoned: bool) -> None:
    # After shutdown nobody reads the result queue: don't let its feeder thread block our exit.
    if abandoned:
        result_queue.cancel_join_thread()
    result_queue.close()


# ── num_workers=0: the same engine in a thread ────────────────────────────────────────────────


class ThreadWorker:
    """Runs an ``Engine`` on its own event loop in a daemon thread of the main process."""

    def __init__(self, cfg: WorkerConfig, recorder: _metrics.Recorder) -> None:
        self.results: queue.Queue[object] = queue.Queue()
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inbox: asyncio.Queue[object] | None = None
        self._cfg = cfg
        self._recorder = recorder
        self._thread = threading.Thread(target=self._main, name="asyncload-loop", daemon=True)
        self._thread.start()
        self._ready.wait()

    def _main(self) -> None:
        def started(loop: asyncio.AbstractEventLoop, inbox: asyncio.Queue[object]) -> None:
            self._loop, self._inbox = loop, inbox
            self._ready.set()

        try:
            where = "in the DataLoader's loop thread"
            # The loop's clients admit the engine's requests in flight, as a worker's do; the
            # process's other readers keep their pool size.
            cfg = self._cfg
            pool = max(
                _storage.pool_size(), most_in_flight(cfg.options.max_concurrency, cfg.num_workers)
            )
            with _storage.pool_size_here(pool):
                run_engine(cfg, self.results.put, where, "asyncload-t", started, self._recorder)
        finally:
            self._ready.set()  # also when the engine could not start

    def send(self, msg: object) -> None:
        loop, inbox = self._loop, self._inbox
        if loop is not None and inbox is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(inbox.put_nowait, msg)
            except RuntimeError:  # loop closed between the check and the call
                pass

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
