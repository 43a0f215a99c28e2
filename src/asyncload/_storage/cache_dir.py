"""The on-disk side of the local cache: entries, their atomic writing, and LRU eviction.

Layout under the cache directory::

    objects/ab/abcdef…      one entry per URL (sha256 of the URL): a header, then the body
    tmp/                    entries being written; renamed into objects/ when complete
    locks/abcdef….lock      held (flock) by the one process fetching that object
    .lock, usage            the byte count of the directory, updated under .lock

An entry's header is ``magic, body size, ETag length`` and the ETag; an entry whose file size
disagrees with its header is never returned (and is removed). ``_cache`` decides
when to read and write; this module only knows files.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import time
from collections.abc import AsyncGenerator

__all__ = ["CacheDir", "Sink"]

_MAGIC = b"ALC1"
_HEAD = struct.Struct("<4sQH")  # magic, body size, ETag length (the ETag follows)
_HEAD_READ = 256  # bytes read for the header: room for the usual ETag (a longer one: a 2nd read)
_TOUCH_EVERY = 10.0  # seconds: an entry's mtime is refreshed at most this often
_TOUCHED_MAX = 1 << 16  # entries whose last touch a process remembers
_STALE_TMP = 3600.0  # a temporary file this old belongs to a process that died
_LOW_WATER = 0.9  # eviction frees down to this fraction of the cap
_WRITE_CHUNK = 4 << 20
# Errors that say the directory cannot take entries at all (others skip one entry).
UNUSABLE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})


def _open_entry(path: str) -> int | None:
    try:
        return os.open(path, os.O_RDONLY)
    except OSError:  # no such entry (or unreadable: the same, a miss)
        return None


def _header(fd: int) -> tuple[int, int, str | None]:
    """(body offset, body size, etag) from the header of the entry open as *fd*."""
    head = os.pread(fd, _HEAD_READ, 0)
    magic, size, elen = _HEAD.unpack_from(head)
    offset = _HEAD.size + elen
    if offset > len(head):  # a long ETag
        head = os.pread(fd, offset, 0)
    if magic != _MAGIC or len(head) < offset:
        raise ValueError("a foreign entry")
    return offset, size, (head[_HEAD.size : offset].decode() if elen else None)


def _write_chunk(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data) :]


class _Locked:
    """An exclusive flock on a file, as a context manager (blocking)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = -1

    def __enter__(self) -> _Locked:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)  # closing releases the lock


class CacheDir:
    """One cache directory on disk, shared by every process that names it."""

    def __init__(self, root: str, max_bytes: int | None) -> None:
        self.root = os.path.abspath(os.path.expanduser(root))
        self.max_bytes = max_bytes
        self._ready = False
        # Every hit builds its entry's path: one concatenation, not os.path.join's checks.
        self._objects = os.path.join(self.root, "objects", "")
        # Entries this process touched since _touched_since (at most _TOUCH_EVERY ago).
        self._touched: set[str] = set()
        self._touched_since = time.monotonic()

    def setup(self) -> None:
        if not self._ready:
            for sub in ("objects", "tmp", "locks"):
                os.makedirs(os.path.join(self.root, sub), exist_ok=True)
            self._ready = True

    def path(self, key: str) -> str:
        return f"{self._objects}{key[:2]}/{key}"

    def open(self, key: str) -> tuple[int, int, int, str | None] | None:
        """(fd, body offset, body size, etag) of a complete entry, or ``None``."""
        path = self.path(key)
        fd = _open_entry(path)
        if fd is None:
            return None
        try:
            offset, size, etag = self._check(fd, key)
            return fd, offset, size, etag
        except (OSError, ValueError, struct.error):
            os.close(fd)
            unlink(path)  # never returned; make room for a good copy
            return None
        except BaseException:
            os.close(fd)
            raise

    def read(self, key: str, start: int | None, end: int | None, most: int) -> bytes | int | None:
        """Bytes ``[start, end)`` of a complete entry in one call (open, check, read, close:
        the hit path), ``None`` when there is none, or the byte count when it exceeds *most*."""
        if start is not None or end is not None:
            return self._read_range(key, start, end, most)
        # The usual case, the whole object, in four syscalls: open, header, body, close. The
        # body read asks for one byte more, so that its length also proves the file complete
        # (neither shorter nor longer than the header says) without an fstat.
        path = self.path(key)
        fd = _open_entry(path)
        if fd is None:
            return None
        try:
            offset, size, _ = _header(fd)
            if size > most:
                return size
            data = os.pread(fd, size + 1, offset)
            if len(data) != size:
                raise ValueError("truncated or foreign entry")
            self._touch(key, fd)
            return data
        except (OSError, ValueError, struct.error):
            unlink(path)
            return None
        finally:
            os.close(fd)

    def _read_range(
        self, key: str, start: int | None, end: int | None, most: int
    ) -> bytes | int | None:
        found = self.open(key)
        if found is None:
            return None
        fd, offset, size, _ = found
        try:
            first = min(start or 0, size)
            n = max(0, (size if end is None else min(end, size)) - first)
            if n > most:
                return n
            data = os.pread(fd, n, offset + first)
            return data if len(data) == n else None
        except OSError:
            unlink(self.path(key))
            return None
        finally:
            os.close(fd)

    def _check(self, fd: int, key: str) -> tuple[int, int, str | None]:
        """(body offset, body size, etag) of the entry open as *fd*; raises if incomplete."""
        offset, size, etag = _header(fd)
        if os.fstat(fd).st_size != offset + size:
            raise ValueError("truncated or foreign entry")
        self._touch(key, fd)
        return offset, size, etag

    def _touch(self, key: str, fd: int) -> None:
        """LRU: set the entry's mtime, about once per ``_TOUCH_EVERY`` seconds per process.

        Remembered here rather than read back with an fstat: one syscall less on every hit.
        The set starts afresh every interval (so it holds only what was used in the last one):
        an entry used across a fresh start is touched twice in a row, which costs one syscall.
        Best effort: an entry that can't be touched (another user's) is still read.
        """
        now = time.monotonic()
        if now - self._touched_since >= _TOUCH_EVERY or len(self._touched) >= _TOUCHED_MAX:
            self._touched.clear()
            self._touched_since = now
        if key in self._touched:
            return
        self._touched.add(key)
        try:
            os.utime(fd)
        except OSError:
            pass

    # -- writing an entry -------------------------------------------------------------------
    def store(self, key: str, data: bytes, etag: str | None) -> OSError | None:
        """Write one entry (in a thread); the error that makes the directory unusable, if any."""
        tag = (etag or "").encode()[:2048]
        head = _HEAD.pack(_MAGIC, len(data), len(tag)) + tag
        total = len(head) + len(data)
        if self.max_bytes is not None and total > self.max_bytes:
            return None  # larger than the whole cache: not worth evicting everything for
        tmp = os.path.join(self.root, "tmp", f"{key}.{os.getpid()}.{id(data):x}.tmp")
        reserved = False
        try:
            reserved = self.reserve(total)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                _write_chunk(fd, memoryview(head))
                view = memoryview(data)
                for i in range(0, len(view), _WRITE_CHUNK):
                    _write_chunk(fd, view[i : i + _WRITE_CHUNK])
            finally:
                os.close(fd)
            os.makedirs(os.path.dirname(self.path(key)), exist_ok=True)
            os.replace(tmp, self.path(key))
        except OSError as exc:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            if reserved:
                self.reserve(-total)
            if exc.errno in UNUSABLE:
                return exc
            # Anything else (a racing eviction removed a directory...): this entry is skipped.
        return None

    def reserve(self, n: int) -> bool:
        """Account *n* bytes (negative: give back) against the cap, evicting to make room."""
        if self.max_bytes is None:
            return False
        with _Locked(os.path.join(self.root, ".lock")):
            usage_path = os.path.join(self.root, "usage")
            try:
                with open(usage_path) as f:
                    usage = int(f.read() or "0")
            except (OSError, ValueError):
                usage = self.evict(None)
            if n > 0 and usage + n > self.max_bytes:
                usage = self.evict(int(self.max_bytes * _LOW_WATER) - n)
            usage = max(0, usage + n)
            with open(usage_path, "w") as f:
                f.write(str(usage))
        return True

    def evict(self, target: int | None) -> int:
        """Bytes in the directory after removing the least recently used entries until it
        holds at most *target* bytes (``None``: only count). Call with ``.lock`` held."""
        entries: list[tuple[float, int, str]] = []
        total = 0
        now = time.time()
        tmp = os.path.join(self.root, "tmp")
        for d in os.scandir(tmp):
            try:
                st = d.stat()
            except OSError:
                continue
            if now - st.st_mtime > _STALE_TMP:
                unlink(d.path)
            else:
                total += st.st_size
        objects = os.path.join(self.root, "objects")
        for sub in os.scandir(objects):
            if not sub.is_dir():
                continue
            for d in os.scandir(sub.path):
                try:
                    st = d.stat()
                except OSError:
                    continue
                entries.append((st.st_mtime, st.st_size, d.path))
                total += st.st_size
        if target is not None and total > target:
            entries.sort()
            for _, size, path in entries:
                if total <= target:
                    break
                if unlink(path):
                    total -= size
        return total


class Sink:
    """An entry being written while its object streams: a temporary file until commit()."""

    def __init__(self, cache: CacheDir, key: str, etag: str | None) -> None:
        self.cache = cache
        self.key = key
        self.tag = (etag or "").encode()[:2048]
        self.size = 0
        self.tmp = os.path.join(cache.root, "tmp", f"{key}.{os.getpid()}.{id(self):x}.tmp")
        self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self.head = _HEAD.size + len(self.tag)
        os.lseek(self.fd, self.head, os.SEEK_SET)  # the header is written last

    def write(self, chunk: bytes) -> OSError | None:
        try:
            _write_chunk(self.fd, memoryview(chunk))
        except OSError as exc:
            return exc if exc.errno in UNUSABLE else OSError(None, str(exc))
        self.size += len(chunk)
        return None

    def commit(self) -> OSError | None:
        total = self.head + self.size
        cache = self.cache
        reserved = False
        try:
            os.pwrite(self.fd, _HEAD.pack(_MAGIC, self.size, len(self.tag)) + self.tag, 0)
            os.close(self.fd)
            self.fd = -1
            if cache.max_bytes is not None and total > cache.max_bytes:
                unlink(self.tmp)
                return None
            reserved = cache.reserve(total)
            path = cache.path(self.key)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            os.replace(self.tmp, path)
            return None
        except OSError as exc:
            self.abandon()
            if reserved:
                cache.reserve(-total)
            return exc if exc.errno in UNUSABLE else None

    def abandon(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        unlink(self.tmp)


async def chunks(fd: int, offset: int, size: int, chunk_size: int) -> AsyncGenerator[bytes, None]:
    try:
        pos = 0
        while pos < size:
            chunk = os.pread(fd, min(chunk_size, size - pos), offset + pos)
            if not chunk:
                break
            pos += len(chunk)
            yield chunk
    finally:
        os.close(fd)


def unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except OSError:
        return False
