"""``num_workers=0``: one engine on an event loop in a daemon thread of this process."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from .._engine import WorkerConfig
from .._exceptions import WorkerError
from .._protocol.messages import Shutdown
from .._stats import recorder as _metrics
from .child import ThreadWorker
from .pin_memory import pin

__all__ = ["ThreadWorkers"]

# Seconds to wait for the loop thread to finish its fetches' cancellation.
_JOIN_TIMEOUT = 5.0


class ThreadWorkers:
    """The ``_workers.Workers`` of a ``num_workers=0`` pass.

    Replies are pinned in ``get``, on the training thread, as torch's single-process
    iterator pins; nothing needs unpacking (no process boundary).
    """

    def __init__(self, cfg: WorkerConfig, *, pin_device: str | None) -> None:
        self.count = 1
        # The engine's own counters, read live: only its fetches count, not the application's
        # other reads in this process (they go to _metrics.recorder).
        recorder = _metrics.Recorder()
        self.live_stats: Callable[[], _metrics.RecorderSnapshot] | None = recorder.snapshot
        self._pin_device = pin_device
        self._closed = False
        self._worker = ThreadWorker(cfg, recorder)

    @property
    def pids(self) -> tuple[int, ...]:
        return ()

    @property
    def processes(self) -> tuple[()]:
        return ()

    def send(self, worker_id: int, msg: object) -> None:
        self._worker.send(msg)

    def get(self, timeout: float) -> object | None:
        try:
            msg = self._worker.results.get(timeout=timeout)
        except queue.Empty:
            self.check_alive()
            return None
        return pin(msg, self._pin_device) if self._pin_device is not None else msg

    def check_alive(self) -> None:
        if not self._worker.is_alive():
            raise WorkerError("the DataLoader's event-loop thread exited unexpectedly")

    def prepare_next(self) -> None:
        return None  # the next pass's thread starts in a millisecond

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._worker.send(Shutdown())
        if threading.main_thread().is_alive():
            self._worker.join(_JOIN_TIMEOUT)
        # At interpreter exit the loop thread (a daemon) goes with the process: waiting for it
        # there would make every pass still queued for the reaper cost its join, one after the
        # other (its thread pool may refuse new work by then, so a sync __getitem__ never ends).
