"""Build and drop many loaders the ways programs do, and count what they leave.

Each loader is one of: never iterated, one batch then dropped, a whole epoch, an exception out
of the loop; persistent or not; 2 or 4 workers; every other one in a reference cycle. Prints a
JSON object: the baseline, the peaks while it ran and what was left after of worker processes,
asyncload threads, open descriptors, /dev/shm entries and RSS (MiB), and seconds taken.
"""

from __future__ import annotations

import gc
import itertools
import json
import os
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests._datasets import SyncNumbers
from tests._procs import worker_processes

import asyncload
from asyncload._workers.reaper import reaper

WAYS = ("never", "one", "epoch", "raise")
# torch's advice about 4 workers on a 2-core machine: not what this script looks at.
warnings.filterwarnings("ignore", message="This DataLoader will create")


def _shm() -> int:
    try:
        return len(os.listdir("/dev/shm"))
    except OSError:  # pragma: no cover - no /dev/shm
        return 0


def measure() -> dict[str, float]:
    me = psutil.Process()
    return {
        "processes": len(worker_processes()),
        "threads": sum(t.name.startswith("asyncload") for t in threading.enumerate()),
        "fds": me.num_fds(),
        "shm": _shm(),
        "rss_mib": me.memory_info().rss / 2**20,
    }


def _in_a_cycle(obj: Any) -> None:
    cycle: list[Any] = [obj]
    cycle.append(cycle)


def one_loader(way: str, workers: int, persistent: bool, cycle: bool) -> None:
    loader = asyncload.DataLoader(
        SyncNumbers(64), batch_size=8, num_workers=workers, persistent_workers=persistent
    )
    if way == "one":
        it = iter(loader)
        next(it)
        if cycle:
            _in_a_cycle(it)
        del it
    elif way == "epoch":
        assert sum(len(b) for b in loader) == 64
    elif way == "raise":
        try:
            for _ in loader:
                raise KeyError("the training step failed")
        except KeyError:
            pass
    if cycle:
        _in_a_cycle(loader)


def main(count: int) -> dict[str, Any]:
    one_loader("epoch", 2, False, False)  # the forkserver and resource tracker start here
    gc.collect()
    reaper.drain(30)
    time.sleep(1.0)
    base = measure()
    peak = dict(base)
    t0 = time.monotonic()
    combos = itertools.cycle(itertools.product(WAYS, (2, 4), (False, True), (False, True)))
    for i, (way, workers, persistent, cycle) in enumerate(itertools.islice(combos, count)):
        one_loader(way, workers, persistent, cycle)
        if i % 4 == 0:
            now = measure()
            peak = {k: max(v, now[k]) for k, v in peak.items()}
    took = time.monotonic() - t0
    gc.collect()
    reaper.drain(60)
    deadline = time.monotonic() + 30
    while True:  # processes being stopped by the reaper go within its bounded waits
        after = measure()
        if after["processes"] <= base["processes"] or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return {"count": count, "seconds": took, "base": base, "peak": peak, "after": after}


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]) if len(sys.argv) > 1 else 160)), flush=True)
