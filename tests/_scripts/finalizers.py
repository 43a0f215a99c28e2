"""Passes dropped in reference cycles, their finalizers run by collections on other threads
(one that collects on purpose, one that allocates in a loop), while another pass iterates: no
finalizer may block (NOTE [ Who stops workers ]).

Prints a JSON object: rounds, the slowest collection in seconds, batches the iterating pass
gave.
"""

from __future__ import annotations

import faulthandler
import gc
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests._datasets import SyncNumbers

import asyncload


def _in_a_cycle(obj: Any) -> None:
    cycle: list[Any] = [obj]
    cycle.append(cycle)


def _collect_here(took: list[float]) -> None:
    # A collection on a thread of its own: the dropped passes' finalizers run here.
    t0 = time.monotonic()
    gc.collect()
    took.append(time.monotonic() - t0)


def _allocate(stop: threading.Event) -> None:
    # Cycles in bursts, so that the collector also runs here of its own accord.
    while not stop.is_set():
        for _ in range(2000):
            a: list[Any] = []
            a.append(a)
        time.sleep(0.002)


def main(rounds: int) -> dict[str, Any]:
    # A hang is a bug: every thread's stack on stderr, and out.
    faulthandler.dump_traceback_later(120, exit=True)
    # What lives now stays: collections then look at new objects only, and stay quick.
    gc.freeze()
    iterating = asyncload.DataLoader(
        SyncNumbers(10**6), batch_size=4, num_workers=2, persistent_workers=True
    )
    it = iter(iterating)
    stop = threading.Event()
    allocator = threading.Thread(target=_allocate, args=(stop,), daemon=True)
    allocator.start()
    took: list[float] = []
    batches = 0
    for r in range(rounds):
        single = iter(asyncload.DataLoader(SyncNumbers(1000), batch_size=4, num_workers=0))
        next(single)  # dropped mid-epoch
        _in_a_cycle(single)
        del single
        if r % 25 == 0:  # now and then a pass with processes and a loader with a standby set
            loader = asyncload.DataLoader(SyncNumbers(1000), batch_size=4, num_workers=2)
            multi = iter(loader)
            next(multi)
            _in_a_cycle(multi)
            _in_a_cycle(loader)
            del multi, loader
        collector = threading.Thread(target=_collect_here, args=(took,))
        collector.start()
        collector.join(30)
        if collector.is_alive():
            print(json.dumps({"deadlock": r}), flush=True)
            import os

            os._exit(3)
        next(it)
        batches += 1
    stop.set()
    allocator.join(10)
    del it, iterating
    gc.collect()
    return {"rounds": rounds, "slowest": max(took), "batches": batches}


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]) if len(sys.argv) > 1 else 200)), flush=True)
