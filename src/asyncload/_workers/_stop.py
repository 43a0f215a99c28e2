"""The shutdown sequence of worker processes, NOTE [ Data flow and shutdown ] in
``_protocol.py``: written once, for a pass's workers and for standby ones (``_standby``)."""

from __future__ import annotations

import time
from typing import Any

from .._protocol import Shutdown

__all__ = ["stop_processes"]

# Seconds to wait for a worker to exit on its own before terminate(), then kill().
JOIN_TIMEOUT = 5.0


def stop_processes(procs: list[Any], index_queues: list[Any], result_queue: Any, done: Any) -> None:
    """Stop worker processes and close their queues: NOTE [ Data flow and shutdown ], steps 1-4
    (the pin-memory thread, step 0, is the caller's). Also for standby processes that never
    got a config (``_standby``): they take the same ``Shutdown``."""
    done.set()
    for q in index_queues:
        try:
            q.put(((), Shutdown()))
        except (OSError, ValueError):  # queue already closed
            pass
    deadline = time.monotonic() + JOIN_TIMEOUT
    for w in procs:
        w.join(max(deadline - time.monotonic(), 0.0))
    for w in procs:
        if w.is_alive():
            w.terminate()
            w.join(1.0)
        if w.is_alive():  # pragma: no cover - SIGTERM ignored
            w.kill()
            w.join(1.0)
    for q in [*index_queues, result_queue]:
        q.cancel_join_thread()
        q.close()
