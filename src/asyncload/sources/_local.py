"""``file://`` URLs and plain paths, read without blocking the event loop.

Whole and ranged reads are one job in the loop's default executor (open, seek, read, close in a
single hop: four aiofiles hops would cost four thread handoffs per sample). Streaming uses
aiofiles, whose handle keeps the file open between chunks. Listing walks the tree in a thread.

``file://host/...`` is only accepted for ``localhost``; a network share is mounted, then read by
its local path.
"""

from __future__ import annotations

import asyncio
import errno
import os
from collections.abc import AsyncGenerator
from urllib.parse import quote, unquote, urlsplit

import aiofiles
import aiofiles.os

from .._exceptions import InvalidURL, NotFound, PermissionDenied, StorageError
from .._retry import AttemptFailed
from ._base import Backend, ObjectInfo, StorageOptions, register

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


def map_error(exc: OSError) -> AttemptFailed:
    """Translate an OSError from one local operation."""
    if isinstance(exc, FileNotFoundError) or exc.errno in (errno.ENOENT, errno.ENOTDIR):
        return AttemptFailed(NotFound, f"no such file: {exc.strerror or exc}")
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

    async def read(
        self, url: str, start: int | None, end: int | None, options: StorageOptions
    ) -> bytes:
        path = to_path(url)
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(None, _read_range, path, start, end)
        except OSError as exc:
            raise map_error(exc) from exc

    async def stream(
        self, url: str, start: int, chunk_size: int, options: StorageOptions
    ) -> AsyncGenerator[bytes, None]:
        path = to_path(url)
        try:
            async with aiofiles.open(path, "rb") as f:
                if start:
                    await f.seek(start)
                while chunk := await f.read(chunk_size):
                    yield chunk
        except OSError as exc:
            raise map_error(exc) from exc

    async def stat(self, url: str, options: StorageOptions) -> ObjectInfo:
        try:
            st = await aiofiles.os.stat(to_path(url))
        except OSError as exc:
            raise map_error(exc) from exc
        return ObjectInfo(url=url, size=st.st_size, etag=None, mtime=st.st_mtime)

    async def list(self, prefix_url: str, options: StorageOptions) -> list[str]:
        root = to_path(prefix_url)
        loop = asyncio.get_running_loop()
        try:
            paths = await loop.run_in_executor(None, _walk, root)
        except OSError as exc:
            raise map_error(exc) from exc
        if prefix_url.startswith(("file:", "FILE:")):
            # _walk joined onto an absolute root, so these are absolute already.
            return ["file://" + quote(p) for p in paths]
        return paths


_backend = LocalBackend()
register("file", _backend)
register("", _backend)
