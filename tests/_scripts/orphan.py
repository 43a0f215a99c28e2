"""Start workers, print their pids, then stop reading; the test SIGKILLs this process.

Usage: ``orphan.py blobs`` (the result pipe fills) or ``orphan.py stuck`` (every fetch hangs).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests._datasets import Blobs, Stuck

import asyncload

if __name__ == "__main__":
    kind = sys.argv[1]
    dataset = Blobs(10**6, 8192) if kind == "blobs" else Stuck()
    loader = asyncload.DataLoader(dataset, batch_size=4, num_workers=2, max_concurrency=4)
    it = iter(loader)
    if kind == "blobs":
        next(it)
    print(" ".join(str(pid) for pid in it.worker_pids), flush=True)
    time.sleep(600)  # stop reading: the result pipe fills, or every fetch stays stuck
