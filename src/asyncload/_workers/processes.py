"""Worker processes: start, send, receive (unpack and pin), liveness, and the shutdown protocol.

See NOTE [ Data flow and shutdown ] in ``_protocol/messages.py``; ``stop_processes`` is its shutdown
sequence, and the only one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import pickle
import queue
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Any

from .._engine import WorkerConfig
from .._engine.slots import most_in_flight
from .._exceptions import WorkerError
from .._protocol.messages import POLL_INTERVAL, Failure, Result
from .._protocol.shipping import Shipped
from .._stats.loader_stats import RecorderSnapshot
from .._storage import api as _storage
from .._transfer import shm as _shm
from .._transfer.pickling import unpack
from . import tuning as _tuning
from .child import worker_main
from .pin_memory import PinMemoryThread
from .reaper import reaper
from .start_method.context import diagnose_pickling, find_unpicklable
from .stop import (
    DoneFlag,
    new_index_queue,
    release_elsewhere,
    shared_polling,
    stop_processes,
)

if TYPE_CHECKING:
    from .standby import StandbySlot

__all__ = ["PICKLE_WARNING", "ProcessWorkers"]

# Block uses the main process is done with that go back to their worker without waiting for
# its next task: the look-ahead may send none for many batches, and meanwhile the worker would
# map new blocks for every batch it stashes (NOTE [ Reused shared memory ]).
_RETURN_FREED = 4

PICKLE_WARNING = (  # torch's, word for word: code and tests match on it
    "Got pickle error when attempting to start a worker Process. "
    "This might be because the worker Process arguments are not picklable. "
    "Python 3.14+ changed the multiprocessing start method in non-Mac POSIX platforms "
    "to 'forkserver', which requires the worker Process arguments to be picklable. "
    "You can also try multiprocessing.set_start_method('fork')."
)


class ProcessWorkers:
    """The ``_workers.Workers`` of a pass with ``num_workers > 0``.

    Owns the processes, their queues, the done flag, the pin-memory thread and one
    shared-memory block pool name per worker (NOTE [ Reused shared memory ]). Replies are
    unpacked (their shared memory mapped) on the pin-memory thread, which also pins them, or
    without pinning in ``get``, on the training thread.

    Args:
        configs: One per worker; the process-only fields (pool, environment) are filled here.
        context: The multiprocessing context to start them with.
        pin_device: Pin replies for this accelerator, or ``None``.
        shm_blocks: At most this many shared-memory blocks per worker.
        sent_objects: The user's objects every worker receives, named for pickling errors.
        standby: Where processes started ahead of this pass may wait (``_workers.standby``), and
            where this pass starts the next pass's once it has sent its last task.
        next_pass: Whether the next pass needs processes of its own (not with persistent
            workers: it runs on these).
    """

    def __init__(
        self,
        configs: list[WorkerConfig],
        *,
        context: Any,
        pin_device: str | None,
        shm_blocks: int,
        sent_objects: dict[str, Any],
        standby: StandbySlot | None = None,
        next_pass: bool = True,
    ) -> None:
        # Every field close() touches is set before anything can fail.
        self.count = len(configs)
        self._max_concurrency = (
            most_in_flight(configs[0].options.max_concurrency, len(configs)) if configs else 0
        )
        self.live_stats: Callable[[], RecorderSnapshot] | None = None  # they ride on replies
        self._closed = False
        self._answered = self._next_wanted = False  # prepare_next()
        self._pids: tuple[int, ...] = ()  # kept once closed
        self._processes: tuple[Any, ...] = ()  # kept once closed (torch's iterator._workers)
        self._procs: list[Any] = []
        self._index_queues: list[Any] = []
        self._pin_thread: PinMemoryThread | None = None
        self._replies: Any = None
        self._owner = os.getpid()  # the process that stops them (close)
        self._context, self._slot, self._next_pass = context, standby, next_pass
        _tuning.tune_main()  # this process unpickles every batch (see _tuning)
        self._tokens = [f"{os.getpid()}-{id(self):x}-{i}-{os.urandom(4).hex()}" for i in configs]
        for token in self._tokens:
            _shm.register_token(token)
        storage_config = _storage.export_config()
        environ = dict(os.environ)
        configs = [
            dataclasses.replace(
                cfg,
                storage_config=storage_config,
                main_pid=os.getpid(),
                environ=environ,
                shm_token=token,
                shm_blocks=shm_blocks,
            )
            for cfg, token in zip(configs, self._tokens, strict=True)
        ]
        waiting = standby.take(context, len(configs)) if standby is not None else None
        payloads: list[bytes] = []
        if waiting is not None:
            try:
                payloads = [self._pickled(cfg, sent_objects) for cfg in configs]
            except _Inherited:
                # A multiprocessing.Value, Lock, Queue... reaches a process only as it starts,
                # as torch's workers get it: new processes, and no standby for this loader.
                waiting.retire()
                waiting = None
                if standby is not None:
                    standby.turn_off()
            except BaseException:  # nothing of this pass started: the standby set goes
                waiting.retire()
                self._closed = True
                for token in self._tokens:
                    _shm.unregister_token(token)
                raise
        # Held by the reaper until close(), from before any process is this object's:
        # NOTE [ Who stops workers ].
        self._done_event: DoneFlag | None
        if waiting is not None:  # this object owns them from now on, and stops them
            reaper.own(self)
            self._done_event, self._result_queue = waiting.done_event, waiting.result_queue
            self._procs, self._index_queues = list(waiting.procs), list(waiting.index_queues)
            reaper.disown(waiting)
        else:
            self._done_event = DoneFlag(context)
            self._result_queue = context.Queue()
            reaper.own(self)
        try:
            for i, cfg in enumerate(configs):
                if waiting is not None:
                    # (freed, payload): what Shipped became, pickled above.
                    self._index_queues[i].put(((), payloads[i]))
                else:
                    self._start_one(context, cfg, sent_objects)
        except BaseException:
            self.close()
            raise
        if pin_device is not None:
            self._pin_thread = PinMemoryThread(self._result_queue, pin_device)
            self._replies = self._pin_thread.out
        else:
            self._replies = self._result_queue
        self._last_check = time.monotonic()

    def _start_one(self, context: Any, cfg: WorkerConfig, sent_objects: dict[str, Any]) -> None:
        index_queue = new_index_queue(context)
        proc = context.Process(
            target=worker_main,
            # A worker that can't unpickle its config says so (see _shipping).
            args=(
                Shipped(cfg, context.get_start_method()),
                index_queue,
                self._result_queue,
                self._done_event,
            ),
            name=f"asyncload-worker-{cfg.worker_id}",
            daemon=True,
        )
        try:
            with _children_allowed():
                proc.start()
            shared_polling(proc)
        except Exception as exc:
            error = _not_started(exc, sent_objects, context.get_start_method())
            if error is exc:
                raise
            raise error from exc
        self._index_queues.append(index_queue)
        self._procs.append(proc)

    def _pickled(self, cfg: WorkerConfig, sent_objects: dict[str, Any]) -> bytes:
        """A standby process's config, pickled here, where a failure can be raised with its
        culprit named, not in a queue's feeder thread."""
        method = self._context.get_start_method()
        try:
            return bytes(ForkingPickler.dumps(Shipped(cfg, method), pickle.HIGHEST_PROTOCOL))
        except RuntimeError as exc:
            if _INHERITANCE in str(exc):
                raise _Inherited from exc
            error = _not_started(exc, sent_objects, method)
            if error is exc:
                raise
            raise error from exc
        except Exception as exc:
            error = _not_started(exc, sent_objects, method)
            if error is exc:
                raise
            raise error from exc

    def prepare_next(self) -> None:
        """This pass has sent its last task: start the next pass's processes meanwhile, once a
        worker has answered.

        Not before: a short pass sends its last task at ``iter()``, and starting processes then
        takes the CPU its first requests need (on 2 cores, 10-20 ms of a later epoch's first
        batch, ``bench_tails.py --startup``).
        """
        self._next_wanted = True
        if self._answered and self._slot is not None and self._next_pass and not self._closed:
            self._next_wanted = False
            self._slot.prepare(self._context, self.count, max_concurrency=self._max_concurrency)

    @property
    def pids(self) -> tuple[int, ...]:
        return self._pids if self._closed else tuple(p.pid for p in self._procs)

    @property
    def processes(self) -> tuple[Any, ...]:
        return self._processes if self._closed else tuple(self._procs)

    def send(self, worker_id: int, msg: object) -> None:
        token = self._tokens[worker_id]
        self._index_queues[worker_id].put((_shm.take_freed(token), msg))

    def get(self, timeout: float) -> object | None:
        try:
            msg: object = unpack(self._replies.get(timeout=timeout))
        except queue.Empty:
            msg = None
        except Exception as exc:
            # Unpickling asks the sending worker for its shared memory: if that worker just
            # died, say so (with its pid and signal) rather than "connection reset".
            self._raise_if_a_worker_died(exc)
            raise
        if isinstance(msg, BaseException):  # the pin-memory thread could not unpack
            self._raise_if_a_worker_died(msg)
            raise msg
        if isinstance(msg, Result | Failure):
            if msg.pacing is not None:
                _storage.learn_pacing(msg.pacing)
            self._return_freed(msg.worker_id)
        if isinstance(msg, Result) and not self._answered:  # a batch, not a warning
            self._answered = True
            if self._next_wanted:
                self.prepare_next()
        if isinstance(msg, Failure):
            return msg  # before the liveness check: a worker may exit right after it
        now = time.monotonic()
        # Also while replies flow: other workers' batches must not hide a dead one.
        if msg is None or now - self._last_check >= POLL_INTERVAL:
            self._last_check = now
            self.check_alive()
        return msg

    def _return_freed(self, worker_id: int) -> None:
        token = self._tokens[worker_id]
        if _shm.freed_uses(token) >= _RETURN_FREED:
            # (freed, None): releases only, no task (NOTE [ Data flow and shutdown ]).
            self._index_queues[worker_id].put((_shm.take_freed(token), None))

    def _raise_if_a_worker_died(self, cause: BaseException) -> None:
        deadline = time.monotonic() + 1.0
        while True:  # a worker killed a moment ago may not have been reaped yet
            try:
                self.check_alive()
            except WorkerError as exc:
                raise exc from cause
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def check_alive(self) -> None:
        if self._pin_thread is not None and not self._pin_thread.is_alive():
            raise WorkerError("the pin-memory thread exited unexpectedly")
        for worker_id, w in enumerate(self._procs):
            if not w.is_alive():
                raise _died(worker_id, w)

    # ── NOTE [ Data flow and shutdown ], steps 1-4 ────────────────────────────────────────────

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._owner != os.getpid():
            # A copy in a child made by os.fork(): the processes, their queues, done flag and
            # shared memory are the parent's, which stops them. Setting the done flag or
            # unlinking the blocks here would stop the parent's pass under it.
            self._procs, self._index_queues = [], []
            self._result_queue = self._done_event = self._replies = self._pin_thread = None
            return
        self._pids, self._processes = self.pids, self.processes
        if self._pin_thread is not None:
            self._pin_thread.stop()
        # This object lets go of them: NOTE [ Ctrl-C and finalizers ] in _stop.py.
        box: list[Any] = [self._procs, self._index_queues, self._result_queue, self._done_event]
        box += [self._pin_thread, self._replies]
        self._procs, self._index_queues = [], []
        self._result_queue = self._done_event = self._replies = self._pin_thread = None
        stop_processes(*box[:4], close_objects=False)
        release_elsewhere(box)
        for token in self._tokens:
            _shm.unregister_token(token)
        reaper.disown(self)


# multiprocessing's words when an object can only reach a child as it starts
# (``context.assert_spawning``): synchronized Values and Arrays, locks, queues, events...
_INHERITANCE = "through inheritance"


class _Inherited(Exception):
    """The config holds such an object: it can't go to a standby process."""


def _died(worker_id: int, w: Any) -> WorkerError:
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
    return WorkerError(
        f"DataLoader worker {worker_id} (pid {w.pid}) exited unexpectedly with {how}.{hint}",
        worker_id=worker_id,
        pid=w.pid,
        exitcode=code,
    )


_daemon_lock = threading.Lock()


@contextlib.contextmanager
def _children_allowed() -> Iterator[None]:
    """Let this process start workers even if it is daemonic (a ``multiprocessing.Pool``
    worker, a ``Process(daemon=True)``), as a hyperparameter search or a data-prep pool does.

    multiprocessing refuses (``AssertionError: daemonic processes are not allowed to have
    children``) because a daemonic process is killed at its parent's exit and its children
    would be orphaned. Ours are not: a worker watches its main process and exits within
    ``POLL_INTERVAL`` of its death (``parent_watch``), and the fork server goes with its owner
    too. So the flag is lifted for the start of our own processes only, and put back."""
    process = multiprocessing.current_process()
    if not process.daemon:
        yield
        return
    with _daemon_lock:
        config = process._config  # type: ignore[attr-defined]
        config["daemon"] = False
        try:
            yield
        finally:
            config["daemon"] = True


def _not_started(exc: Exception, sent_objects: dict[str, Any], method: str) -> Exception:
    """What to raise when a worker's arguments failed to pickle (or its start failed)."""
    if isinstance(exc, (OSError, RuntimeError)) and not _is_pickling_error(exc):
        return exc
    if isinstance(exc, (TypeError, AttributeError, pickle.PicklingError)):
        warnings.warn(PICKLE_WARNING, stacklevel=7)
        return diagnose_pickling(sent_objects, method, exc)
    # Any other error may come from a __reduce__ (a culprit to name), or from the start itself:
    # then it is raised as it is, not as a pickling failure.
    found = find_unpicklable(sent_objects, method)
    return exc if found is None else found


def _is_pickling_error(exc: BaseException) -> bool:
    text = f"{type(exc).__name__}: {exc}".lower()
    return "pickl" in text
