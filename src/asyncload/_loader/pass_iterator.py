"""One pass over a DataLoader: sampler → workers → reorder → training loop.

The loader builds a frozen ``PassSpec`` and hands it, with the resume point, to a
``Pass``; the pass never sees the loader. It draws the seeds, sends index batches to its
``_workers.Workers`` round-robin (as torch does), keeps batches sent but not yet yielded
within a memory bound (``_loader.lookahead``: the workers fetch on behind a straggling batch),
restores sampler order when ``in_order=True`` and records progress for checkpoints (that
traffic with the workers is ``_dispatch.Dispatch``, which ``Pass`` extends). A pass starts in
``Pass.__init__`` (or ``Pass.restart`` with persistent workers) and ends in ``Pass.close``,
nowhere else. Its workers live exactly as long as it does. See
NOTE [ Data flow and shutdown ] in ``_protocol/messages.py``.
"""

from __future__ import annotations

import atexit
import enum
import os
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.data

from .._checkpoint.resume import NO_PASS, Progress, ResumePoint, restore_rng
from .._control import LimitState
from .._protocol.messages import Failure, PassStarted, StartPass
from .._stats.loader_stats import Tally
from .._workers import Workers
from .._workers.reaper import reaper
from . import start as _start
from .dispatch import Dispatch
from .spec import PassSpec, length_warning, spec_length
from .stalls import StallBoard

__all__ = ["Pass", "PassSpec", "State"]


class State(enum.Enum):
    RUNNING = "running"
    """Batches are being fetched and yielded."""
    EXHAUSTED = "exhausted"
    """Every batch was yielded; with persistent workers, ``Pass.restart`` starts another."""
    CLOSED = "closed"
    """The workers are stopped; the pass can't be used again."""


StartWorkers = Callable[..., Workers]
"""``start(spec, *, base_seed, skips, shared_seed) -> Workers``: ``start.start_workers``."""

_live: weakref.WeakSet[Pass] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for p in list(_live):
        p.close()


class Pass(Dispatch):
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
        self._engines: Workers | None = None
        # The process whose workers these are: a copy in a child made by os.fork() does not
        # read from them (they serve the parent's training loop; ProcessWorkers.close does not
        # stop them there either).
        self._pid = os.getpid()
        self.spec = spec
        self.tally = Tally(max(1, spec.num_workers), None)
        self.learned: dict[int, LimitState] = {}
        self._len_reported = len_reported
        self._num_workers = max(1, spec.num_workers)
        self._generation = 0
        self._ran_out = False  # (again in _begin, for each pass)
        self._stalls = StallBoard()  # workers' blocked event loops (see _watchdog)
        # torch draws an IterDataPipe's shared seed first, then the workers' base seed. A
        # checkpoint records the RNG state after both, where every pass's sampler starts
        # (persistent workers draw no new base seed), so a restore replays the sampler.
        kept_seed: int | None = None
        if resume is not None and resume.finished:
            # Saved after its pass ended: this pass is the next epoch. It starts where the
            # loader's generator stood then, as the uninterrupted loader's next pass would, and
            # persistent workers keep their base seed, as they do from epoch to epoch. Without
            # a generator the next epoch draws from torch's global RNG, which is the caller's.
            if spec.generator is not None:
                restore_rng(spec.generator, resume.rng)
            if spec.persistent and spec.num_workers > 0 and resume.base_seed != NO_PASS:
                kept_seed = resume.base_seed
            resume = None
        shared_seed = self._draw_shared_seed()
        if kept_seed is not None:
            self._base_seed = kept_seed
        elif resume is None:
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
        reaper.ensure_started()  # an ordinary call: close() and __del__ hand their job to it
        try:
            self._engines = (start_workers or _start.start_workers)(
                spec, base_seed=self._base_seed, skips=skips, shared_seed=shared_seed
            )
            self.tally = Tally(self._num_workers, self._engines.live_stats)
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
        return self._engines.pids if self._engines is not None else ()

    @property
    def _workers(self) -> list[Any]:
        """The worker processes, as torch's iterator has them (``[]`` with ``num_workers=0``).

        torch's tests and users' own check pids and exits with it (``w.pid``, ``w.is_alive()``,
        ``w.join()``); the objects stay usable after the pass has stopped them.
        """
        return list(self._engines.processes) if self._engines is not None else []

    def __len__(self) -> int:
        return spec_length(self.spec)

    def owned_here(self) -> bool:
        """Whether this process started the pass (not a child made by ``os.fork()``)."""
        return self._pid == os.getpid()

    def __next__(self) -> Any:
        if not self.owned_here():
            raise RuntimeError(
                f"this DataLoader pass was started in process {self._pid}, and its workers "
                f"serve that process; this one ({os.getpid()}, made by os.fork()) must start "
                "its own: iter(loader)"
            )
        if self.state is State.CLOSED and self._ran_out:
            raise StopIteration  # a finished iterator stays finished, as the protocol wants
        if self.state is State.CLOSED:
            raise RuntimeError(
                "this DataLoader pass was closed (its workers are stopped); "
                "iter(loader) starts a new one"
            )
        if self.state is State.EXHAUSTED:
            raise StopIteration
        t0 = time.monotonic()
        cpu0 = time.thread_time()
        try:
            data = self._next_data()
        except StopIteration:
            self.state = State.EXHAUSTED
            self._ran_out = True  # kept through close(): a checkpoint says the pass finished
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
        self.tally.transfer_s += time.thread_time() - cpu0
        self.tally.batches += 1
        self._num_yielded += 1
        if self._len_reported is not None and self._num_yielded > self._len_reported:
            text = length_warning(self.spec, self._len_reported, self._num_yielded)
            warnings.warn(text, stacklevel=2)
        return data

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
            finished=self._ran_out,
        )

    # ── the one way a pass ends: NOTE [ Data flow and shutdown ] in _protocol.py ──────────────

    def close(self, *, wait: bool = True) -> None:
        """Stop the workers (persistent or not); later ``next()`` calls raise RuntimeError.

        The reaper thread stops them (NOTE [ Who stops workers ] in ``_workers/reaper.py``);
        this waits for it unless *wait* is false (a finalizer, which must never block).
        """
        if self.state is State.CLOSED:
            return
        self.state = State.CLOSED
        _live.discard(self)
        if self.tally.ended is None:
            self.tally.ended = time.monotonic()
        if self._engines is not None:
            reaper.submit(self._engines.close, wait=wait)

    def __del__(self) -> None:
        if getattr(self, "state", State.CLOSED) is not State.CLOSED:
            self.close(wait=False)
