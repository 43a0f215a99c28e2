"""Read local files by path and by file:// URL, then run an epoch with RemoteFiles.

python examples/read_local.py
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import asyncload


def decode(data: bytes) -> int:
    # Module level, so forkserver/spawn workers can unpickle it.
    return len(data)


async def show(root: Path) -> None:
    path = root / "000.bin"
    print("read:", await asyncload.read(str(path), end=8))
    print("stat:", await asyncload.stat(path.as_uri()))
    chunks = [c async for c in asyncload.stream(str(path), chunk_size=256)]
    print("stream:", len(chunks), "chunks")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for i in range(32):
            (root / f"{i:03d}.bin").write_bytes(bytes([i]) * (1000 + i))
        asyncio.run(show(root))
        dataset = asyncload.RemoteFiles.from_prefix(root.as_uri(), decode=decode)
        loader = asyncload.DataLoader(dataset, batch_size=8, num_workers=2, collate_fn=list)
        sizes = [size for batch in loader for size in batch]
        assert sizes == [1000 + i for i in range(32)], sizes
        print(f"DataLoader epoch: {len(sizes)} files, {sum(sizes)} bytes")


if __name__ == "__main__":
    main()
