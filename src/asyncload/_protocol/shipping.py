"""A worker's arguments, unpickled where a failure to do so can be reported.

Under ``spawn`` and ``forkserver`` a child unpickles its arguments before any of our code runs; a
failure there (a class it can't import, e.g. one defined under ``if __name__ == "__main__":``)
killed it with a bare "exit code 1". :class:`Shipped` pickles the worker's config separately;
:func:`received`, first thing in the worker, reports a failure to the main process.
"""

from __future__ import annotations

import os
import pickle
from multiprocessing.reduction import ForkingPickler
from typing import Any

from .._exceptions import NotPicklable
from .messages import Failure, RemoteError

__all__ = ["Shipped", "received"]


class Shipped:
    """A worker's config, pickled on its own so that the worker can report failing to unpickle it.

    Under ``fork`` nothing is pickled and the worker gets this object itself.
    """

    def __init__(self, cfg: Any, method: str) -> None:
        self.cfg = cfg
        self.method = method

    def __reduce__(self) -> tuple[Any, ...]:
        worker_id = getattr(self.cfg, "worker_id", -1)
        # ForkingPickler, as multiprocessing itself uses: torch's reducers share tensors.
        payload = bytes(ForkingPickler.dumps(self.cfg, pickle.HIGHEST_PROTOCOL))
        return (_receive, (worker_id, self.method, payload))


def _receive(worker_id: int, method: str, payload: bytes) -> Any:
    try:
        return pickle.loads(payload)
    except Exception as exc:
        error = NotPicklable(
            f"DataLoader worker {worker_id} could not unpickle its arguments (the dataset, "
            f"collate_fn or worker_init_fn): {type(exc).__name__}: {exc}. Workers started with "
            f"{method!r} import these by name: define them at the top level of a module the "
            "worker can import (not under `if __name__ == '__main__':`, not in a notebook), or "
            "pass multiprocessing_context='fork'."
        )
        error.__cause__ = exc
        return _Unreceived(worker_id, error)


class _Unreceived:
    def __init__(self, worker_id: int, error: Exception) -> None:
        self.worker_id = worker_id
        self.error = error


def received(sent: Any, result_queue: Any) -> Any:
    """The worker's config from what :class:`Shipped` became; ``None`` once a failure to
    unpickle it has been reported to the main process."""
    if isinstance(sent, Shipped):
        return sent.cfg  # fork: nothing was pickled
    if not isinstance(sent, _Unreceived):
        return sent
    where = f"in DataLoader worker {sent.worker_id} (pid {os.getpid()}) during start-up"
    result_queue.put(Failure(-1, 0, sent.worker_id, RemoteError.capture(sent.error, where)))
    result_queue.close()
    result_queue.join_thread()
    return None
