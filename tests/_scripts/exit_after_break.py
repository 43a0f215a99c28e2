"""``break`` out of a persistent-worker loader, then let the interpreter exit: quickly, quietly."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
warnings.simplefilter("ignore")  # pin_memory without an accelerator warns; not the point

from tests._datasets import SyncNumbers  # noqa: E402

import asyncload  # noqa: E402

if __name__ == "__main__":
    loader = asyncload.DataLoader(
        SyncNumbers(10**6, delay=0.001),
        batch_size=4,
        num_workers=2,
        persistent_workers=True,
        pin_memory=True,
    )
    for _ in loader:
        break
    print("done", flush=True)
