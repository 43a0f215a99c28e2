"""One pass over a DataLoader: sampler → workers → reorder → training loop.

The loader builds a frozen ``PassSpec`` and hands it, with the resume point, to a
``Pass``; the pass never sees the loader. It draws the seeds, sends index batches to its
``_workers.Workers`` round-robin (as torch does), keeps batches sent but not yet yielded
within a memory bound (``_lookahead``: the workers fetch on behind a straggling batch),
restores sampler order when ``in_order=True`` and records progress for checkpoints. A pass
starts in ``Pass.__init__`` (or ``Pass.restart`` with persistent workers) and ends in
``Pass.close``, nowhere else. Its workers live exactly as long as it does. See
NOTE [ Data flow and shutdown ] in ``_protocol.py``.
"""

from __future__ import annotations

import atexit
import enum
import itertools
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.utils.data

from . import _workers
from ._budget import Budget
from ._exceptions import BatchTimeout
from ._lookahead import LookAhead, batch_nbytes
from ._protocol import (
    POLL_INTERVAL,
    Exhausted,
    Failure,
    IndexTask,
    IterTask,
    PassStarted,
    Result,
    StartPass,
)
from ._resume import Progress, ResumePoint, capture_rng, restore_rng
from ._spec import PassSpec, length_warning, spec_length
from ._stats import Tally
from ._watchdog import StallBoard
from ._workers import Workers

__all__ = ["Pass", "PassSpec", "State"]


class State(enum.Enum):
    RUNNING = "running"
    """Batches are being fetched and yielded."""
    EXHAUSTED = "exhausted"
    """Every batch was yielded; with persistent workers, ``Pass.restart`` starts another."""
    CLOSED = "closed"
    """The workers are stopped; the pass can't be used again."""


StartWorkers = Callable[..., Workers]
"""``start(spec, *, base_seed, skips, shared_seed) -> Workers``: ``_workers.start_workers``."""

_live: weakref.WeakSet[Pass] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for p in list(_live):
        p.close()


_SKIP = object()  # a reorder-buffer slot whose task produced nothing (iterable exhausted)


class Pass:
    """One pass (or, with persistent workers, every pass) of a DataLoader; its iterator.

    Args:
        spec: The loader's settings.
        resume: Where to continue a checkpointed pass, or ``None``.
        len_reported: ``len(loader)`` of an iterable dataset, if the caller asked for it
            (torch warns when more batches arrive).
        start_workers: Builds the workers (tests pass a fake).
    """

    def __init__(
        self,
        spec: PassSpec,
        *,
        resume: ResumePoint | None = None,
        len_reported: int | None = None,
        start_workers: StartWorkers | None = None,
    ) -> None:
        # First, so that close() works whatever point __init__ fails at.
        self.state = State.RUNNING
        self._workers: Workers | None = None
        self.spec = spec
        self.tally = Tally(max(1, spec.num_workers), None)
        self._len_reported = len_reported
        self._num_workers = max(1, spec.num_workers)
        self._generation = 0
        self._stalls = StallBoard()  # workers' blocked event loops (see _watchdog)
        # torch draws an IterDataPipe's shared seed first, then the workers' base seed. A
        # checkpoint records the RNG state after both, where every pass's sampler starts
        # (persistent workers draw no new base seed), so a restore replays the sampler.
        shared_seed = self._draw_shared_seed()
        if resume is None:
            self._base_seed = int(
                torch.empty((), dtype=torch.int64).random_(generator=spec.generator).item()
            )
        else:
            self._base_seed = resume.base_seed
            restore_rng(spec.generator, resume.rng)
        per_batch = spec.batch_size if spec.auto_collation and spec.batch_size else 1
        skips = [0] * self._num_workers
        if resume is not None and spec.is_iterable:
            skips = [n * per_batch for n in resume.progress.worker_batches]
        _live.add(self)
        try:
            self._workers = (start_workers or _workers.start_workers)(
                spec, base_seed=self._base_seed, skips=skips, shared_seed=shared_seed
            )
            self.tally = Tally(self._num_workers, self._workers.live_stats)
            self._begin(resume)
        except BaseException:
            self.close()
            raise

    # ── the two ways a pass starts ─────────────────────────────────────────────────────────────

    def restart(self, epoch: int | None, len_reported: int | None) -> None:
        """Start the next pass on the same (persistent) workers: the start-pass handshake."""
        if self.state is State.CLOSED:
            raise RuntimeError("this DataLoader pass was closed; iter(loader) starts a new one")
        workers = self._require_workers()
        try:
            self.state = State.RUNNING
            self._len_reported = len_reported
            self.tally = Tally(self._num_workers, workers.live_stats)
            shared_seed = self._draw_shared_seed()
            self._generation += 1
            for i in range(self._num_workers):
                workers.send(i, StartPass(self._generation, epoch, shared_seed))
            acks = 0
            while acks < self._num_workers:  # drop replies of the old pass until every ack
                msg = self._get()
                if isinstance(msg, PassStarted) and msg.generation == self._generation:
                    acks += 1
            self._begin(None)
        except BaseException:  # e.g. a worker died between epochs: next time, new ones
            self.close()
            raise

    def _begin(self, resume: ResumePoint | None) -> None:
        spec = self.spec
        self._rng_state = capture_rng(spec.generator)
        self._sampler_iter: Iterator[Any] = iter(spec.index_sampler)
        self._num_yielded = 0
        # send_idx is the batch's ordinal in the pass, also across a checkpoint and restore.
        if resume is None:
            self._progress = Progress(self._num_workers)
        elif spec.is_iterable:  # only the per-worker counts matter; ordinals restart at 0
            self._progress = Progress(
                self._num_workers,
                worker_batches=list(resume.progress.worker_batches),
                delivered=resume.progress.delivered.copy(),
            )
        else:
            self._progress = resume.progress
        self._send_idx = 0
        self._rcvd_idx = 0
        self._pending: dict[int, int] = {}  # send_idx → worker id, sent and not yet answered
        self._ready: dict[int, Any] = {}  # send_idx → reply, answered and not yet yielded
        self._sent_indices: dict[int, Any] = {}  # send_idx → indices, only with timeout > 0
        self._held: dict[int, int] = {}  # send_idx → bytes, of batches waiting in _ready
        self._lookahead = LookAhead(
            self.spec.outstanding_per_worker * self._num_workers, self.spec.prefetch_bytes
        )
        self._active = [True] * self._num_workers
        start = 0
        if resume is not None and spec.is_iterable:
            # Every worker restarts active: one that had run dry skips its share and says so.
            start = sum(self._progress.worker_batches) % self._num_workers
        elif resume is not None:
            for _ in itertools.islice(self._sampler_iter, self._progress.watermark):
                pass
            self._send_idx = self._rcvd_idx = self._progress.watermark
        self._cycle = itertools.islice(itertools.cycle(range(self._num_workers)), start, None)
        self._sampler_done = False
        self._budget = Budget(spec.sample_errors)
        self.tally.skipped = self._budget.skipped
        self._refill()
        # The training loop waits through start-up too (workers, first requests).
        self.tally.wait_s = time.monotonic() - self.tally.started

    def _draw_shared_seed(self) -> int | None:
        """torch's shared seed for an ``IterDataPipe``'s shuffles (none for other datasets)."""
        if not isinstance(self.spec.dataset, torch.utils.data.IterDataPipe):
            return None
        seed = torch.empty((), dtype=torch.int64).random_(generator=self.spec.generator)
        return int(seed.item())

    # ── iteration ──────────────────────────────────────────────────────────────────────────────

    def __iter__(self) -> Pass:
        return self

    @property
    def worker_pids(self) -> tuple[int, ...]:
        """The pids of this pass's worker processes (empty with ``num_workers=0``)."""
        return self._workers.pids if self._workers is not None else ()

    def __len__(self) -> int:
        return spec_length(self.spec)

    def __next__(self) -> Any:
        if self.state is State.CLOSED:
            raise RuntimeError(
                "this DataLoader pass was closed (its workers are stopped); "
                "iter(loader) starts a new one"
            )
        if self.state is State.EXHAUSTED:
            raise StopIteration
        t0 = time.monotonic()
        try:
            data = self._next_data()
        except StopIteration:
            self.state = State.EXHAUSTED
            self.tally.ended = time.monotonic()
            if not self.spec.persistent:
                self.close()
            raise
        except BaseException:
            self.close()
            raise
        if isinstance(data, Failure):
            # One batch failed in the dataset or collate_fn: the workers are fine and the pass
            # goes on, as in torch (catch it and call next() again). Raised here, not wrapped:
            # no reference cycle may tie the error to this pass, or an error leaving
            # `for batch in loader` would keep the workers alive until a garbage collection.
            error = data.error.exception()
            try:
                raise error
            finally:
                del error, data
        self.tally.wait_s += time.monotonic() - t0
        self.tally.batches += 1
        self._num_yielded += 1
        if self._len_reported is not None and self._num_yielded > self._len_reported:
            text = length_warning(self.spec, self._len_reported, self._num_yielded)
            warnings.warn(text, stacklevel=2)
        return data

    def _refill(self) -> None:
        """Send tasks until the look-ahead bound is reached or the sampler is done."""
        while self._try_put_index():
            pass

    def _try_put_index(self) -> bool:
        if self._sampler_done or not self._lookahead.may_send(len(self._pending), len(self._ready)):
            return False
        for _ in range(self._num_workers):
            worker_id = next(self._cycle)
            if self._active[worker_id]:
                break
        else:
            return False
        spec = self.spec
        while True:
            try:
                index = next(self._sampler_iter)
            except StopIteration:
                self._sampler_done = True
                return False
            if spec.is_iterable or not self._progress.is_done(self._send_idx):
                break
            # Yielded before the checkpoint (out of order): skip it, keep ordinals aligned.
            if spec.in_order:
                self._ready[self._send_idx] = _SKIP
            self._send_idx += 1
        if spec.is_iterable:
            msg: object = IterTask(self._send_idx, self._generation)
        else:
            # Only index *batches* become arrays; with batch_size=None the dataset gets the
            # sampler's element unchanged, as in torch (a list stays a list).
            index = _compact(index) if spec.auto_collation else index
            msg = IndexTask(self._send_idx, self._generation, index)
        self._require_workers().send(worker_id, msg)
        self._pending[self._send_idx] = worker_id
        if spec.timeout > 0 and not spec.is_iterable:  # to name stuck samples on a timeout
            self._sent_indices[self._send_idx] = index
        self._send_idx += 1
        return True

    def _next_data(self) -> Any:
        in_order = self.spec.in_order
        while True:
            if in_order:
                while self._rcvd_idx in self._ready:
                    reply: Any = self._ready.pop(self._rcvd_idx)
                    held = self._held.pop(self._rcvd_idx, None)
                    if held is not None:
                        self._lookahead.released(held)
                    self._rcvd_idx += 1
                    if reply is not _SKIP:
                        self._refill()
                        if self._count_skipped(reply):
                            return self._unwrap(reply)
            if not self._pending:
                self._refill()
                if not self._pending:
                    raise StopIteration
            # The head batch is late and later ones are done: time the straggler cost.
            t0 = time.monotonic() if self._held else None
            msg = self._get()
            if t0 is not None:
                self.tally.head_wait_s += time.monotonic() - t0
            if isinstance(msg, PassStarted) or msg.generation != self._generation:
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
            if in_order:
                self._ready[msg.send_idx] = reply
                if isinstance(msg, Result):
                    held = msg.send_idx != self._rcvd_idx
                    nbytes = batch_nbytes(msg.data)
                    self._lookahead.arrived(nbytes, held)
                    if held:
                        self._held[msg.send_idx] = nbytes
                        self._refill()  # fetch on behind the late head, within the bound
            elif reply is not _SKIP:
                self._refill()
                if self._count_skipped(reply):
                    return self._unwrap(reply)

    def _count_skipped(self, msg: Result | Failure) -> bool:
        """Charge the samples *msg* left out to the error budget (may raise); ``False`` when
        every sample was left out: nothing to yield, but the batch is consumed."""
        if not isinstance(msg, Result) or msg.sample_count < 0:
            return True
        self._budget.add(msg.sample_count, msg.skipped)
        if msg.sample_count == 0:
            self._unwrap(msg)  # progress: this batch is done
            return False
        return True

    def _unwrap(self, msg: Result | Failure) -> Any:
        # A failed batch counts as consumed: the training loop saw its error.
        self._progress.mark(
            msg.send_idx,
            msg.worker_id if self.spec.is_iterable else None,
            msg.tags if isinstance(msg, Result) else (),
        )
        if isinstance(msg, Failure):
            return msg  # raised by __next__, after this bookkeeping
        return msg.data

    def checkpoint(self, epoch: int | None) -> ResumePoint:
        """Where this pass stands, for ``DataLoader.state_dict()``."""
        p = self._progress
        return ResumePoint(
            iterable=self.spec.is_iterable,
            num_workers=self.spec.num_workers,
            epoch=epoch,
            rng=self._rng_state,
            base_seed=self._base_seed,
            progress=Progress(
                p.num_workers,
                p.watermark,
                set(p.extra),
                list(p.worker_batches),
                p.delivered.copy(),
            ),
            finished=self.state is State.EXHAUSTED,
        )

    def _require_workers(self) -> Workers:
        if self._workers is None:
            raise RuntimeError("this DataLoader pass has no workers (it failed to start)")
        return self._workers

    def _get(self) -> Any:
        """Next reply from any worker; raises if a worker died or ``timeout`` passed."""
        workers = self._require_workers()
        timeout = self.spec.timeout
        deadline = time.monotonic() + timeout if timeout > 0 else None
        while True:
            wait = POLL_INTERVAL
            if deadline is not None:
                wait = min(wait, max(deadline - time.monotonic(), 0.0))
            msg = workers.get(wait)
            if self._stalls.take(msg):  # a blocked loop, warned about
                continue
            if msg is not None:
                return msg
            if deadline is not None and time.monotonic() >= deadline:
                # Name the sample that holds a worker's loop, not a batch that waits behind it.
                stalled = self._stalls.describe()
                waiting = (
                    f": {stalled}. The training loop waited for " if stalled else " waiting for "
                )
                # The number as given ("after 1 seconds"), as torch's message has it.
                raise BatchTimeout(
                    f"DataLoader timed out after {timeout} seconds{waiting}"
                    f"{self._describe_waiting()}. Raise timeout=, or look at loader.stats() "
                    "for slow requests and retries."
                )

    def _describe_waiting(self) -> str:
        """The batch the training loop waits for: its worker and, map-style, its samples."""
        pending = getattr(self, "_pending", {})
        idx = self._rcvd_idx if self.spec.in_order and self._rcvd_idx in pending else None
        if idx is None and pending:
            idx = min(pending)
        if idx is None:  # no batch outstanding: a new epoch's acknowledgements
            return "the workers to start the next epoch"
        text = f"batch {idx} from worker {pending[idx]}"
        indices = self._sent_indices.get(idx)
        if indices is not None:
            shown = indices.tolist() if isinstance(indices, np.ndarray) else indices
            text += f" (sample indices {shown!r})"
        return text

    # ── the one way a pass ends: NOTE [ Data flow and shutdown ] in _protocol.py ──────────────

    def close(self) -> None:
        """Stop the workers (persistent or not); later ``next()`` calls raise RuntimeError."""
        if self.state is State.CLOSED:
            return
        self.state = State.CLOSED
        _live.discard(self)
        if self.tally.ended is None:
            self.tally.ended = time.monotonic()
        if self._workers is not None:
            self._workers.close()

    def __del__(self) -> None:
        if getattr(self, "state", State.CLOSED) is not State.CLOSED:
            self.close()


def _compact(index: Any) -> Any:
    """Index batches travel as int64 arrays: small to pickle, no per-int Python objects."""
    if isinstance(index, list) and index and all(type(i) is int for i in index):
        return np.asarray(index, dtype=np.int64)
    return index
