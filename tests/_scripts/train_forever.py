"""Iterate a long loader; print the worker pids once the first batch arrived.

Run by tests/test_shutdown.py, which then kills or interrupts this process.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests._datasets import SyncNumbers

import asyncload

if __name__ == "__main__":
    loader = asyncload.DataLoader(SyncNumbers(10**6, delay=0.01), batch_size=4, num_workers=2)
    it = iter(loader)
    next(it)
    print(" ".join(str(pid) for pid in it.worker_pids), flush=True)
    for _ in it:
        pass
