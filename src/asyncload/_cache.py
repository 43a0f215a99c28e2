"""A local disk cache of whole remote objects, shared by every process on the machine.

Layout under ``cache_dir``::

    objects/ab/abcdef…      one entry per URL (sha256 of the URL): a small header, then the body
    tmp/                    entries being written; renamed into objects/ when complete
    locks/abcdef….lock      held (flock) by the one process fetching that object
    .lock, usage            the byte count of the directory, updated under .lock

An entry appears only through ``os.replace`` of a fully written temporary file, and its header
records the body's size, so a process killed mid-write leaves at most a file in ``tmp/`` (swept
later) and a truncated entry is never returned. Every hit sets the entry's mtime (at most every
few seconds), and eviction removes the oldest mtimes first until the directory fits
``cache_max_bytes`` again: least recently used, across processes.

Concurrent misses of one object fetch it once: in a process through a shared future, across
processes through the per-object lock file (the others poll until the entry appears). Only whole
objects are cached; a range is served from a cached whole object, and a range that misses is
read from the store as usual. A stream of an uncached object is written through to a temporary
file and kept when it reaches the end. Nothing here ever fails a read: a directory that cannot be
written (read-only, full, no permission) turns the cache off with one :class:`CacheWarning`.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import hashlib
import os
import struct
import time
import warnings
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ._context import AsyncloadWarning

if TYPE_CHECKING:
    from .sources._base import ObjectInfo, StorageOptions

__all__ = ["ENV_VAR", "Cache", "CacheCounts", "CacheWarning", "cache_for", "counts", "reset"]

ENV_VAR = "ASYNCLOAD_CACHE_DIR"

_MAGIC = b"ALC1"
_HEAD = struct.Struct("<4sQH")  # magic, body size, ETag length (the ETag follows)
# Entries up to this size are read on the event loop (one read from the page cache costs less
# than a thread hop); larger ones in the default executor.
_INLINE_READ = 8 << 20
_TOUCH_EVERY = 10.0  # seconds: an entry's mtime is refreshed at most this often
_STALE_TMP = 3600.0  # a temporary file this old belongs to a process that died
_LOW_WATER = 0.9  # eviction frees down to this fraction of the cap
_POLL_MAX = 0.05  # longest sleep while another process fetches an object
_WRITE_CHUNK = 4 << 20
_DRAIN_MAX = 1 << 20  # bytes read after a stream was closed early, to finish its entry
# Errors that say the directory cannot take entries at all (others skip one entry).
_UNUSABLE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})


class CacheWarning(AsyncloadWarning):
    """The local cache was turned off (read-only or full disk); reads go to the store.

    Example:
        >>> import warnings, asyncload
        >>> warnings.simplefilter("error", asyncload.CacheWarning)  # make it fatal in CI
    """


@dataclass(frozen=True, slots=True)
class CacheCounts:
    """Cache hits and misses of this process since it started (for ``loader.stats()``)."""

    hits: int
    misses: int


_hits = 0
_misses = 0


def counts() -> CacheCounts:
    """Hits and misses of every cache this process has used."""
    return CacheCounts(hits=_hits, misses=_misses)


_caches: dict[tuple[str, int | None], Cache] = {}


def cache_for(url: str, options: StorageOptions) -> Cache | None:
    """The cache *url* is read through, or ``None`` (no cache configured, local file, off)."""
    root = options.cache_dir or os.environ.get(ENV_VAR)
    if not root or "://" not in url or url.startswith(("file:", "FILE:")):
        return None
    key = (root, options.cache_max_bytes)
    cache = _caches.get(key)
    if cache is None:
        cache = _caches[key] = Cache(root, options.cache_max_bytes)
    return None if cache.off else cache


def reset() -> None:
    """Forget every cache object and zero the counters (tests)."""
    global _hits, _misses
    _caches.clear()
    _hits = _misses = 0


def _key(url: str) -> str:
    return hashlib.sha256(url.encode("utf-8", "surrogatepass")).hexdigest()


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


class Cache:
    """One cache directory (see the module docstring); create through :func:`cache_for`."""

    def __init__(self, root: str, max_bytes: int | None) -> None:
        self.root = os.path.abspath(os.path.expanduser(root))
        self.max_bytes = max_bytes
        self.off = False
        self._inflight: dict[str, asyncio.Future[bytes]] = {}
        self._ready = False

    # -- failures ---------------------------------------------------------------------------
    def _disable(self, exc: OSError) -> None:
        if not self.off:
            self.off = True
            warnings.warn(
                f"asyncload: the cache directory {self.root} cannot be used ({exc.strerror or exc})"
                "; reading from the store without a cache. Free space, fix the permissions or "
                "set cache_dir / ASYNCLOAD_CACHE_DIR to a writable directory.",
                CacheWarning,
                stacklevel=2,
            )

    def _setup(self) -> None:
        if not self._ready:
            for sub in ("objects", "tmp", "locks"):
                os.makedirs(os.path.join(self.root, sub), exist_ok=True)
            self._ready = True

    def _path(self, key: str) -> str:
        return os.path.join(self.root, "objects", key[:2], key)

    # -- reading an entry -------------------------------------------------------------------
    def _open(self, key: str) -> tuple[int, int, int, str | None] | None:
        """(fd, body offset, body size, etag) of a complete entry, or ``None``."""
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            head = os.pread(fd, 4096, 0)
            magic, size, elen = _HEAD.unpack_from(head)
            offset = _HEAD.size + elen
            if magic != _MAGIC or st.st_size != offset + size:
                raise ValueError("truncated or foreign entry")
            if time.time() - st.st_mtime > _TOUCH_EVERY:
                os.utime(fd)  # LRU: this entry was used now
            etag = head[_HEAD.size : offset].decode() if elen else None
            return fd, offset, size, etag
        except (OSError, ValueError, struct.error):
            os.close(fd)
            try:  # never returned; make room for a good copy
                os.unlink(path)
            except OSError:
                pass
            return None
        except BaseException:
            os.close(fd)
            raise

    async def _hit(
        self,
        key: str,
        start: int | None,
        end: int | None,
        stat: Callable[[], Awaitable[ObjectInfo]] | None,
    ) -> bytes | None:
        entry = self._open(key)
        if entry is None:
            return None
        fd, offset, size, etag = entry
        try:
            if stat is not None:
                info = await stat()
                if info.size != size or (etag is not None and info.etag != etag):
                    os.unlink(self._path(key))
                    return None
            first = min(start or 0, size)
            last = size if end is None else min(end, size)
            n = max(0, last - first)
            if n <= _INLINE_READ:
                data = os.pread(fd, n, offset + first)
            else:
                loop = asyncio.get_running_loop()
                data = await loop.run_in_executor(None, os.pread, fd, n, offset + first)
            return data if len(data) == n else None
        except OSError:
            return None
        finally:
            os.close(fd)

    # -- the read path ----------------------------------------------------------------------
    async def read(
        self,
        url: str,
        start: int | None,
        end: int | None,
        fetch: Callable[[int | None, int | None], Awaitable[bytes]],
        stat: Callable[[], Awaitable[ObjectInfo]] | None = None,
    ) -> bytes:
        """Bytes ``[start, end)`` of *url*, from the cache or through *fetch* (which fills it).

        *stat* is given when entries must be revalidated against the store's ETag and size.
        """
        global _hits, _misses
        key = _key(url)
        if stat is not None:
            stat = _once(stat)  # a stale entry's HEAD also gives the ETag to store
        data = await self._hit(key, start, end, stat)
        if data is not None:
            _hits += 1
            return data
        if start is not None or end is not None:
            _misses += 1
            return await fetch(start, end)
        loop = asyncio.get_running_loop()
        shared = self._inflight.get(key)
        if shared is not None and shared.get_loop() is loop:
            try:
                data = await asyncio.shield(shared)
            except asyncio.CancelledError:
                if not shared.cancelled():
                    raise  # this read was cancelled
                return await self.read(url, start, end, fetch, stat)  # the fetching one was
            _hits += 1
            return data
        fut: asyncio.Future[bytes] = loop.create_future()
        fut.add_done_callback(_retrieve)
        self._inflight[key] = fut  # (another loop's fetch of it, if any, is simply not shared)
        try:
            data = await self._fill(key, fetch, stat)
        except Exception as exc:
            fut.set_exception(exc)
            raise
        except BaseException:
            fut.cancel()
            raise
        else:
            fut.set_result(data)
            return data
        finally:
            if self._inflight.get(key) is fut:
                del self._inflight[key]

    async def _fill(
        self,
        key: str,
        fetch: Callable[[int | None, int | None], Awaitable[bytes]],
        stat: Callable[[], Awaitable[ObjectInfo]] | None,
    ) -> bytes:
        global _hits, _misses
        lock = await self._lock(key)
        try:
            if lock is not None:
                data = await self._hit(key, None, None, None)  # filled while we waited
                if data is not None:
                    _hits += 1
                    return data
            _misses += 1
            etag = (await stat()).etag if stat is not None else None
            data = await fetch(None, None)
            if lock is not None and not self.off:
                # A thread: a write can block for milliseconds on a busy disk (dirty-page
                # throttling), which on the loop would stall every request in flight.
                loop = asyncio.get_running_loop()
                unusable = await loop.run_in_executor(None, self._store, key, data, etag)
                if unusable is not None:
                    self._disable(unusable)  # on the loop: one warning, never two
            return data
        finally:
            if lock is not None:
                try:
                    os.unlink(os.path.join(self.root, "locks", key + ".lock"))
                except OSError:
                    pass
                os.close(lock)

    async def _lock(self, key: str) -> int | None:
        """Hold the object's lock file, waiting while another process fetches it.

        ``None`` when the cache cannot be used (the caller fetches without storing).
        """
        try:
            self._setup()
        except OSError as exc:
            self._disable(exc)
            return None
        path = os.path.join(self.root, "locks", key + ".lock")
        pause = 0.002
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
            except OSError as exc:
                self._disable(exc)
                return None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
            else:
                return fd
            # Another process is fetching it; its lock goes away when it stores the entry or
            # dies, so this loop ends either way.
            await asyncio.sleep(pause)
            pause = min(pause * 2, _POLL_MAX)

    # -- writing an entry -------------------------------------------------------------------
    def _store(self, key: str, data: bytes, etag: str | None) -> OSError | None:
        """Write one entry (in a thread); the error that makes the directory unusable, if any."""
        tag = (etag or "").encode()[:2048]
        head = _HEAD.pack(_MAGIC, len(data), len(tag)) + tag
        total = len(head) + len(data)
        if self.max_bytes is not None and total > self.max_bytes:
            return None  # larger than the whole cache: not worth evicting everything for
        tmp = os.path.join(self.root, "tmp", f"{key}.{os.getpid()}.{id(data):x}.tmp")
        reserved = False
        try:
            reserved = self._reserve(total)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                _write_chunk(fd, memoryview(head))
                view = memoryview(data)
                for i in range(0, len(view), _WRITE_CHUNK):
                    _write_chunk(fd, view[i : i + _WRITE_CHUNK])
            finally:
                os.close(fd)
            os.makedirs(os.path.dirname(self._path(key)), exist_ok=True)
            os.replace(tmp, self._path(key))
        except OSError as exc:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            if reserved:
                self._reserve(-total)
            if exc.errno in _UNUSABLE:
                return exc
            # Anything else (a racing eviction removed a directory...): this entry is skipped.
        return None

    def _reserve(self, n: int) -> bool:
        """Account *n* bytes (negative: give back) against the cap, evicting to make room."""
        if self.max_bytes is None:
            return False
        with _Locked(os.path.join(self.root, ".lock")):
            usage_path = os.path.join(self.root, "usage")
            try:
                with open(usage_path) as f:
                    usage = int(f.read() or "0")
            except (OSError, ValueError):
                usage = self._evict(None)
            if n > 0 and usage + n > self.max_bytes:
                usage = self._evict(int(self.max_bytes * _LOW_WATER) - n)
            usage = max(0, usage + n)
            with open(usage_path, "w") as f:
                f.write(str(usage))
        return True

    def _evict(self, target: int | None) -> int:
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
                _unlink(d.path)
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
                if _unlink(path):
                    total -= size
        return total

    # -- streaming ---------------------------------------------------------------------------
    async def stream_through(
        self,
        url: str,
        chunk_size: int,
        stat: Callable[[], Awaitable[ObjectInfo]] | None,
        remote: AsyncGenerator[bytes, None],
        count: Callable[[int], None],
    ) -> AsyncGenerator[bytes, None]:
        """The chunks of *url*: from the cache (each counted with *count*), or from *remote*
        (not started yet), written to the cache on the way when they reach the end."""
        global _hits, _misses
        async with aclosing(remote):
            key = _key(url)
            entry = self._open(key)
            if entry is not None and stat is not None:
                entry = await self._still_valid(key, entry, stat)
            if entry is not None:
                _hits += 1
                fd, offset, size, _ = entry
                async with aclosing(_chunks(fd, offset, size, chunk_size)) as chunks:
                    async for chunk in chunks:
                        count(len(chunk))
                        yield chunk
                return
            _misses += 1
            etag = (await stat()).etag if stat is not None else None
            sink = self._sink(key, etag)
            try:
                async for chunk in remote:
                    if sink is not None:
                        sink = await self._sink_write(sink, chunk)
                    yield chunk
            except GeneratorExit:
                # Readers that stop at a format's end marker (a tar's zero blocks) leave a
                # little padding unread: fetch a bounded tail so the entry can still be kept.
                if sink is not None:
                    sink = await self._drain(sink, remote)
                if sink is None:
                    raise
            except BaseException:
                if sink is not None:
                    sink.abandon()
                raise
            if sink is not None:
                loop = asyncio.get_running_loop()
                unusable = await loop.run_in_executor(None, sink.commit)
                if unusable is not None:
                    self._disable(unusable)

    async def _drain(self, sink: _Sink, remote: AsyncGenerator[bytes, None]) -> _Sink | None:
        """Read up to ``_DRAIN_MAX`` more bytes into *sink*; it, when the object ended there."""
        left = _DRAIN_MAX
        try:
            async for chunk in remote:
                left -= len(chunk)
                if left < 0:
                    break
                kept = await self._sink_write(sink, chunk)
                if kept is None:
                    return None
            else:
                return sink
        except Exception:  # the tail is optional: any failure just drops the entry
            pass
        sink.abandon()
        return None

    async def _still_valid(
        self,
        key: str,
        entry: tuple[int, int, int, str | None],
        stat: Callable[[], Awaitable[ObjectInfo]],
    ) -> tuple[int, int, int, str | None] | None:
        fd, _, size, etag = entry
        try:
            info = await stat()
        except BaseException:
            os.close(fd)
            raise
        if info.size != size or (etag is not None and info.etag != etag):
            os.close(fd)
            _unlink(self._path(key))
            return None
        return entry

    def _sink(self, key: str, etag: str | None) -> _Sink | None:
        try:
            self._setup()
            return _Sink(self, key, etag)
        except OSError as exc:
            self._disable(exc)
            return None

    async def _sink_write(self, sink: _Sink, chunk: bytes) -> _Sink | None:
        loop = asyncio.get_running_loop()
        unusable = await loop.run_in_executor(None, sink.write, chunk)
        if unusable is None:
            return sink
        sink.abandon()
        if unusable.errno is not None:
            self._disable(unusable)
        return None


class _Sink:
    """An entry being written while its object streams: a temporary file until commit()."""

    def __init__(self, cache: Cache, key: str, etag: str | None) -> None:
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
            return exc if exc.errno in _UNUSABLE else OSError(None, str(exc))
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
                _unlink(self.tmp)
                return None
            reserved = cache._reserve(total)
            path = cache._path(self.key)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            os.replace(self.tmp, path)
            return None
        except OSError as exc:
            self.abandon()
            if reserved:
                cache._reserve(-total)
            return exc if exc.errno in _UNUSABLE else None

    def abandon(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        _unlink(self.tmp)


async def _chunks(fd: int, offset: int, size: int, chunk_size: int) -> AsyncGenerator[bytes, None]:
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


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except OSError:
        return False


def _retrieve(fut: asyncio.Future[bytes]) -> None:
    if not fut.cancelled():
        fut.exception()


def _once(stat: Callable[[], Awaitable[ObjectInfo]]) -> Callable[[], Awaitable[ObjectInfo]]:
    memo: list[ObjectInfo] = []

    async def cached() -> ObjectInfo:
        if not memo:
            memo.append(await stat())
        return memo[0]

    return cached
