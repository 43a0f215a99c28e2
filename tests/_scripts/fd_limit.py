"""Read over HTTP with only 64 file descriptors: expect a clear ConnectError, not a hang.

Usage: ``fd_limit.py BASE_URL NUM_WORKERS``.
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests._datasets import Numbers

import asyncload

if __name__ == "__main__":
    base, workers = sys.argv[1], int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    loader = asyncload.DataLoader(
        Numbers(base, 300), batch_size=50, num_workers=workers, max_concurrency=200
    )
    try:
        sum(len(b) for b in loader)
    except asyncload.ConnectError as exc:
        print("ConnectError:", exc)
