"""Mix three local datasets with weights, then resume a pass exactly from a checkpoint.

python examples/mix_datasets.py
"""

from __future__ import annotations

import collections
import tempfile
from pathlib import Path

import asyncload


def label(data: bytes) -> str:
    # Module level, so forkserver/spawn workers can unpickle it.
    return data.decode()


def folder(root: Path, name: str, n: int) -> asyncload.RemoteFiles:
    (root / name).mkdir()
    for i in range(n):
        (root / name / f"{i:04d}.txt").write_text(name)
    return asyncload.RemoteFiles.from_prefix((root / name).as_uri(), decode=label)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        parts = [folder(root, "web", 400), folder(root, "code", 100), folder(root, "math", 50)]

        def make() -> asyncload.DataLoader[list[str]]:
            mix = asyncload.Mix(parts, [0.6, 0.3, 0.1], seed=7, samples=2000)
            return asyncload.DataLoader(mix, batch_size=50, num_workers=2, collate_fn=list)

        whole = [s for batch in make() for s in batch]
        counts = collections.Counter(whole)
        print("samples:", len(whole), {k: round(v / len(whole), 3) for k, v in counts.items()})

        loader = make()
        it = iter(loader)
        before = [s for _, batch in zip(range(15), it, strict=False) for s in batch]
        state = loader.state_dict()  # a checkpoint mid-epoch
        del it
        resumed = make()
        resumed.load_state_dict(state)
        after = [s for batch in resumed for s in batch]
        assert collections.Counter(before + after) == counts, "resume changed the pass"
        print(f"resumed after {len(before)} samples: {len(after)} more, the same pass exactly")


if __name__ == "__main__":
    main()
