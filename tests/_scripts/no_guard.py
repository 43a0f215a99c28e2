"""A script that forgot `if __name__ == "__main__":` (argument: the start method)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests._datasets import SyncNumbers

import asyncload

print("body runs", flush=True)
loader = asyncload.DataLoader(
    SyncNumbers(6), batch_size=3, num_workers=1, multiprocessing_context=sys.argv[1]
)
print([b.tolist() for b in loader])
