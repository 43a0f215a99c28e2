"""A collate_fn defined under the main guard: spawn/forkserver workers can't unpickle it."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests._datasets import SyncNumbers

import asyncload


def top_level_collate(batch: list[int]) -> list[int]:
    return list(batch)


if __name__ == "__main__":

    def guarded_collate(batch: list[int]) -> list[int]:
        return list(batch)

    collate = top_level_collate if sys.argv[2] == "top" else guarded_collate
    loader = asyncload.DataLoader(
        SyncNumbers(6),
        batch_size=3,
        num_workers=1,
        collate_fn=collate,
        multiprocessing_context=sys.argv[1],
    )
    print(list(loader))
