"""Reads URLs through the local cache in a separate process (tests/storage/test_cache.py runs it).

    python tests/_cache_script.py read URL...      read all concurrently; print "ok N"
    python tests/_cache_script.py stall-write URL  start storing URL, print WRITING, then hang
                                                   mid-write (the test SIGKILLs it there)

The cache directory comes from ASYNCLOAD_CACHE_DIR.
"""

from __future__ import annotations

import asyncio
import sys
import time

import asyncload
from asyncload._storage import cache_dir as _cache_dir


async def read_all(urls: list[str]) -> int:
    try:
        got = await asyncio.gather(*(asyncload.read(u) for u in urls))
    finally:
        await asyncload.aclose()
    return sum(len(b) for b in got)


def main() -> None:
    mode, urls = sys.argv[1], sys.argv[2:]
    if mode == "stall-write":
        real = _cache_dir._write_chunk
        calls = [0]

        def stalled(fd: int, data: memoryview) -> None:
            calls[0] += 1
            if calls[0] == 2:  # the header is written, the body is not
                real(fd, data[: len(data) // 2])
                print("WRITING", flush=True)
                time.sleep(60)  # bounded: the test kills this process long before
            real(fd, data)

        _cache_dir._write_chunk = stalled  # type: ignore[assignment]
    total = asyncio.run(read_all(urls))
    print(f"ok {total}", flush=True)


if __name__ == "__main__":
    main()
