"""A local disk cache of whole remote objects, shared by every process on the machine.

The files (layout, entry format, eviction) are ``_cache_dir``'s; this module decides
when to read and write them. Which cache a URL goes through, and the counts, are ``cache``'s.

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
written (read-only, full, no permission) turns the cache off with one ``CacheWarning``.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import os
import warnings
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from typing import TYPE_CHECKING

from .._exceptions import AsyncloadWarning
from .._stats.recorder import note_count
from .cache_dir import CacheDir, Sink, chunks, unlink

if TYPE_CHECKING:
    from .backends.base import ObjectInfo

__all__ = ["Cache", "CacheWarning"]

# Entries up to this size are read on the event loop (one read from the page cache costs less
# than a thread hop); larger ones in the default executor.
_INLINE_READ = 8 << 20
_POLL_MAX = 0.05  # longest sleep while another process fetches an object
_DRAIN_MAX = 1 << 20  # bytes read after a stream was closed early, to finish its entry


class CacheWarning(AsyncloadWarning):
    """The local cache was turned off (read-only or full disk); reads go to the store.

    Examples:
        >>> import warnings, asyncload
        >>> warnings.simplefilter("error", asyncload.CacheWarning)  # make it fatal in CI
    """


def _key(url: str) -> str:
    return hashlib.sha256(url.encode("utf-8", "surrogatepass")).hexdigest()


class Cache:
    """One cache directory (see the module docstring); create through ``cache.cache_for``."""

    def __init__(self, root: str, max_bytes: int | None) -> None:
        self.dir = CacheDir(root, max_bytes)
        self.root = self.dir.root
        self.off = False
        # This directory's share of the process's counts (``cache.counts`` sums them).
        self.hits = 0
        self.misses = 0
        self._inflight: dict[str, asyncio.Future[bytes]] = {}

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

    # -- reading an entry -------------------------------------------------------------------
    async def _hit(
        self,
        key: str,
        start: int | None,
        end: int | None,
        stat: Callable[[], Awaitable[ObjectInfo]] | None,
    ) -> bytes | None:
        entry = self.dir.open(key)
        if entry is None:
            return None
        fd, offset, size, etag = entry
        try:
            if stat is not None:
                info = await stat()
                if info.size != size or (etag is not None and info.etag != etag):
                    os.unlink(self.dir.path(key))
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
        A small hit without revalidation is ``lookup``'s, which the caller tries first.
        """
        key = _key(url)
        if stat is not None:
            stat = _once(stat)  # a stale entry's HEAD also gives the ETag to store
        data = await self._hit(key, start, end, stat)
        if data is not None:
            self.hits += 1
            note_count("cache_hits")
            return data
        return await self._miss(key, url, start, end, fetch, stat)

    def lookup(self, url: str, start: int | None, end: int | None) -> bytes | None:
        """The hit path, synchronous: bytes ``[start, end)`` of *url* when the cache holds it
        and the read is small, else ``None`` (then ``read`` does the rest).

        One call, no coroutine, no thread hop: the page cache answers a small read faster
        than a hop to a thread would.
        """
        got = self.dir.read(_key(url), start, end, _INLINE_READ)
        if got is None or isinstance(got, int):
            return None
        self.hits += 1
        note_count("cache_hits")
        return got

    async def _miss(
        self,
        key: str,
        url: str,
        start: int | None,
        end: int | None,
        fetch: Callable[[int | None, int | None], Awaitable[bytes]],
        stat: Callable[[], Awaitable[ObjectInfo]] | None,
    ) -> bytes:
        if start is not None or end is not None:
            self.misses += 1
            note_count("cache_misses")
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
            self.hits += 1
            note_count("cache_hits")
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
        lock = await self._lock(key)
        try:
            if lock is not None:
                data = await self._hit(key, None, None, None)  # filled while we waited
                if data is not None:
                    self.hits += 1
                    note_count("cache_hits")
                    return data
            self.misses += 1
            note_count("cache_misses")
            etag = (await stat()).etag if stat is not None else None
            data = await fetch(None, None)
            if lock is not None and not self.off:
                # A thread: a write can block for milliseconds on a busy disk (dirty-page
                # throttling), which on the loop would stall every request in flight.
                loop = asyncio.get_running_loop()
                unusable = await loop.run_in_executor(None, self.dir.store, key, data, etag)
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
            self.dir.setup()
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
        async with aclosing(remote):
            key = _key(url)
            entry = self.dir.open(key)
            if entry is not None and stat is not None:
                entry = await self._still_valid(key, entry, stat)
            if entry is not None:
                self.hits += 1
                note_count("cache_hits")
                fd, offset, size, _ = entry
                async with aclosing(chunks(fd, offset, size, chunk_size)) as entry_chunks:
                    async for chunk in entry_chunks:
                        count(len(chunk))
                        yield chunk
                return
            self.misses += 1
            note_count("cache_misses")
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

    async def _drain(self, sink: Sink, remote: AsyncGenerator[bytes, None]) -> Sink | None:
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
            unlink(self.dir.path(key))
            return None
        return entry

    def _sink(self, key: str, etag: str | None) -> Sink | None:
        try:
            self.dir.setup()
            return Sink(self.dir, key, etag)
        except OSError as exc:
            self._disable(exc)
            return None

    async def _sink_write(self, sink: Sink, chunk: bytes) -> Sink | None:
        loop = asyncio.get_running_loop()
        unusable = await loop.run_in_executor(None, sink.write, chunk)
        if unusable is None:
            return sink
        sink.abandon()
        if unusable.errno is not None:
            self._disable(unusable)
        return None


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
