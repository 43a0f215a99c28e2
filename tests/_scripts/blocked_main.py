"""Builds a loader whose workers block their event loops, prints the pids, then waits for ever.

The test SIGKILLs this process and checks that the workers, the forkserver and the resource
tracker all go. Arguments: the number of workers, the start method.
"""

from __future__ import annotations

import json
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests._guard_datasets import Blocking

import asyncload

_registered: list[str] = []
_register = multiprocessing.resource_tracker.register


def _note(name: str, rtype: str) -> None:
    _registered.append(name)  # what the tracker must clean up once we are gone
    _register(name, rtype)


multiprocessing.resource_tracker.register = _note

if __name__ == "__main__":
    workers = int(sys.argv[1])
    dataset = Blocking(64, slow=tuple(range(64)), delay=60.0)
    loader = asyncload.DataLoader(
        dataset,
        batch_size=2,
        num_workers=workers,
        collate_fn=list,
        multiprocessing_context=sys.argv[2],
    )
    it = iter(loader)
    pids = {
        "workers": list(it.worker_pids),
        "forkserver": multiprocessing.forkserver._forkserver._forkserver_pid,
        "tracker": multiprocessing.resource_tracker._resource_tracker._pid,
        "shm": _registered,
    }
    print(json.dumps(pids), flush=True)
    next(it)  # never returns: every sample blocks its worker's loop for a minute
