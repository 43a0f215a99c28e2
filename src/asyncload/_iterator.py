"""One pass over a DataLoader: sampler → workers → reorder → training loop.

The main process runs the sampler, hands index batches to workers round-robin (as torch does),
keeps ``max_outstanding`` batches sent but not yet yielded, restores sampler order when
``in_order=True``, and records progress for checkpoints. See NOTE [ Data flow and shutdown ] in
``_protocol.py`` for the processes and queues; :meth:`_LoaderIter._shutdown` implements its
shutdown protocol.
"""

from __future__ import annotations

import atexit
import itertools
import os
import queue
import signal
import threading
import time
import warnings
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.utils.data

from . import _sharding, _shm, _stats, _storage
from ._context import diagnose_pickling, resolve_context
from ._exceptions import BatchTimeout, WorkerError
from ._guards import Shipped
from ._pin_memory import PinMemoryThread, accelerator_device, pin
from ._protocol import (
    POLL_INTERVAL,
    Exhausted,
    Failure,
    IndexTask,
    IterTask,
    Result,
    Resume,
    ResumeAck,
    Shutdown,
)
from ._queues import unpack
from ._resume import Progress, ResumePoint, capture_rng, restore_rng
from ._watchdog import StallBoard
from ._worker import ThreadWorker, WorkerConfig, worker_main

if TYPE_CHECKING:
    from ._loader import DataLoader

__all__ = ["LoaderIter", "Tally"]

# Seconds to wait for a worker to exit on its own before terminate(), then kill().
_JOIN_TIMEOUT = 5.0


_live: weakref.WeakSet[LoaderIter] = weakref.WeakSet()


@atexit.register
def _shutdown_all() -> None:
    for it in list(_live):
        it._shutdown()


class Tally:
    """What one pass has done so far; outlives its iterator so stats() works after the loop."""

    __slots__ = ("batches", "ended", "in_thread", "started", "wait_s", "workers")

    def __init__(self, num_workers: int, in_thread: bool) -> None:
        self.started = time.monotonic()
        self.ended: float | None = None
        self.batches = 0
        self.wait_s = 0.0
        self.in_thread = in_thread
        self.workers: list[_stats.RecorderSnapshot | None] = [None] * num_workers

    def stats(self) -> _stats.LoaderStats:
        if self.in_thread:
            snaps = [_stats.recorder.snapshot()]
        else:
            snaps = [s for s in self.workers if s is not None]
        return _stats.merge(
            snaps,
            started=self.started,
            batches=self.batches,
            wait_s=self.wait_s,
            ended=self.ended,
        )


class _SampleFailed(Exception):
    """Carries a batch's error out of ``_next_data`` without ending the pass."""

    def __init__(self, error: BaseException) -> None:
        super().__init__()
        self.error = error


_SKIP = object()  # a reorder-buffer slot whose task produced nothing (iterable exhausted)


class LoaderIter:
    """One pass (or, with persistent workers, every pass) over a DataLoader."""

    def __init__(self, loader: DataLoader[Any]) -> None:
        # First, so that __del__ → _shutdown works whatever point __init__ fails at.
        self._shut = False
        self._lock = threading.Lock()
        self._workers: list[Any] = []
        self._pin_thread: PinMemoryThread | None = None
        # No reference to the loader: it holds persistent iterators, and a cycle would keep
        # workers alive until the garbage collector runs.
        self._len = len(loader) if hasattr(loader.dataset, "__len__") else None
        self._is_iterable = isinstance(loader.dataset, torch.utils.data.IterableDataset)
        self._auto_collation = loader._auto_collation
        self._index_sampler = loader._index_sampler
        self._in_order = loader.in_order
        self._timeout = float(loader.timeout)
        self._persistent = loader.persistent_workers
        self._process_mode = loader.num_workers > 0
        self._loader_num_workers = loader.num_workers
        self._num_workers = max(1, loader.num_workers)
        self._max_outstanding = loader._outstanding_per_worker * self._num_workers
        self._generation = 0
        self._last_check = time.monotonic()
        self._stalls = StallBoard()  # asyncload-guard hook: workers' blocked event loops

        if loader.pin_memory and loader.pin_memory_device:
            warnings.warn(
                "pin_memory_device is deprecated, the current accelerator will be used as the "
                f"device, ignore pin_memory_device='{loader.pin_memory_device}'.",
                stacklevel=3,
            )
        self._pin_device = accelerator_device() if loader.pin_memory else None
        if loader.pin_memory and self._pin_device is None:
            _warn_no_accelerator()

        self._generator = loader.generator
        resume, loader._resume = loader._resume, None
        self._resume = resume
        # Torch draws the workers' base seed before the sampler draws its own randomness; a
        # checkpoint records the RNG state between the two, which is where every pass's sampler
        # starts (persistent workers draw no new base seed), so a restore replays the sampler.
        if resume is None:
            self._base_seed = int(
                torch.empty((), dtype=torch.int64).random_(generator=loader.generator).item()
            )
        else:
            self._base_seed = resume.base_seed
            restore_rng(self._generator, resume.rng)
        self._rng_state = capture_rng(self._generator)
        self._sampler_iter: Iterator[Any] = iter(self._index_sampler)
        per_batch = loader.batch_size if self._auto_collation and loader.batch_size else 1
        skips = [0] * self._num_workers
        if resume is not None and self._is_iterable:
            skips = [n * per_batch for n in resume.progress.worker_batches]
        self._finished = False
        self.tally = Tally(self._num_workers, in_thread=not self._process_mode)

        rank, world = _sharding.rank_and_world_size()
        storage_config = _storage.export_config()
        # One shared-memory block pool per worker process (NOTE [ Reused shared memory ]): a
        # batch in flight or kept by the loop holds a block or two; beyond that, torch's path.
        self._shm_tokens = [
            f"{os.getpid()}-{id(self):x}-{i}-{os.urandom(4).hex()}" if self._process_mode else ""
            for i in range(self._num_workers)
        ]
        for token in self._shm_tokens:
            if token:
                _shm.register_token(token)
        shm_blocks = 4 * loader._outstanding_per_worker + 8
        environ = dict(os.environ) if self._process_mode else None
        configs = [
            WorkerConfig(
                worker_id=i,
                num_workers=loader.num_workers if self._process_mode else 1,
                base_seed=self._base_seed,
                dataset=loader.dataset,
                is_iterable=self._is_iterable,
                auto_collation=self._auto_collation,
                batch_size=loader.batch_size,
                drop_last=loader.drop_last,
                collate_fn=loader.collate_fn,
                worker_init_fn=loader.worker_init_fn,
                max_concurrency=loader.max_concurrency,
                rank=rank,
                world_size=world,
                storage_config=storage_config,
                main_pid=os.getpid(),
                environ=environ,
                skip=skips[i],
                shm_token=self._shm_tokens[i],
                shm_blocks=shm_blocks,
            )
            for i in range(self._num_workers)
        ]
        _live.add(self)
        if self._process_mode:
            self._start_processes(loader, configs)
        else:
            _stats.recorder.reset()  # this pass's loop thread is the only writer now
            # The loop thread's HTTP pool must admit max_concurrency requests, as a worker's does.
            _storage.set_pool_size(max(_storage.pool_size(), loader.max_concurrency))
            worker = ThreadWorker(configs[0])
            self._workers.append(worker)
            self._replies: Any = worker.results
        self._reset(first=True)

    # ── start-up ───────────────────────────────────────────────────────────────────────────

    def _start_processes(self, loader: DataLoader[Any], configs: list[WorkerConfig]) -> None:
        objects = {
            "dataset": loader.dataset,
            "collate_fn": loader.collate_fn,
            "worker_init_fn": loader.worker_init_fn,
        }
        # asyncload-guard hook: objects let the start method be checked against __main__.
        ctx = resolve_context(loader.multiprocessing_context, objects)
        self._done_event = ctx.Event()
        self._result_queue = ctx.Queue()
        self._index_queues: list[Any] = []
        try:
            for cfg in configs:
                index_queue = ctx.Queue()
                # Fail fast (or keep going) regardless of a Ctrl-C the main process handles.
                index_queue.cancel_join_thread()
                proc = ctx.Process(  # type: ignore[attr-defined]
                    target=worker_main,
                    # asyncload-guard hook: a worker that can't unpickle cfg says so.
                    args=(
                        Shipped(cfg, ctx.get_start_method()),
                        index_queue,
                        self._result_queue,
                        self._done_event,
                    ),
                    name=f"asyncload-worker-{cfg.worker_id}",
                    daemon=True,
                )
                try:
                    proc.start()
                except Exception as exc:
                    if isinstance(exc, (OSError, RuntimeError)) and not _is_pickling_error(exc):
                        raise
                    raise diagnose_pickling(objects, ctx.get_start_method(), exc) from exc
                self._index_queues.append(index_queue)
                self._workers.append(proc)
        except BaseException:
            self._shutdown()
            raise
        if self._pin_device is not None:
            self._pin_thread = PinMemoryThread(self._result_queue, self._pin_device)
            self._replies = self._pin_thread.out
        else:
            self._replies = self._result_queue

    def _reset(self, first: bool, epoch: int | None = None) -> None:
        """Start a pass: torch's ``_reset``. With persistent workers, every later epoch too."""
        if not first:
            self._resume = None
            self.tally = Tally(self._num_workers, in_thread=False)
            self._rng_state = capture_rng(self._generator)
            self._sampler_iter = iter(self._index_sampler)
            self._generation += 1
            self._finished = False
            for i in range(self._num_workers):
                self._send(i, Resume(self._generation, epoch, self._freed(i)))
            acks = 0
            while acks < self._num_workers:  # drop replies of the old pass until every ack
                msg = self._get()
                if isinstance(msg, ResumeAck) and msg.generation == self._generation:
                    acks += 1
        resume = self._resume
        # send_idx is the batch's ordinal in the pass, also across a checkpoint and restore.
        if resume is None:
            self._progress = Progress(self._num_workers)
        elif self._is_iterable:  # only the per-worker counts matter; ordinals restart at 0
            self._progress = Progress(
                self._num_workers, worker_batches=list(resume.progress.worker_batches)
            )
        else:
            self._progress = resume.progress
        self._send_idx = 0
        self._rcvd_idx = 0
        self._pending: dict[int, int] = {}  # send_idx → worker id, sent and not yet answered
        self._ready: dict[int, Any] = {}  # send_idx → reply, answered and not yet yielded
        self._sent_indices: dict[int, Any] = {}  # send_idx → indices, only with timeout > 0
        self._active = [True] * self._num_workers
        start = 0
        if resume is not None and self._is_iterable:
            # Every worker restarts active: one that had run dry skips its share and says so.
            start = sum(self._progress.worker_batches) % self._num_workers
        elif resume is not None:
            for _ in itertools.islice(self._sampler_iter, self._progress.watermark):
                pass
            self._send_idx = self._rcvd_idx = self._progress.watermark
        self._cycle = itertools.islice(itertools.cycle(range(self._num_workers)), start, None)
        self._sampler_done = False
        self._refill()
        # The training loop waits through start-up too (workers, first requests).
        self.tally.wait_s = time.monotonic() - self.tally.started

    # ── iteration ──────────────────────────────────────────────────────────────────────────

    def __iter__(self) -> LoaderIter:
        return self

    @property
    def is_shut_down(self) -> bool:
        return self._shut

    def __len__(self) -> int:
        if self._len is None:
            raise TypeError("this DataLoader's dataset has no __len__")
        return self._len

    def __next__(self) -> Any:
        t0 = time.monotonic()
        try:
            data = self._next_data()
        except StopIteration:
            self._finished = True
            self.tally.ended = time.monotonic()
            if not self._persistent:
                self._shutdown()
            raise
        except _SampleFailed as failed:
            # One batch failed in the dataset or collate_fn: the workers are fine and the pass
            # goes on, as in torch (catch it and call next() again).
            # `from` keeps the worker's traceback as the cause and hides _SampleFailed.
            raise failed.error from failed.error.__cause__
        except BaseException:
            self._shutdown()
            raise
        self.tally.wait_s += time.monotonic() - t0
        self.tally.batches += 1
        return data

    def _refill(self) -> None:
        """Send tasks until ``max_outstanding`` are out or the sampler is done."""
        while self._try_put_index():
            pass

    def _try_put_index(self) -> bool:
        if self._sampler_done or len(self._pending) + len(self._ready) >= self._max_outstanding:
            return False
        for _ in range(self._num_workers):
            worker_id = next(self._cycle)
            if self._active[worker_id]:
                break
        else:
            return False
        while True:
            try:
                index = next(self._sampler_iter)
            except StopIteration:
                self._sampler_done = True
                return False
            if self._is_iterable or not self._progress.is_done(self._send_idx):
                break
            # Yielded before the checkpoint (out of order): skip it, keep ordinals aligned.
            if self._in_order:
                self._ready[self._send_idx] = _SKIP
            self._send_idx += 1
        freed = self._freed(worker_id)
        if self._is_iterable:
            msg: object = IterTask(self._send_idx, self._generation, freed)
        else:
            # Only index *batches* become arrays; with batch_size=None the dataset gets the
            # sampler's element unchanged, as in torch (a list stays a list).
            index = _compact(index) if self._auto_collation else index
            msg = IndexTask(self._send_idx, self._generation, index, freed)
        self._send(worker_id, msg)
        self._pending[self._send_idx] = worker_id
        if self._timeout > 0 and not self._is_iterable:  # to name stuck samples on a timeout
            self._sent_indices[self._send_idx] = index
        self._send_idx += 1
        return True

    def _next_data(self) -> Any:
        while True:
            if self._in_order:
                while self._rcvd_idx in self._ready:
                    reply: Any = self._ready.pop(self._rcvd_idx)
                    self._rcvd_idx += 1
                    if reply is not _SKIP:
                        self._refill()
                        return self._unwrap(reply)
            if not self._pending:
                self._refill()
                if not self._pending:
                    raise StopIteration
            msg = self._get()
            if isinstance(msg, ResumeAck) or msg.generation != self._generation:
                continue
            if isinstance(msg, Failure) and msg.send_idx < 0:
                msg.error.reraise()
            self._pending.pop(msg.send_idx, None)
            self._sent_indices.pop(msg.send_idx, None)
            if isinstance(msg, Result | Failure) and msg.stats is not None:
                self.tally.workers[msg.worker_id] = msg.stats
            reply = msg
            if isinstance(msg, Exhausted):
                self._active[msg.worker_id] = False
                reply = _SKIP
            if self._in_order:
                self._ready[msg.send_idx] = reply
            elif reply is not _SKIP:
                self._refill()
                return self._unwrap(reply)

    def _unwrap(self, msg: Result | Failure) -> Any:
        # A failed batch counts as consumed: the training loop saw its error.
        self._progress.mark(msg.send_idx, msg.worker_id if self._is_iterable else None)
        if self._pin_device is not None and not self._process_mode and isinstance(msg, Result):
            msg = pin(msg, self._pin_device)
        if isinstance(msg, Failure):
            raise _SampleFailed(msg.error.exception())
        return msg.data

    def checkpoint(self, epoch: int | None) -> ResumePoint:
        p = self._progress
        return ResumePoint(
            iterable=self._is_iterable,
            num_workers=self._loader_num_workers,
            epoch=epoch,
            rng=self._rng_state,
            base_seed=self._base_seed,
            progress=Progress(p.num_workers, p.watermark, set(p.extra), list(p.worker_batches)),
            finished=self._finished,
        )

    def _freed(self, worker_id: int) -> tuple[int, ...]:
        """Blocks of this worker's pool that the main process is done with (see ``_shm``)."""
        token = self._shm_tokens[worker_id]
        return _shm.take_freed(token) if token else ()

    def _send(self, worker_id: int, msg: object) -> None:
        if self._process_mode:
            self._index_queues[worker_id].put(msg)
        else:
            self._workers[worker_id].send(msg)

    def _get(self) -> Any:
        """Next reply from any worker; raises if a worker died or ``timeout`` passed."""
        deadline = time.monotonic() + self._timeout if self._timeout > 0 else None
        while True:
            wait = POLL_INTERVAL
            if deadline is not None:
                wait = min(wait, max(deadline - time.monotonic(), 0.0))
            try:
                msg = unpack(self._replies.get(timeout=wait))
            except queue.Empty:
                msg = None
            except Exception as exc:
                # Unpickling asks the sending worker for its shared memory: if that worker
                # just died, say so (with its pid and signal) rather than "connection reset".
                self._raise_if_a_worker_died(exc)
                raise
            if self._stalls.take(msg):  # asyncload-guard hook: a blocked loop, warned about
                continue
            if isinstance(msg, BaseException):  # the pin-memory thread could not unpack
                self._raise_if_a_worker_died(msg)
                raise msg
            if isinstance(msg, Failure):
                return msg  # before the liveness check: a worker may exit right after it
            now = time.monotonic()
            # Also while replies flow: other workers' batches must not hide a dead one.
            if msg is None or now - self._last_check >= POLL_INTERVAL:
                self._last_check = now
                self._check_alive()
            if msg is not None:
                return msg
            if deadline is not None and time.monotonic() >= deadline:
                stalled = self._stalls.describe()  # asyncload-guard hook
                raise BatchTimeout(
                    f"DataLoader timed out after {self._timeout} seconds"
                    + (
                        f": {stalled}. The training loop waited for "
                        if stalled
                        else " waiting for "
                    )
                    + f"{self._describe_waiting()}. Raise timeout=, or look at loader.stats() "
                    "for slow requests and retries."
                )

    def _describe_waiting(self) -> str:
        """The batch the training loop waits for: its worker and, map-style, its samples."""
        idx = self._rcvd_idx if self._in_order and self._rcvd_idx in self._pending else None
        if idx is None and self._pending:
            idx = min(self._pending)
        if idx is None:  # no batch outstanding: a new epoch's acknowledgements
            return "the workers to start the next epoch"
        text = f"batch {idx} from worker {self._pending[idx]}"
        indices = self._sent_indices.get(idx)
        if indices is not None:
            shown = indices.tolist() if isinstance(indices, np.ndarray) else indices
            text += f" (sample indices {shown!r})"
        return text

    def _raise_if_a_worker_died(self, cause: BaseException) -> None:
        deadline = time.monotonic() + 1.0
        while True:  # a worker killed a moment ago may not have been reaped yet
            try:
                self._check_alive()
            except WorkerError as exc:
                raise exc from cause
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def _check_alive(self) -> None:
        if self._pin_thread is not None and not self._pin_thread.is_alive():
            raise WorkerError("the pin-memory thread exited unexpectedly")
        for worker_id, w in enumerate(self._workers):
            if w.is_alive():
                continue
            if not self._process_mode:
                raise WorkerError("the DataLoader's event-loop thread exited unexpectedly")
            code = w.exitcode
            how = f"exit code {code}"
            if code is not None and code < 0:
                try:
                    how = f"signal {-code} ({signal.Signals(-code).name})"
                except ValueError:
                    how = f"signal {-code}"
            hint = (
                " SIGKILL often means the out-of-memory killer: lower max_concurrency or "
                "num_workers, or check `dmesg`."
                if code == -signal.SIGKILL
                else ""
            )
            raise WorkerError(
                f"DataLoader worker {worker_id} (pid {w.pid}) exited unexpectedly "
                f"with {how}.{hint}",
                worker_id=worker_id,
                pid=w.pid,
                exitcode=code,
            )

    # ── shutdown: NOTE [ Data flow and shutdown ] in _protocol.py ──────────────────────────

    def _shutdown(self) -> None:
        with self._lock:
            if self._shut:
                return
            self._shut = True
        _live.discard(self)
        tally = getattr(self, "tally", None)  # absent if __init__ failed early
        if tally is not None and tally.ended is None:
            tally.ended = time.monotonic()
        if not getattr(self, "_process_mode", True):
            for w in self._workers:
                w.send(Shutdown())
            for w in self._workers:
                w.join(_JOIN_TIMEOUT)
            return
        if self._pin_thread is not None:
            self._pin_thread.stop()
        done_event = getattr(self, "_done_event", None)
        if done_event is not None:
            done_event.set()
        for q in getattr(self, "_index_queues", []):
            try:
                q.put(Shutdown())
            except (OSError, ValueError):  # queue already closed
                pass
        deadline = time.monotonic() + _JOIN_TIMEOUT
        for w in self._workers:
            w.join(max(deadline - time.monotonic(), 0.0))
        for w in self._workers:
            if w.is_alive():
                w.terminate()
                w.join(1.0)
            if w.is_alive():  # pragma: no cover - SIGTERM ignored
                w.kill()
                w.join(1.0)
        for q in [*getattr(self, "_index_queues", []), getattr(self, "_result_queue", None)]:
            if q is not None:
                q.cancel_join_thread()
                q.close()
        for token in getattr(self, "_shm_tokens", []):
            if token:
                _shm.unregister_token(token)

    def __del__(self) -> None:
        self._shutdown()


def _compact(index: Any) -> Any:
    """Index batches travel as int64 arrays: small to pickle, no per-int Python objects."""
    if isinstance(index, list) and index and all(type(i) is int for i in index):
        return np.asarray(index, dtype=np.int64)
    return index


def _is_pickling_error(exc: BaseException) -> bool:
    text = f"{type(exc).__name__}: {exc}".lower()
    return "pickl" in text


_warned_pin = False


def _warn_no_accelerator() -> None:
    global _warned_pin
    if not _warned_pin:
        _warned_pin = True
        warnings.warn(
            "'pin_memory' argument is set as true but no accelerator is found, "
            "then device pinned memory won't be used.",
            stacklevel=5,
        )
