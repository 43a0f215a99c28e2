"""A pass's traffic with its workers: tasks out round-robin, replies back in sampler order.

``Dispatch`` is the half of ``_pass.Pass`` that sends index batches (or iterable requests) to
the workers within the look-ahead bound (``_loader.lookahead``), takes their replies, puts them
back in sampler order when ``in_order=True``, charges left-out samples to the error budget and marks
progress for checkpoints. ``_get`` waits for the next reply and names the batch the training
loop waits for when ``timeout`` passes. See NOTE [ Data flow and shutdown ] in
``_protocol/messages.py``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from .._checkpoint.resume import Progress, ResumePoint, capture_rng
from .._control import LimitState
from .._dataset.sample_errors import Budget
from .._exceptions import BatchTimeout
from .._protocol.messages import (
    PEERS_EVERY,
    POLL_INTERVAL,
    Exhausted,
    Failure,
    IndexTask,
    IterTask,
    PassStarted,
    Peers,
    Result,
)
from .._stats.loader_stats import Tally
from .._workers import Workers
from .lookahead import LookAhead, batch_nbytes
from .spec import PassSpec
from .stalls import StallBoard

__all__ = ["Dispatch"]

_SKIP = object()  # a reorder-buffer slot whose task produced nothing (iterable exhausted)


class Dispatch:
    """Sends tasks and reorders replies for ``Pass``, which starts and ends the pass."""

    spec: PassSpec
    tally: Tally
    learned: dict[int, LimitState]
    """Where each worker's adaptive limit got to (control data, beside the stats)."""
    _engines: Workers | None
    _num_workers: int
    _generation: int
    _stalls: StallBoard
    _ran_out: bool
    """Every batch of the pass was yielded (also once a non-persistent pass closed)."""

    def _begin(self, resume: ResumePoint | None) -> None:
        spec = self.spec
        self._rng_state = capture_rng(spec.generator)
        self._ran_out = False
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
            self.spec.outstanding_per_worker * self._num_workers,
            self.spec.prefetch_bytes,
            always=(self.spec.always_out_per_worker or self.spec.outstanding_per_worker)
            * self._num_workers,
            sizes=self.spec.batch_sizes,
        )
        self._active = [True] * self._num_workers
        # When each worker last heard what the others learned (_share).
        self._heard_at = [-float("inf")] * self._num_workers
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
                self._require_workers().prepare_next()
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

    def _share(self, source: int, state: LimitState) -> None:
        """Worker *source* reports where its adaptive limit got to: tell the others.

        Workers read the same store, so what one finds (its unloaded latency, a throttle)
        holds for all: a worker whose first round trips were loaded learns the true latency
        from one that probed, and a throttle cuts every worker's limit, not one at a time.
        Each worker hears at most every ``PEERS_EVERY`` seconds, unless the report is news
        (a worker's first, a throttle: ``LimitController.news``); what waits goes with the
        next report. Tasks are no carrier: the look-ahead may have sent them all.
        """
        # News: a worker's first report, or a throttle later than any the others heard of (a
        # worker cut by another's throttle reports that one again: an echo, not news).
        news = source not in self.learned or (
            state.throttled_at is not None
            and all(
                s.throttled_at is None or s.throttled_at < state.throttled_at
                for s in self.learned.values()
            )
        )
        self.learned[source] = state
        if self._num_workers < 2:
            return
        now = time.monotonic()
        engines = self._require_workers()
        for w in range(self._num_workers):
            if w == source or not self._active[w]:
                continue
            if news or now - self._heard_at[w] >= PEERS_EVERY:
                others = [s for v, s in self.learned.items() if v != w]
                engines.send(w, Peers(LimitState.combine(others)))
                self._heard_at[w] = now

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
            if isinstance(msg, Result | Failure):
                if msg.stats is not None:
                    self.tally.workers[msg.worker_id] = msg.stats
                if msg.limit is not None:
                    self._share(msg.worker_id, msg.limit)
            reply = msg
            if isinstance(msg, Exhausted):
                self._active[msg.worker_id] = False
                reply = _SKIP
                if not any(self._active):  # an iterable pass's last task
                    self._require_workers().prepare_next()
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

    def _require_workers(self) -> Workers:
        if self._engines is None:
            raise RuntimeError("this DataLoader pass has no workers (it failed to start)")
        return self._engines

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


def _compact(index: Any) -> Any:
    """Index batches travel as int64 arrays: small to pickle, no per-int Python objects."""
    if isinstance(index, list) and index and all(type(i) is int for i in index):
        return np.asarray(index, dtype=np.int64)
    return index
