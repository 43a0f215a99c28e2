"""file:// URLs and plain paths over tmp_path."""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import errno
import mmap
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

import asyncload
from asyncload._exceptions import InvalidURL, NotFound, PermissionDenied, StorageError
from asyncload._storage.backends import local as _local

pytestmark = pytest.mark.usefixtures("clean_storage")

DATA = os.urandom(10_000)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "b.bin").write_bytes(DATA)
    (tmp_path / "d" / "a.bin").write_bytes(b"a")
    (tmp_path / "d" / "sub" / "c d.bin").write_bytes(b"c")
    return tmp_path


@pytest.mark.asyncio
async def test_read_plain_path_and_file_url(tree: Path) -> None:
    path = str(tree / "d" / "b.bin")
    assert await asyncload.read(path) == DATA
    assert await asyncload.read("file://" + path) == DATA
    assert await asyncload.read("file://localhost" + path) == DATA


@pytest.mark.asyncio
@pytest.mark.parametrize(("start", "end"), [(0, 10), (100, None), (None, 5), (9_990, 20_000)])
async def test_ranges(tree: Path, start: int | None, end: int | None) -> None:
    assert await asyncload.read(str(tree / "d" / "b.bin"), start=start, end=end) == DATA[start:end]


@pytest.mark.asyncio
async def test_stream(tree: Path) -> None:
    chunks = [c async for c in asyncload.stream(str(tree / "d" / "b.bin"), chunk_size=3000)]
    assert [len(c) for c in chunks] == [3000, 3000, 3000, 1000]
    assert b"".join(chunks) == DATA


@pytest.mark.asyncio
async def test_stat(tree: Path) -> None:
    info = await asyncload.stat(str(tree / "d" / "b.bin"))
    assert info.size == len(DATA)
    assert info.mtime == pytest.approx((tree / "d" / "b.bin").stat().st_mtime)


def test_list_files_plain_and_file_urls(tree: Path) -> None:
    root = str(tree / "d")
    assert asyncload.list_files(root) == [
        f"{root}/a.bin",
        f"{root}/b.bin",
        f"{root}/sub/c d.bin",
    ]
    urls = asyncload.list_files("file://" + root + "/")
    assert urls == [f"file://{root}/a.bin", f"file://{root}/b.bin", f"file://{root}/sub/c%20d.bin"]
    assert asyncload.list_files(str(tree / "nothing-here")) == []


@pytest.mark.asyncio
async def test_file_urls_from_listing_read_back(tree: Path) -> None:
    urls = await asyncload.list_files_async("file://" + str(tree / "d"))
    assert await asyncload.read(urls[-1]) == b"c"  # %20 decoded to a space


@pytest.mark.asyncio
async def test_missing_file_is_not_found(tree: Path) -> None:
    path = str(tree / "missing.bin")
    with pytest.raises(NotFound) as info:
        await asyncload.read(path)
    assert isinstance(info.value, FileNotFoundError)
    assert info.value.attempts == 1
    assert path in str(info.value)
    with pytest.raises(NotFound):
        await asyncload.stat(path)


@pytest.mark.asyncio
async def test_directory_is_an_error(tree: Path) -> None:
    with pytest.raises(StorageError, match="directory"):
        await asyncload.read(str(tree / "d"))


@pytest.mark.asyncio
async def test_remote_file_host_is_invalid() -> None:
    with pytest.raises(InvalidURL, match="local"):
        await asyncload.read("file://fileserver/share/x")


@pytest.mark.asyncio
@pytest.mark.skipif(os.geteuid() == 0, reason="root bypasses file permissions")
async def test_unreadable_file_is_permission_denied(tree: Path) -> None:
    path = tree / "d" / "b.bin"
    path.chmod(0)
    try:
        with pytest.raises(PermissionDenied):
            await asyncload.read(str(path))
    finally:
        path.chmod(0o644)


def test_permission_mapping() -> None:
    # Runs everywhere, root included: the mapping the test above exercises end to end.
    failure = _local.map_error(PermissionError(errno.EACCES, "Permission denied"))
    assert failure.kind is PermissionDenied
    assert not failure.retryable
    assert _local.map_error(OSError(errno.EIO, "I/O error")).retryable
    assert _local.map_error(OSError(errno.ENOENT, "gone")).kind is NotFound


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("url", "suggestion"),
    [
        ("http:/127.0.0.1:8000/x.bin", "http://127.0.0.1:8000/x.bin"),
        ("https:/data.example.com/x.bin", "https://data.example.com/x.bin"),
        ("s3:/bucket/key", "s3://bucket/key"),
        ("127.0.0.1:8000/x.bin", "http://127.0.0.1:8000/x.bin"),
        ("localhost:8000/x.bin", "http://localhost:8000/x.bin"),
    ],
)
async def test_url_missing_slashes_read_as_a_path_gets_a_hint(
    url: str, suggestion: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)  # relative paths resolve where nothing exists
    with pytest.raises(NotFound) as info:
        await asyncload.read(url)
    message = str(info.value)
    assert "missing" in message
    assert repr(suggestion) in message


@pytest.mark.asyncio
async def test_ordinary_missing_paths_get_no_url_hint(tree: Path) -> None:
    for path in (str(tree / "missing.bin"), "file:" + str(tree / "missing.bin"), "rel/x:1.bin"):
        with pytest.raises(NotFound) as info:
            await asyncload.read(path)
        assert "did you mean" not in str(info.value)


@pytest.mark.asyncio
async def test_stream_resume_of_a_replaced_file_is_refused(tree: Path) -> None:
    from asyncload._exceptions import ObjectChanged
    from asyncload._storage.backends.base import DEFAULT_OPTIONS, Resume
    from asyncload._storage.retry import AttemptFailed

    path = tree / "d" / "b.bin"
    resume = Resume()
    first = _local.LocalBackend().stream_version(str(path), 0, 1000, DEFAULT_OPTIONS, resume)
    assert await first.__anext__() == DATA[:1000]
    await first.aclose()
    assert resume.etag is not None
    assert resume.size == len(DATA)
    # Unchanged: the resume goes on where it stopped.
    same = _local.LocalBackend().stream_version(str(path), 1000, 1000, DEFAULT_OPTIONS, resume)
    assert await same.__anext__() == DATA[1000:2000]
    await same.aclose()
    # Replaced meanwhile (a new inode, as an atomic rename gives): refused, never spliced.
    (tree / "new.bin").write_bytes(DATA[::-1])
    os.replace(tree / "new.bin", path)
    again = _local.LocalBackend().stream_version(str(path), 1000, 1000, DEFAULT_OPTIONS, resume)
    with pytest.raises(AttemptFailed) as info:
        await again.__anext__()
    assert info.value.kind is ObjectChanged
    assert not info.value.retryable


def test_a_stream_cancelled_while_its_file_opens_leaves_it_closed(tmp_path: Path) -> None:
    """The open() runs in a thread; whichever of it and the cancelled task comes second
    closes the file (aiofiles' open left it to the garbage collector: a ResourceWarning)."""
    from asyncload._storage.backends.local import _Opening

    path = tmp_path / "f"
    path.write_bytes(b"x")
    late = _Opening(str(path))  # cancelled before the thread opened it
    late.abandon()
    assert late.run().closed
    early = _Opening(str(path))  # the thread opened it, then the task was cancelled
    f = early.run()
    assert not f.closed
    early.abandon()
    assert f.closed


class _CountingPool(concurrent.futures.ThreadPoolExecutor):
    """A loop's default executor that counts the jobs it was given."""

    jobs = 0

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        self.jobs += 1
        return super().submit(fn, *args, **kwargs)


@pytest.fixture
def inline(monkeypatch: pytest.MonkeyPatch) -> _local._Inline:
    """The local backend's inline-read state, fresh for the test."""
    fresh = _local._Inline()
    if not fresh.supported:
        pytest.skip("no preadv2(RWF_NOWAIT) here: every read is a handoff")
    monkeypatch.setattr(_local._backend, "_inline", fresh)
    return fresh


async def _jobs(reads: Callable[[], Awaitable[None]]) -> int:
    """How many executor jobs *reads* gave the running loop."""
    pool = _CountingPool(max_workers=2)
    asyncio.get_running_loop().set_default_executor(pool)
    await reads()
    return pool.jobs


@pytest.mark.asyncio
@pytest.mark.timeout(30)
@pytest.mark.usefixtures("inline")
async def test_a_cached_file_is_read_on_the_loop_and_a_large_one_in_a_thread(
    tmp_path: Path,
) -> None:
    small, large = tmp_path / "small.bin", tmp_path / "large.bin"
    small.write_bytes(DATA)  # just written: in the page cache
    big = os.urandom(_local.INLINE_MAX + 1)
    large.write_bytes(big)
    ranges = [(None, None), (0, 10), (100, None), (None, 5), (9_990, 20_000), (20_000, None)]

    async def small_reads() -> None:
        for start, end in ranges:
            assert await asyncload.read(str(small), start=start, end=end) == DATA[start:end]

    async def large_reads() -> None:
        assert await asyncload.read(str(large)) == big
        # A range of it that is small enough is read on the loop.
        assert await asyncload.read(str(large), start=5, end=1005) == big[5:1005]

    assert await _jobs(small_reads) == 0
    assert await _jobs(large_reads) == 1


def _cached_pages(fd: int, size: int) -> int:
    """How many of the file's first *size* bytes' pages are in the page cache: mincore(2) on
    a copy-on-write mapping that is never touched, so asking reads nothing in."""
    mincore = ctypes.CDLL(None, use_errno=True).mincore
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    vec = ctypes.create_string_buffer((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE)
    with mmap.mmap(fd, size, access=mmap.ACCESS_COPY) as mapping:
        view = (ctypes.c_char * size).from_buffer(mapping)
        try:
            if mincore(ctypes.addressof(view), size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
        finally:
            del view  # the mapping can't close while a view of it lives
    return sum(b & 1 for b in vec.raw)


@pytest.fixture
def found(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """What each inline read found, in order: its bytes all in the page cache, or not."""
    seen: list[bool] = []
    real = _local._Inline.found

    def recorded(self: _local._Inline, cached: bool) -> None:
        seen.append(cached)
        real(self, cached)

    monkeypatch.setattr(_local._Inline, "found", recorded)
    return seen


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_a_file_not_in_the_page_cache_is_read_in_a_thread(
    tmp_path: Path, inline: _local._Inline, found: list[bool]
) -> None:
    # The kernel's page cache, for real. A read that misses it starts the disk read (readahead)
    # before it returns EAGAIN; a disk that answers within the syscall (a VM's disk in its
    # host's cache) makes the read a hit after all. So which reads miss is the kernel's to
    # say (seen: 0 of 8 in a CI run, and 1 of 5 runs here); each miss must go to a thread, and
    # each hit stay on the loop. A run of misses, made certain, is the next test's.
    def written_and_dropped(name: str) -> Path:
        path = tmp_path / name
        path.write_bytes(DATA)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # clean pages can be dropped
            for _ in range(20):  # the kernel may keep a page through one request: ask again
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                if _cached_pages(fd, len(DATA)) == 0:
                    break
                time.sleep(0.01)
            else:
                pytest.skip("the kernel keeps this file's pages cached: no read can miss")
        finally:
            os.close(fd)
        return path

    # (Asking for a page that is not cached starts reading it in: ask of another file.)
    fd = os.open(written_and_dropped("probe.bin"), os.O_RDONLY)
    try:
        os.preadv(fd, [bytearray(10)], 0, os.RWF_NOWAIT)
        pytest.skip("this filesystem keeps files in memory (tmpfs?): no read waits")
    except BlockingIOError:
        pass
    finally:
        os.close(fd)
    cold = [written_and_dropped(f"cold-{i}.bin") for i in range(_local.MISS_STREAK)]

    async def reads() -> None:
        for path in cold:
            assert await asyncload.read(str(path)) == DATA

    assert await _jobs(reads) == found.count(False)  # tried on the loop, misses in a thread
    assert len(found) == len(cold)
    if found == [False] * len(cold):  # a run of misses: a dataset larger than memory
        assert not inline.allowed(time.monotonic())
    else:  # a hit ends a run: no reason to stop trying
        assert inline.allowed(time.monotonic())


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_a_run_of_reads_that_miss_the_page_cache_sends_reads_to_threads_for_a_while(
    tmp_path: Path, inline: _local._Inline, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The kernel's answer made certain: every read on the loop misses, as from a disk slower
    # than the syscall (the test above sees what this machine's disk does).
    real = os.preadv

    def missing(fd: int, buffers: list[bytearray], offset: int, flags: int = 0) -> int:
        if flags & os.RWF_NOWAIT:
            raise BlockingIOError(errno.EAGAIN, "not in the page cache")
        return real(fd, buffers, offset, flags)

    monkeypatch.setattr(os, "preadv", missing)
    paths = []
    for i in range(_local.MISS_STREAK + 2):
        paths.append(tmp_path / f"{i}.bin")
        paths[-1].write_bytes(DATA)

    async def reads(some: list[Path]) -> None:
        for path in some:
            assert await asyncload.read(str(path)) == DATA

    assert await _jobs(lambda: reads(paths[:1])) == 1  # tried on the loop, then in a thread
    assert inline.allowed(time.monotonic())  # one miss is no reason to stop trying
    assert await _jobs(lambda: reads(paths[1 : _local.MISS_STREAK])) == _local.MISS_STREAK - 1
    assert not inline.allowed(time.monotonic())  # a run of them is
    assert inline.allowed(time.monotonic() + _local.MISS_BACKOFF)  # tried again a while later
    monkeypatch.setattr(os, "preadv", real)
    assert await _jobs(lambda: reads(paths[_local.MISS_STREAK :])) == 2  # not tried meanwhile


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_a_slow_open_sends_reads_to_threads_for_a_while(
    tree: Path, inline: _local._Inline, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tree / "d" / "b.bin")
    monkeypatch.setattr(_local, "SLOW_OPEN", -1.0)  # every open is "slow" (a network mount)

    async def read() -> None:
        assert await asyncload.read(path) == DATA

    assert await _jobs(read) == 0  # read on the loop, and found slow: once is no sign
    assert inline.allowed(time.monotonic())
    for _ in range(_local.SLOW_STREAK - 1):
        assert await _jobs(read) == 0
    assert not inline.allowed(time.monotonic())  # slow every time: a network mount
    assert await _jobs(read) == 1  # the next one is not tried there
    assert inline.allowed(time.monotonic() + _local.SLOW_BACKOFF)  # for a while only


@pytest.mark.asyncio
@pytest.mark.timeout(30)
@pytest.mark.usefixtures("inline")
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="no /proc here")
async def test_a_file_that_says_it_is_empty_is_read_whole() -> None:
    # /proc's files report size 0 and have content: read as open().read() reads them.
    assert b"Name:" in await asyncload.read("/proc/self/status")
