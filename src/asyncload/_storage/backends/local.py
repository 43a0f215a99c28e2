"""``file://`` URLs and plain paths, read without blocking the event loop.

A whole or ranged read of up to ``INLINE_MAX`` bytes that the page cache holds is done on the
loop itself (``_read_cached``: ``preadv2(RWF_NOWAIT)`` never waits for a disk); any other is
one job in the loop's default executor (open, seek, read, close in a single hop: four aiofiles
hops would cost four thread handoffs per sample). The handoff, not the read, was most of the
loader's own CPU over local files: ~40 us a sample against ~5 us for a cached read, so that
asyncload spent 0.14-0.16 ms of CPU a 2 KB text sample where torch spent 0.10 (issue #32).
``SLOW_STREAK`` inline reads in a row that took more than ``SLOW_OPEN`` each (the opens of a
network or FUSE mount) send every read to the executor for ``SLOW_BACKOFF`` seconds: such opens
would stall the loop. (One slow read is no sign: a busy machine preempts a worker now and then,
and a 5 us read preempted looked like a slow mount, and halved a text pipeline.) Streaming keeps
the file open between chunks, each read a hop to the executor; it opens the file through
``_Opening``, which never leaves a file open when the stream is cancelled while the open()
runs in its thread (aiofiles' open would: the file comes back to no one). Listing walks the
tree in a thread.

``file://host/...`` is only accepted for ``localhost``; a network share is mounted, then read by
its local path.
"""

from __future__ import annotations

import asyncio
import errno
import os
import re
import stat
import threading
import time
from collections.abc import AsyncGenerator
from typing import BinaryIO
from urllib.parse import quote, unquote, urlsplit

import aiofiles.os

from ..._exceptions import InvalidURL, NotFound, ObjectChanged, PermissionDenied, StorageError
from ..retry import AttemptFailed
from .base import Backend, ObjectInfo, Resume, StorageOptions, register, registered_schemes

__all__ = ["LocalBackend", "map_error", "to_path"]


def to_path(url: str) -> str:
    """The filesystem path of a ``file://`` URL or a plain path."""
    if not url.startswith(("file:", "FILE:")):
        return os.path.expanduser(url)
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise AttemptFailed(
            InvalidURL, "file:// URLs must be local (file:///path or file://localhost/path)"
        )
    return unquote(parts.path)


# `http:/host/x`, `s3:bucket/k`: a scheme with fewer than two slashes.
_SCHEME_SHORT = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):/?(?!/)")
# `127.0.0.1:8000/x`, `localhost:8000/x`, `[::1]:80/x`, `data.example.com:443/x`.
_HOST_PORT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):\d{1,5}(/|$)")


def url_hint(url: str) -> str:
    """A hint when a "path" that was not found looks like a URL missing its ``//``."""
    short = _SCHEME_SHORT.match(url)
    if short is not None and short.group(1).lower() in registered_schemes():
        scheme = short.group(1).lower()
        if scheme not in ("", "file"):
            fixed = f"{scheme}://{url[short.end() :]}"
            return f"; {url!r} looks like a URL missing '//': did you mean {fixed!r}?"
    if _HOST_PORT.match(url):
        return (
            f"; {url!r} was read as a local path, but it looks like a URL missing its scheme: "
            f"did you mean 'http://{url}'?"
        )
    return ""


def map_error(exc: OSError, url: str = "") -> AttemptFailed:
    """Translate an OSError from one local operation on *url*."""
    if isinstance(exc, FileNotFoundError) or exc.errno in (errno.ENOENT, errno.ENOTDIR):
        return AttemptFailed(NotFound, f"no such file: {exc.strerror or exc}{url_hint(url)}")
    if isinstance(exc, PermissionError) or exc.errno in (errno.EACCES, errno.EPERM):
        return AttemptFailed(
            PermissionDenied,
            f"permission denied: {exc.strerror or exc}; check the file's mode and owner, "
            "and which user the DataLoader workers run as",
        )
    if isinstance(exc, IsADirectoryError):
        return AttemptFailed(StorageError, "is a directory, not a file")
    # EIO and friends on network mounts can be transient; everything else is final.
    transient = exc.errno in (errno.EIO, errno.EAGAIN, errno.ETIMEDOUT, errno.ESTALE)
    return AttemptFailed(StorageError, f"{exc}", retryable=transient, reason="io")


# Inline reads, at most this many bytes: copying more from the page cache takes longer than
# a handoff costs, and holds up the loop's other samples meanwhile.
INLINE_MAX = 256 << 10
# This many inline reads in a row that each took longer than SLOW_OPEN (their opens, on a
# network mount) ...
SLOW_STREAK = 2
SLOW_OPEN = 0.001
# ... send reads to the executor for this many seconds.
SLOW_BACKOFF = 30.0
# This many inline reads in a row that found their bytes not in the page cache (a dataset
# larger than memory, read from disk) send reads to the executor for MISS_BACKOFF seconds: each
# such try costs an open, an fstat and a buffer on the loop before the thread reads anyway.
MISS_STREAK = 8
MISS_BACKOFF = 1.0
_NOWAIT = getattr(os, "RWF_NOWAIT", None)  # Linux 4.14+; elsewhere every read is a handoff


class _Inline:
    """Whether reads may be tried on the loop now. Per process, as the backend is: one page
    cache and one set of mounts per machine; a network mount's slow opens slow every loop."""

    __slots__ = ("misses", "slow", "supported", "until")

    def __init__(self) -> None:
        self.supported = _NOWAIT is not None
        self.until = 0.0  # the executor only, until then (time.monotonic)
        self.slow = 0  # inline reads in a row slower than SLOW_OPEN
        self.misses = 0  # inline reads in a row that found their bytes not cached

    def allowed(self, now: float) -> bool:
        return self.supported and now >= self.until

    def took(self, began: float, now: float) -> None:
        """An inline read ran from *began* to *now*."""
        if now - began <= SLOW_OPEN:
            self.slow = 0
            return
        self.slow += 1
        if self.slow >= SLOW_STREAK:
            self.slow = 0
            self.until = max(self.until, now + SLOW_BACKOFF)

    def found(self, cached: bool) -> None:
        """An inline read found its bytes in the page cache, or not."""
        if cached:
            self.misses = 0
            return
        self.misses += 1
        if self.misses >= MISS_STREAK:
            self.misses = 0
            self.until = max(self.until, time.monotonic() + MISS_BACKOFF)


def _read_cached(path: str, start: int | None, end: int | None, inline: _Inline) -> bytes | None:
    """The bytes ``_read_range`` would return, if the page cache holds them all and they are
    at most ``INLINE_MAX``; ``None`` otherwise (read them in the executor). Raises the
    ``OSError`` of a missing or unreadable file, as ``_read_range`` does."""
    assert _NOWAIT is not None
    # O_NONBLOCK: a FIFO's open would wait for a writer (it changes nothing for a file).
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        # A directory, a FIFO, a file that says it is empty (/proc's are not): as before.
        if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
            return None
        first = start or 0
        n = max(0, min(st.st_size if end is None else end, st.st_size) - first)
        if n > INLINE_MAX:
            return None
        if n == 0:
            return b""
        buf = bytearray(n)
        try:
            got = os.preadv(fd, [buf], first, _NOWAIT)
        except BlockingIOError:  # not in the page cache: a disk read, in a thread
            inline.found(False)
            return None
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # this filesystem can't say
                inline.supported = False
                return None
            raise
        inline.found(got == n)  # partly cached: the rest from the disk
        return bytes(buf) if got == n else None
    finally:
        os.close(fd)


def _read_range(path: str, start: int | None, end: int | None) -> bytes:
    with open(path, "rb") as f:
        if start:
            f.seek(start)
        if end is None:
            return f.read()
        return f.read(max(0, end - (start or 0)))


def _walk(root: str) -> list[str]:
    found: list[str] = []

    def fail(exc: OSError) -> None:
        raise exc

    if os.path.isfile(root):
        return [root]
    if not os.path.isdir(root):
        return []
    for dirpath, _dirs, files in os.walk(root, onerror=fail, followlinks=False):
        found.extend(os.path.join(dirpath, name) for name in files)
    return found


class LocalBackend(Backend):
    """Backend for ``file://`` URLs and plain paths.

    Examples:
        >>> head = await asyncload.read("/data/shard-01.tar", end=512)  # doctest: +SKIP
    """

    def __init__(self) -> None:
        self._inline = _Inline()

    async def read(
        self, url: str, start: int | None, end: int | None, options: StorageOptions
    ) -> bytes:
        path = to_path(url)
        inline = self._inline
        try:
            began = time.monotonic()
            if inline.allowed(began):
                data = _read_cached(path, start, end, inline)
                inline.took(began, time.monotonic())
                if data is not None:
                    return data
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(None, _read_range, path, start, end)
        except OSError as exc:
            raise map_error(exc, url) from exc

    def stream(
        self, url: str, start: int, chunk_size: int, options: StorageOptions
    ) -> AsyncGenerator[bytes, None]:
        return self._stream(url, start, chunk_size, None)

    def stream_version(
        self, url: str, start: int, chunk_size: int, options: StorageOptions, resume: Resume
    ) -> AsyncGenerator[bytes, None]:
        return self._stream(url, start, chunk_size, resume)

    async def _stream(
        self, url: str, start: int, chunk_size: int, resume: Resume | None
    ) -> AsyncGenerator[bytes, None]:
        path = to_path(url)
        loop = asyncio.get_running_loop()
        opening = _Opening(path)
        try:
            try:
                f = await loop.run_in_executor(None, opening.run)
            except asyncio.CancelledError:
                opening.abandon()
                raise
            try:
                if resume is not None:
                    # Files have no ETag: inode, size and mtime name the version opened.
                    st = os.fstat(f.fileno())
                    version = f"{st.st_ino:x}-{st.st_size:x}-{st.st_mtime_ns:x}"
                    if resume.etag is None or not start:
                        resume.etag, resume.size = version, st.st_size
                    elif version != resume.etag:
                        raise AttemptFailed(
                            ObjectChanged,
                            f"the file was replaced or modified while it was being streamed; "
                            f"{start} bytes of the old version were already delivered, so it "
                            "was not resumed with the new one: read it again from the start",
                            status=412,
                        )
                if start:
                    f.seek(start)  # no I/O: the next read starts there
                while chunk := await loop.run_in_executor(None, f.read, chunk_size):
                    yield chunk
            finally:
                f.close()
        except OSError as exc:
            raise map_error(exc, url) from exc

    async def stat(self, url: str, options: StorageOptions) -> ObjectInfo:
        try:
            st = await aiofiles.os.stat(to_path(url))
        except OSError as exc:
            raise map_error(exc, url) from exc
        return ObjectInfo(url=url, size=st.st_size, etag=None, mtime=st.st_mtime)

    async def list(self, prefix_url: str, options: StorageOptions) -> list[str]:
        root = to_path(prefix_url)
        loop = asyncio.get_running_loop()
        try:
            paths = await loop.run_in_executor(None, _walk, root)
        except OSError as exc:
            raise map_error(exc, prefix_url) from exc
        if prefix_url.startswith(("file:", "FILE:")):
            # _walk joined onto an absolute root, so these are absolute already.
            return ["file://" + quote(p) for p in paths]
        return paths


_backend = LocalBackend()
register("file", _backend)
register("", _backend)


class _Opening:
    """``open(path, "rb")`` in a thread, for a task that may be cancelled meanwhile: whichever
    of ``run`` (the thread) and ``abandon`` (the cancelled task) comes second closes the file."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._file: BinaryIO | None = None
        self._abandoned = False

    def run(self) -> BinaryIO:
        f = open(self._path, "rb")  # closed by the stream, or by abandon()
        with self._lock:
            if self._abandoned:
                f.close()
            else:
                self._file = f
        return f

    def abandon(self) -> None:
        with self._lock:
            self._abandoned = True
            if self._file is not None:
                self._file.close()
