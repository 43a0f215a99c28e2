"""Messages between the main process and its workers, and the shutdown protocol.

NOTE [ Data flow and shutdown ]
================================

::

    main process (_pass.Pass → _workers.ProcessWorkers)      worker process i (_worker.py)
    ───────────────────────────────────────────────────      ─────────────────────────────
    sampler ─► IndexTask/IterTask ─► send(i, msg) ─► index_queue[i] ─► reader thread ─► inbox
               (round robin)         wraps (freed, msg)                 releases `freed`      │
                                                                                              ▼
                                                                 Engine (one event loop, up to
                                                                 max_concurrency in flight)
                                                                          │ collate, then pack:
                                                                          ▼ Result → Packed
    training loop ◄─ reorder ◄─ get() ◄─ [pin-memory thread] ◄─ result_queue ◄─ Packed/Failure/
                     (Pass)     unpack     unpack + pin                          Exhausted

Where a reply is unpacked (its shared memory mapped) and pinned, one place per kind of workers:

* ``ProcessWorkers``, ``pin_memory=True``: both on the pin-memory thread;
* ``ProcessWorkers``, no pinning: unpacked in ``get()``, on the training thread;
* ``ThreadWorkers`` (``num_workers=0``): nothing to unpack; pinned in ``get()``.

Between tasks, ``(freed, None)`` carries only releases, once a few have gathered (the
look-ahead may send no task for many batches), and ``Peers`` carries what the other workers'
adaptive limits learned (at most every ``PEERS_EVERY`` seconds, but at once for a throttle);
neither gets a reply. Every task is answered by exactly one reply carrying the same
``send_idx``: a ``Result``, a ``Failure`` or (iterable datasets) ``Exhausted``. The main
process therefore knows at all times which tasks are outstanding on which worker.

The start-pass handshake (persistent workers, every pass after the first; ``Pass.restart``)::

    Pass ── StartPass(generation + 1, epoch, shared_seed) ──► every engine
         engine: cancel all fetches of the old generation, set_epoch, reseed a DataPipe
    Pass ◄── PassStarted(generation) ── every engine; replies of older generations are dropped

A pass starts in ``Pass.__init__`` or ``Pass.restart`` and ends in ``Pass.close``, which calls
``Workers.close``: at the end of an epoch without persistent workers, on ``break`` once the
iterator is garbage, on an exception out of ``next()`` other than a failed batch, on
``load_state_dict``, and at interpreter exit (``atexit``). The workers belong to the pass, not
to the loader; a pass's processes may have been waiting for their config since the loader was
built (its first pass) or, without persistent workers, since the pass before sent its last task
(``_workers._standby``).
``Pass.close`` never stops the workers itself: it hands ``Workers.close`` to the reaper thread
and waits for it (a finalizer does not wait): NOTE [ Who stops workers ] in
``_workers/reaper.py``. There, ``ProcessWorkers.close``, through
``_workers._stop.stop_processes`` (which also stops standby processes no pass took), is the
shutdown sequence:

1. set ``done_event`` (workers stop putting results, and their readers stop): a byte of shared
   memory, which no lock guards, so a worker killed at any moment can't keep the others from
   seeing it (``_workers/stop.py`` ``DoneFlag``);
2. put ``Shutdown`` on every index queue; the worker's reader thread forwards it to the engine,
   which cancels its in-flight fetches, closes its storage clients and returns;
3. join each worker for a few seconds, then ``terminate()``, then ``kill()``; unlink what a
   worker killed by a signal left in ``/dev/shm`` (``_transfer.shm.sweep_dead``);
4. ``cancel_join_thread()`` and ``close()`` every queue, so no feeder thread blocks the exit,
   after closing this process's read end of each exited worker's index queue, so that no
   feeder thread stays blocked on a pipe nobody reads; ``close()`` every exited process;
5. let go of the queues, done flag and processes in another thread, so that their finalizers
   can't swallow a Ctrl-C (NOTE [ Ctrl-C and finalizers ] in ``_workers/stop.py``).

A worker also exits on its own when its parent dies (the reader thread's watchdog sees a new
parent pid or EOF on the index queue), so a SIGKILLed main process leaves no worker behind.
Workers ignore SIGINT: Ctrl-C reaches the main process, whose shutdown stops them.

Every blocking ``get`` has a timeout and re-checks ``done_event`` (worker side) or worker
liveness (main side), so neither side can hang on the other's death.
"""

from __future__ import annotations

import pickle
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

from .._exceptions import add_note
from .._stats.loader_stats import RecorderSnapshot

if TYPE_CHECKING:
    from .._control.values import LimitState
    from .._storage.backends.pacing_memory import PacingMemory
    from .._storage.config import StorageConfig

__all__ = [
    "PEERS_EVERY",
    "Exhausted",
    "Failure",
    "IndexTask",
    "IterTask",
    "PassStarted",
    "Peers",
    "RemoteError",
    "Result",
    "Shutdown",
    "Standing",
    "StartPass",
]

# How often blocking waits wake up to check liveness and the done flag, in seconds.
POLL_INTERVAL = 0.25
# How often, at most, a worker hears what the others learned (``Peers``): as often as they
# report it (their stats), so that a throttle or a probe reaches every worker within a round
# trip or two.
PEERS_EVERY = 0.2


# ── main → worker ─────────────────────────────────────────────────────────────────────────────


@dataclass(frozen=True, slots=True)
class IndexTask:
    """Fetch these indices of a map-style dataset and collate them (one index if not batched)."""

    send_idx: int
    generation: int
    indices: Any


@dataclass(frozen=True, slots=True)
class IterTask:
    """Produce the next batch (or sample) of an iterable dataset."""

    send_idx: int
    generation: int


@dataclass(frozen=True, slots=True)
class Peers:
    """What the loader's other workers learned of the store during this pass (control data,
    at most every ``PEERS_EVERY`` seconds per worker, but at once for a new throttle or a
    worker's first report): their adaptive limits combined, whose unloaded latency and
    throttles hold for this worker too (``_engine.slots.Slots.merge``)."""

    state: LimitState


@dataclass(frozen=True, slots=True)
class StartPass:
    """A new pass with persistent workers (torch's ``_ResumeIteration``): drop all work of the
    old one, restart iteration, then answer ``PassStarted``."""

    generation: int
    epoch: int | None
    shared_seed: int | None = None
    """A new shuffle seed for an ``IterDataPipe`` (torch's ``_ResumeIteration.seed``)."""


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Stop: cancel in-flight fetches, close clients, exit."""


@dataclass(frozen=True, slots=True)
class Standing:
    """A standby worker's argument instead of its config (``_workers._standby``): the config
    comes later, pickled, on its index queue; meanwhile it watches *main_pid* and builds the
    storage clients of *storage* (the main process's settings when it was started) with
    *pool_size* connections per host, the pass's ``max_concurrency``, under *environ* (the main
    process's environment then: a forkserver's child has the server's, frozen when it started)."""

    main_pid: int
    storage: StorageConfig | None = None
    pool_size: int = 0
    environ: dict[str, str] | None = None


# ── worker → main ─────────────────────────────────────────────────────────────────────────────


@dataclass(frozen=True, slots=True)
class Result:
    send_idx: int
    generation: int
    worker_id: int
    data: Any
    stats: RecorderSnapshot | None = None
    skipped: tuple[Any, ...] = ()
    """``_budget.SkippedSample``s left out of this batch (``sample_errors='skip'/'warn'``)."""
    sample_count: int = -1
    """Samples in ``data`` when some may have been skipped (0: nothing to yield), else -1."""
    tags: tuple[Any, ...] = ()
    """Which samples the batch took, from a dataset that tags its items
    (``_checkpoint.elastic_iter``)."""
    limit: LimitState | None = None
    """Where the worker's adaptive in-flight limit got to, with the stats (control data, kept
    out of ``stats``; the next pass's workers start there)."""
    pacing: PacingMemory | None = None
    """What the worker's connections learned of their hosts, when it changed (control data,
    kept out of ``stats``; the main process hands it to the next pass's workers)."""


@dataclass(frozen=True, slots=True)
class Failure:
    """A task failed; ``send_idx`` is -1 when the worker could not start at all."""

    send_idx: int
    generation: int
    worker_id: int
    error: RemoteError
    stats: RecorderSnapshot | None = None
    limit: LimitState | None = None
    """As ``Result.limit``."""
    pacing: PacingMemory | None = None
    """As ``Result.pacing``."""


@dataclass(frozen=True, slots=True)
class Exhausted:
    """The worker's iterable is exhausted; it will answer every later IterTask the same way."""

    send_idx: int
    generation: int
    worker_id: int


@dataclass(frozen=True, slots=True)
class PassStarted:
    generation: int
    worker_id: int


# ── errors across the process boundary ────────────────────────────────────────────────────────


class _RemoteTraceback(Exception):
    """Carries the worker's formatted traceback as the ``__cause__`` of a re-raised error."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return self.tb


@dataclass(frozen=True, slots=True)
class RemoteError:
    """An exception caught in a worker, with where it happened (torch's ``ExceptionWrapper``).

    The original exception travels pickled when it can; otherwise it is rebuilt from its type
    name and message. Either way ``reraise`` raises it in the main process with the worker's
    traceback as ``__cause__`` and a note naming the worker, its pid and the sample index.
    """

    where: str
    type_name: str
    message: str
    traceback: str
    pickled: bytes | None

    @classmethod
    def capture(cls, exc: BaseException, where: str) -> RemoteError:
        pickled: bytes | None
        try:
            data = pickle.dumps(exc)
            pickle.loads(data)  # some exceptions pickle but can't be rebuilt
            pickled = data
        except Exception:
            pickled = None
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        type_name = f"{type(exc).__module__}.{type(exc).__qualname__}"
        return cls(where, type_name, str(exc), tb, pickled)

    def exception(self) -> BaseException:
        exc: BaseException | None = None
        pickled = self.pickled
        if pickled is not None:
            try:
                exc = pickle.loads(pickled)
            except Exception:
                exc = None
        if exc is None:
            from .._exceptions import LoadError

            exc = LoadError(f"{self.type_name}: {self.message}")
        exc.__cause__ = _RemoteTraceback(f"\n\nTraceback {self.where}:\n{self.traceback}".rstrip())
        add_note(exc, f"Raised {self.where}.")
        return exc

    def reraise(self) -> NoReturn:
        raise self.exception()
