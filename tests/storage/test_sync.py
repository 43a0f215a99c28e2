"""asyncload.read_sync: the same bytes and errors as read, with or without a running loop."""

from __future__ import annotations

import asyncio
import threading

import pytest

import asyncload
from tests._http_server import ObjectServer

DATA = bytes(range(256)) * 40


def test_read_sync_without_a_loop(http_server: ObjectServer) -> None:
    url = http_server.put("sync/a.bin", DATA)
    assert asyncload.read_sync(url) == DATA
    assert asyncload.read_sync(url, start=10, end=20) == DATA[10:20]


@pytest.mark.asyncio
async def test_read_sync_inside_a_running_loop(http_server: ObjectServer) -> None:
    # As in a notebook cell: this thread runs a loop, where asyncio.run() would refuse.
    url = http_server.put("sync/b.bin", DATA)
    asyncio.get_running_loop()
    assert asyncload.read_sync(url) == DATA
    assert await asyncload.read(url) == DATA  # the caller's loop is untouched and usable


def test_read_sync_from_threads_and_files(tmp_path, http_server: ObjectServer) -> None:
    path = tmp_path / "c.bin"
    path.write_bytes(DATA)
    url = http_server.put("sync/c.bin", DATA)
    urls = (url, str(path), path.as_uri())
    results: dict[str, bytes] = {}

    def read(u: str) -> None:
        results[u] = asyncload.read_sync(u)

    threads = [threading.Thread(target=read, args=(u,)) for u in urls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert results == dict.fromkeys(urls, DATA)


def test_read_sync_raises_the_public_error(http_server: ObjectServer) -> None:
    with pytest.raises(asyncload.NotFound) as info:
        asyncload.read_sync(http_server.url_for("sync/missing.bin"))
    assert "sync/missing.bin" in str(info.value)
    assert isinstance(info.value, FileNotFoundError)
