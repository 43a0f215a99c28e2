"""Log ``loader.stats()`` as flat scalars, the shape TensorBoard, W&B and Lightning take.

``DataLoader.stats()`` returns a frozen ``LoaderStats`` dataclass; ``stats.as_dict("loader/")``
turns it into ``{"loader/samples_per_s": ..., "loader/retries/503": ..., "loader/bound_by/cpu":
1.0}``: one float per key, dicts spread over several keys, per-worker tuples summed. This script
reads local files with 2 workers and prints what it would log every few steps.

    python examples/log_stats.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import asyncload


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
                logged = loader.stats().as_dict("loader/")
                print(
                    f"step {step}: {len(logged)} scalars, e.g. "
                    f"samples={logged['loader/samples']:.0f} "
                    f"wait_s={logged['loader/wait_s']:.3f} "
                    f"in_flight={logged['loader/in_flight']:.0f}"
                )
        final = loader.stats().as_dict("loader/")
        assert final["loader/samples"] == 256, final
        assert final["loader/batches"] == 8, final
        assert all(isinstance(v, float) for v in final.values())
        assert sum(v for k, v in final.items() if k.startswith("loader/bound_by/")) == 1.0
        print(f"after the epoch: {sorted(final)}")


if __name__ == "__main__":
    main()
