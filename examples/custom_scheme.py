"""A new URL scheme: an in-memory store behind ``mem://`` URLs, read by a DataLoader.

Subclasses ``asyncload.sources.Backend`` (one attempt per call, failures raised as
``AttemptFailed``) and registers it, at module level, so that every worker process that imports
this module has it too. Then ``asyncload.read``, ``stream``, ``list_files`` and ``RemoteFiles``
work with ``mem://`` URLs, retries and stats included.

    python examples/custom_scheme.py
"""

from __future__ import annotations

import asyncio

# --8<-- [start:backend]
from collections.abc import AsyncGenerator

import asyncload
from asyncload.sources import AttemptFailed, Backend, StorageOptions, register

# The "store": in every process that imports this module, the same objects.
OBJECTS = {f"mem://store/train/{i:03d}.txt": f"sample {i}".encode() for i in range(64)}


class MemoryBackend(Backend):
    async def read(
        self, url: str, start: int | None, end: int | None, options: StorageOptions
    ) -> bytes:
        if url not in OBJECTS:
            raise AttemptFailed(asyncload.NotFound, "no such object", status=404)
        return OBJECTS[url][start or 0 : end]

    async def stream(  # an async generator, as Backend.stream returns
        self, url: str, start: int, chunk_size: int, options: StorageOptions
    ) -> AsyncGenerator[bytes, None]:
        data = await self.read(url, start, None, options)
        for i in range(0, len(data), chunk_size):
            yield data[i : i + chunk_size]

    async def stat(self, url: str, options: StorageOptions) -> asyncload.ObjectInfo:
        data = await self.read(url, None, None, options)
        return asyncload.ObjectInfo(url=url, size=len(data), etag=None, mtime=None)

    async def list(self, prefix_url: str, options: StorageOptions) -> list[str]:
        return [url for url in OBJECTS if url.startswith(prefix_url)]


register("mem", MemoryBackend())
# --8<-- [end:backend]


def decode(data: bytes) -> str:
    return data.decode()


async def show() -> None:
    print(await asyncload.read("mem://store/train/007.txt"))
    print(await asyncload.stat("mem://store/train/007.txt"))
    try:
        await asyncload.read("mem://store/nowhere.txt")
    except asyncload.NotFound as exc:
        print("missing:", exc)


def main() -> None:
    asyncio.run(show())
    dataset = asyncload.RemoteFiles.from_prefix("mem://store/train/", decode=decode)
    loader = asyncload.DataLoader(dataset, batch_size=16, num_workers=2, collate_fn=list)
    samples = [s for batch in loader for s in batch]
    assert samples == [f"sample {i}" for i in range(64)], samples
    print(f"DataLoader epoch over mem:// URLs: {len(samples)} samples in 2 worker processes")


if __name__ == "__main__":
    main()
