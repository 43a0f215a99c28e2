"""The local cache of whole objects, against the real loopback server and real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import asyncload
from asyncload._storage import api as _storage
from asyncload._storage import cache as _cache

from .._http_server import ObjectServer

pytestmark = [pytest.mark.asyncio, pytest.mark.usefixtures("clean_storage")]

SCRIPT = Path(__file__).resolve().parents[1] / "_cache_script.py"
ROOT = Path(__file__).resolve().parents[2]


def body(i: int, size: int = 10_000) -> bytes:
    return (i.to_bytes(4, "big") * (size // 4 + 1))[:size]


def dir_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in (root / "objects").rglob("*") if p.is_file())


def entries(root: Path) -> list[Path]:
    return [p for p in (root / "objects").rglob("*") if p.is_file()]


def script(*args: str, cache: Path) -> subprocess.Popen[str]:
    env = {**os.environ, _cache.ENV_VAR: str(cache), "PYTHONPATH": str(ROOT / "src")}
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


async def read_each(urls: list[str]) -> list[bytes]:
    return [await asyncload.read(url) for url in urls]


async def test_a_second_read_is_a_hit_and_ranges_come_from_it(
    http_server: ObjectServer, tmp_path: Path
) -> None:
    _storage.configure(http_server.url, cache_dir=str(tmp_path))
    url = http_server.put("a.bin", body(1))
    assert await asyncload.read(url) == body(1)
    assert await asyncload.read(url) == body(1)
    assert await asyncload.read(url, start=10, end=30) == body(1)[10:30]
    assert await asyncload.read(url, start=9990) == body(1)[9990:]
    chunks = [c async for c in asyncload.stream(url, chunk_size=3000)]
    assert b"".join(chunks) == body(1)
    assert len(chunks) == 4
    assert http_server.hits["a.bin"] == 1
    assert _cache.counts() == _cache.CacheCounts(hits=4, misses=1)


async def test_a_streamed_object_is_written_through_and_streamed_back(
    http_server: ObjectServer, tmp_path: Path
) -> None:
    _storage.configure(http_server.url, cache_dir=str(tmp_path), cache_max_bytes=10**6)
    data = body(6, 300_000)
    url = http_server.put("st.bin", data)
    first = [c async for c in asyncload.stream(url, chunk_size=65536)]
    assert b"".join(first) == data
    again = [c async for c in asyncload.stream(url, chunk_size=65536)]
    assert b"".join(again) == data
    assert await asyncload.read(url, start=5, end=99) == data[5:99]
    assert http_server.hits["st.bin"] == 1
    assert not list((tmp_path / "tmp").iterdir())


async def test_a_stream_stopped_early_leaves_no_entry(
    http_server: ObjectServer, tmp_path: Path
) -> None:
    _storage.configure(http_server.url, cache_dir=str(tmp_path))
    data = body(8, 3_000_000)  # more than the bounded tail read after an early close
    url = http_server.put("half.bin", data)
    chunks = asyncload.stream(url, chunk_size=65536)
    got = await chunks.__anext__()  # type: ignore[attr-defined]
    await chunks.aclose()  # type: ignore[attr-defined]
    assert got == data[: len(got)]
    assert entries(tmp_path) == []
    assert not list((tmp_path / "tmp").iterdir())
    assert await asyncload.read(url) == data
    assert http_server.hits["half.bin"] == 2


async def test_tar_shards_read_through_the_cache(http_server: ObjectServer, tmp_path: Path) -> None:
    from ..datasets.test_tar import collect, serve_shards

    _storage.configure(http_server.url, cache_dir=str(tmp_path))
    urls = serve_shards(http_server, 3, 5)
    ds = asyncload.TarShards(urls, shuffle_shards=False)
    first = await collect(ds)
    second = await collect(ds)
    assert len(first) == 15
    assert [s["__key__"] for s in second] == [s["__key__"] for s in first]
    assert [http_server.hits[f"shards/{i:03d}.tar"] for i in range(3)] == [1, 1, 1]


async def test_the_environment_variable_turns_the_cache_on(
    http_server: ObjectServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(_cache.ENV_VAR, str(tmp_path))
    url = http_server.put("e.bin", body(2))
    for _ in range(3):
        assert await asyncload.read(url) == body(2)
    assert http_server.hits["e.bin"] == 1
    assert len(entries(tmp_path)) == 1


async def test_concurrent_misses_in_one_process_fetch_once(
    http_server: ObjectServer, tmp_path: Path
) -> None:
    import asyncio

    _storage.configure(http_server.url, cache_dir=str(tmp_path))
    http_server.latency = 0.05
    url = http_server.put("c.bin", body(3))
    got = await asyncio.gather(*(asyncload.read(url) for _ in range(10)))
    assert got == [body(3)] * 10
    assert http_server.hits["c.bin"] == 1


async def test_revalidation_refetches_a_changed_object(
    http_server: ObjectServer, tmp_path: Path
) -> None:
    _storage.configure(http_server.url, cache_dir=str(tmp_path), cache_revalidate=True)
    url = http_server.put("v.bin", body(4))
    assert await asyncload.read(url) == body(4)
    assert await asyncload.read(url) == body(4)
    http_server.put("v.bin", body(5))  # same size, another ETag
    assert await asyncload.read(url) == body(5)
    assert await asyncload.read(url) == body(5)
    gets = http_server.hits["v.bin"]  # HEADs and GETs
    assert gets == 2 + 4  # two fetches, and one HEAD per read


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_two_processes_sharing_a_directory_fetch_each_object_once(
    http_server: ObjectServer, tmp_path: Path
) -> None:
    http_server.latency = 0.1  # both processes are in flight at once
    urls = [http_server.put(f"p/{i}", body(i)) for i in range(40)]
    procs = [script("read", *urls, cache=tmp_path) for _ in range(2)]
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert out.strip() == f"ok {40 * 10_000}"
    assert [http_server.hits[f"p/{i}"] for i in range(40)] == [1] * 40
    assert len(entries(tmp_path)) == 40


async def test_eviction_keeps_the_directory_under_its_cap(
    http_server: ObjectServer, tmp_path: Path
) -> None:
    cap = 55_000  # room for five 10 KB entries
    _storage.configure(http_server.url, cache_dir=str(tmp_path), cache_max_bytes=cap)
    urls = [http_server.put(f"ev/{i}", body(i)) for i in range(20)]
    for i, url in enumerate(urls):
        assert await asyncload.read(url) == body(i)
        assert dir_bytes(tmp_path) <= cap
    assert 3 <= len(entries(tmp_path)) <= 5
    # The most recent object is still cached; the first was evicted.
    assert await asyncload.read(urls[-1]) == body(19)
    assert http_server.hits["ev/19"] == 1
    assert await asyncload.read(urls[0]) == body(0)
    assert http_server.hits["ev/0"] == 2
    assert dir_bytes(tmp_path) <= cap


@pytest.mark.slow
@pytest.mark.timeout(90)
async def test_a_process_killed_mid_write_leaves_no_entry(
    http_server: ObjectServer, tmp_path: Path
) -> None:
    url = http_server.put("k.bin", body(9, 100_000))
    proc = script("stall-write", url, cache=tmp_path)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "WRITING"
        assert list((tmp_path / "tmp").iterdir())  # a partial file exists...
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
    assert entries(tmp_path) == []  # ...but no entry
    _storage.configure(http_server.url, cache_dir=str(tmp_path))
    assert await asyncload.read(url) == body(9, 100_000)
    assert http_server.hits["k.bin"] == 2  # a miss: fetched again, not read from the partial
    assert await asyncload.read(url) == body(9, 100_000)
    assert http_server.hits["k.bin"] == 2


async def test_an_unusable_directory_degrades_with_one_warning(
    http_server: ObjectServer, tmp_path: Path
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")
    _storage.configure(http_server.url, cache_dir=str(blocker / "cache"))
    urls = [http_server.put(f"u/{i}", body(i)) for i in range(3)]
    with pytest.warns(asyncload.CacheWarning, match="cannot be used") as caught:
        got = await read_each(urls * 2)
    assert got == [body(i) for i in range(3)] * 2
    assert len(caught) == 1
    assert sum(http_server.hits[f"u/{i}"] for i in range(3)) == 6


@pytest.mark.skipif(os.geteuid() == 0, reason="root bypasses file permissions")
async def test_a_read_only_directory_degrades_with_one_warning(
    http_server: ObjectServer, tmp_path: Path
) -> None:
    cache = tmp_path / "ro"
    cache.mkdir()
    cache.chmod(0o555)
    try:
        _storage.configure(http_server.url, cache_dir=str(cache))
        url = http_server.put("ro.bin", body(1))
        with pytest.warns(asyncload.CacheWarning) as caught:
            got = await read_each([url] * 3)
        assert got == [body(1)] * 3
        assert len(caught) == 1
    finally:
        cache.chmod(0o755)


async def test_cache_options_are_checked() -> None:
    with pytest.raises(ValueError, match="cache_max_bytes"):
        asyncload.StorageOptions(cache_max_bytes=0)
