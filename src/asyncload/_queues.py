"""The worker → main result queue, which turns a batch that fails to pickle into a Failure.

``multiprocessing.Queue.put`` pickles in a feeder thread; when that fails the stock queue prints
a traceback and drops the message, and the main process would wait for that batch forever. This
subclass answers the lost task with a :class:`~asyncload._protocol.Failure` instead.
"""

from __future__ import annotations

import multiprocessing.queues
from typing import Any

from ._protocol import Failure, RemoteError, Result

__all__ = ["ResultQueue"]


class ResultQueue(multiprocessing.queues.Queue):  # type: ignore[type-arg,unused-ignore]
    """A ``multiprocessing.Queue`` whose pickling errors become Failures for the same task."""

    def _on_queue_feeder_error(self, e: Exception, obj: Any) -> None:
        if isinstance(obj, Result):
            where = f"in DataLoader worker {obj.worker_id}, sending batch {obj.send_idx}"
            exc = TypeError(
                f"the batch could not be pickled to reach the main process: "
                f"{type(e).__name__}: {e}. Return tensors, NumPy arrays, bytes or plain "
                "Python containers from the dataset/collate_fn."
            )
            exc.__cause__ = e
            self.put(
                Failure(
                    obj.send_idx, obj.generation, obj.worker_id, RemoteError.capture(exc, where)
                )
            )
        else:
            super()._on_queue_feeder_error(e, obj)  # type: ignore[misc]
