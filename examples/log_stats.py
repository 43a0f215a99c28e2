"""Log ``loader.stats()`` as flat scalars, the shape TensorBoard, W&B and Lightning take.

``DataLoader.stats()`` returns a frozen ``LoaderStats`` dataclass. ``flat_stats`` turns it into
``{"loader/samples_per_s": ..., "loader/retries/503": ..., "loader/in_flight/0": ...}``: one
number per key, dicts and per-worker tuples spread over several keys. This script reads local
files with 2 workers and prints what it would log every few steps.

    python examples/log_stats.py
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import asyncload


# --8<-- [start:flat_stats]
def flat_stats(stats: asyncload.LoaderStats, prefix: str = "loader/") -> dict[str, float]:
    """Every field of *stats* as a number: dicts (retries, errors, skipped) by key,
    tuples (in_flight per worker, mixed per dataset) by position, plus their totals."""
    out: dict[str, float] = {}
    for name, value in dataclasses.asdict(stats).items():
        if isinstance(value, dict):
            for key, n in value.items():
                out[f"{prefix}{name}/{key}"] = n
            out[f"{prefix}{name}"] = sum(value.values())
        elif isinstance(value, tuple):
            for i, n in enumerate(value):
                out[f"{prefix}{name}/{i}"] = n
            out[f"{prefix}{name}"] = sum(value)
        else:
            out[f"{prefix}{name}"] = value
    return out


# --8<-- [end:flat_stats]


def size(data: bytes) -> int:
    return len(data)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for i in range(256):
            (root / f"{i:03d}.bin").write_bytes(bytes(1000 + i))
        dataset = asyncload.RemoteFiles.from_prefix(str(root), decode=size)
        loader = asyncload.DataLoader(dataset, batch_size=32, num_workers=2, collate_fn=list)
        for step, _batch in enumerate(loader):
            if step % 4 == 3:
                logged = flat_stats(loader.stats())
                print(
                    f"step {step}: {len(logged)} scalars, e.g. "
                    f"samples={logged['loader/samples']:.0f} "
                    f"wait_s={logged['loader/wait_s']:.3f} "
                    f"in_flight={logged['loader/in_flight']:.0f}"
                )
        final = flat_stats(loader.stats())
        assert final["loader/samples"] == 256, final
        assert final["loader/batches"] == 8, final
        assert all(isinstance(v, (int, float)) for v in final.values())
        print(f"after the epoch: {sorted(final)}")


if __name__ == "__main__":
    main()
