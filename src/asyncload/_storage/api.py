"""Read any URL from any coroutine: the public storage functions and per-prefix settings.

``read``, ``stream``, ``stat`` and ``list_files`` pick the backend by URL scheme
(``asyncload.sources``), the ``StorageOptions`` by longest configured prefix, and run
the backend's single attempts under the options' ``Retry`` policy.

Settings given with ``configure`` in the main process reach workers through
``export_config`` / ``import_config``, which the DataLoader's worker start-up calls; they live
in ``_storage/config.py`` and are re-exported here. Clients are created lazily, per event loop
(aiohttp) or per process (obstore), so nothing here has to be picklable but the settings
themselves.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing

from .._control import turns as _turns
from .._exceptions import InvalidURL
from .._stats import loader_stats as _stats
from . import cache as _cache
from . import hedge as _hedge
from . import state as _state
from . import sync as _sync
from .backends import base as _base
from .backends.base import ObjectInfo, StorageOptions, backend_for
from .backends.pacing_memory import PacingMemory
from .config import (
    StorageConfig,
    _clear_clients,
    configure,
    configure_all,
    export_config,
    forget_stale_clients,
    import_config,
    learn_pacing,
    options_for,
    pacing_snapshot,
    pool_size,
    pool_size_here,
    prewarm,
    set_pool_size,
)
from .retry import AttemptFailed, Attempts, Retry, retrying

__all__ = [
    "ObjectInfo",
    "PacingMemory",
    "Retry",
    "StorageConfig",
    "StorageOptions",
    "aclose",
    "configure",
    "configure_all",
    "export_config",
    "forget_stale_clients",
    "import_config",
    "learn_pacing",
    "list_files",
    "list_files_async",
    "options_for",
    "pacing_snapshot",
    "pool_size",
    "pool_size_here",
    "prewarm",
    "read",
    "read_sync",
    "set_pool_size",
    "stat",
    "stream",
]


def reset() -> None:
    """Forget every configured prefix, what hosts proved, the hedge trackers and counts, the
    caches, and every client (tests)."""
    _state.current().forget()
    _clear_clients()
    _hedge.reset()


async def aclose() -> None:
    """Close every storage client bound to the running event loop.

    The DataLoader's workers call this at exit. Call it yourself when you read from your own
    loop and want its connections closed before the loop ends.
    """
    await _hedge.drain()  # cancelled hedges release their connections first
    for backend in set(_base._registry.values()):
        await backend.aclose()


def _check_range(start: int | None, end: int | None) -> None:
    if (start is not None and start < 0) or (end is not None and end < 0):
        raise ValueError(f"byte range must be non-negative, got start={start}, end={end}")


def _backend(url: str) -> _base.Backend:
    try:
        return backend_for(url)
    except InvalidURL as exc:
        _stats.note_error(type(exc).__name__)
        raise


async def read(url: str, *, start: int | None = None, end: int | None = None) -> bytes:
    """Return the bytes of the object at *url*, or of its range ``[start, end)``.

    Retries transient failures under the prefix's [`Retry`][asyncload.Retry] policy; a body
    shorter than announced is fetched again, never returned.

    Args:
        url: ``https://…``, ``s3://bucket/key``, ``gs://…``, ``az://…``, ``file://…`` or a path.
        start: First byte to return (default 0).
        end: One past the last byte to return (default: the end of the object).

    Raises:
        NotFound: The object does not exist (a ``FileNotFoundError``).
        PermissionDenied: Missing or refused credentials (a ``PermissionError``).
        StorageError: Any other failure, after the retries: a subclass that says which
            (``ServerError``, ``RequestTimeout``, ``ConnectError``, ...).

    Examples:
        >>> header = await asyncload.read("s3://bucket/shard-0001.tar", end=512)  # doctest: +SKIP
    """
    _check_range(start, end)
    backend = _backend(url)
    options = options_for(url)
    if start is not None and end is not None and end <= start:
        return b""
    cache = _cache.cache_for(url, options)
    if cache is not None:
        # A hit returns from here with no coroutine beneath: the warm epoch's whole cost.
        data = None if options.cache_revalidate else cache.lookup(url, start, end)
        if data is not None:
            _stats.note_bytes(len(data))
            return data
        data = await cache.read(
            url,
            start,
            end,
            lambda first, last: _fetch(backend, url, first, last, options),
            (lambda: stat(url)) if options.cache_revalidate else None,
        )
    else:
        data = await _fetch(backend, url, start, end, options)
    _stats.note_bytes(len(data))
    # What the caller does next is often a decode, inline: let the loop read the answers that
    # arrived meanwhile first, if it has been busy, and the head batch's samples go first
    # (``_control/turns.py``).
    loop_turns = _turns.must_wait()
    if loop_turns is not None:
        await loop_turns.wait()
    return data


async def _fetch(
    backend: _base.Backend, url: str, start: int | None, end: int | None, options: StorageOptions
) -> bytes:
    if _hedge.applies(url, options):
        return await _hedge.read(backend, url, start, end, options)
    # The first attempt is made here rather than inside retrying(): one coroutine and one
    # closure fewer per sample, on the path every sample takes.
    started = time.monotonic()
    try:
        data = await backend.read(url, start, end, options)
    except AttemptFailed as failure:
        data = await retrying(
            lambda: backend.read(url, start, end, options),
            url=url,
            policy=options.retry,
            first=failure,
            started=started,
        )
    return data


def read_sync(url: str, *, start: int | None = None, end: int | None = None) -> bytes:
    """Return the bytes of the object at *url* (or of ``[start, end)``) from synchronous code.

    The same as ``await`` [`asyncload.read`][asyncload.read], with the same retries and errors,
    but callable from anywhere: a script, a REPL, a notebook cell (whose thread already runs an
    event loop), a thread. Reads run one at a time on a private event loop in a background
    thread that keeps connections open between calls. For many objects, await
    [`asyncload.read`][asyncload.read] concurrently or use
    [`asyncload.DataLoader`][asyncload.DataLoader].

    Args:
        url: ``https://``, ``s3://``, ``gs://``, ``az://``, ``file://`` or a path.
        start: First byte to read (default: the beginning).
        end: One past the last byte to read (default: the end).

    Raises:
        NotFound: The object does not exist (a ``FileNotFoundError``).
        PermissionDenied: Missing or refused credentials (a ``PermissionError``).
        StorageError: Any other failure, after the retries.

    Examples:
        >>> import asyncload
        >>> header = asyncload.read_sync("https://host/shard-0001.tar", end=512)  # doctest: +SKIP
    """
    return _sync.run_sync(read(url, start=start, end=end))


async def stream(url: str, *, chunk_size: int = 1 << 20) -> AsyncIterator[bytes]:
    """Yield the object at *url* in chunks of roughly *chunk_size* bytes.

    A connection lost midway is resumed from the last byte delivered (a range request), under
    the same ``Retry`` policy as ``read``; a chunk is never delivered twice. The resume
    asks only for the version the download started with (``If-Match``/``If-Range`` with its
    ETag): if the object was replaced meanwhile, ``ObjectChanged`` is raised
    rather than splicing two versions.

    Examples:
        >>> async for chunk in asyncload.stream("https://host/big.bin"):  # doctest: +SKIP
        ...     digest.update(chunk)
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    backend = _backend(url)
    options = options_for(url)
    remote = _stream_remote(backend, url, chunk_size, options)
    cache = _cache.cache_for(url, options)
    if cache is None:
        chunks = remote
    else:  # hits from the disk; a miss is written through while it streams
        revalidate = (lambda: stat(url)) if options.cache_revalidate else None
        chunks = cache.stream_through(url, chunk_size, revalidate, remote, _stats.note_bytes)
    async with aclosing(chunks) as it:
        async for chunk in it:
            yield chunk


async def _stream_remote(
    backend: _base.Backend, url: str, chunk_size: int, options: StorageOptions
) -> AsyncGenerator[bytes, None]:
    hedged = _hedge.applies(url, options)
    offset = 0
    attempts = Attempts(url, options.retry)
    resume = _base.Resume()
    while True:
        progress = offset
        attempts.sent()
        if offset == 0:
            resume.etag = resume.size = None  # nothing delivered yet: any version will do
        opened = (
            _hedge.open_stream(backend, url, offset, chunk_size, options, attempts.spare, resume)
            if hedged
            else backend.stream_version(url, offset, chunk_size, options, resume)
        )
        try:
            async with aclosing(opened) as chunks:
                async for chunk in chunks:
                    offset += len(chunk)
                    _stats.note_bytes(len(chunk))
                    yield chunk
            return
        except AttemptFailed as failure:
            if offset > progress:  # progress was made: this is a fresh failure, not a repeat
                attempts.progress()
            await attempts.failed(failure, failure.requests)  # a hedge that failed too counts


async def stat(url: str) -> ObjectInfo:
    """Size, etag and modification time of the object at *url*.

    Examples:
        >>> info = await asyncload.stat("s3://bucket/key")  # doctest: +SKIP
        >>> info.size  # doctest: +SKIP
        1048576
    """
    backend = _backend(url)
    options = options_for(url)
    return await retrying(lambda: backend.stat(url, options), url=url, policy=options.retry)


async def list_files_async(prefix_url: str) -> list[str]:
    """The sorted full URLs of every object under *prefix_url* (a "directory").

    Examples:
        >>> urls = await asyncload.list_files_async("s3://bucket/train/")  # doctest: +SKIP
    """
    backend = _backend(prefix_url)
    options = options_for(prefix_url)
    urls = await retrying(
        lambda: backend.list(prefix_url, options), url=prefix_url, policy=options.retry
    )
    urls.sort()
    return urls


async def _list_and_close(prefix_url: str) -> list[str]:
    try:
        return await list_files_async(prefix_url)
    finally:
        await aclose()


def list_files(prefix_url: str) -> list[str]:
    """The sorted full URLs of every object under *prefix_url*, from synchronous code.

    Runs [`list_files_async`][asyncload.list_files_async] on a private event loop in a
    short-lived thread, so it works in the main process whether or not a loop is running there,
    and leaves no loop behind. Pagination is followed (S3 returns 1,000 keys per page). From a
    coroutine, await [`list_files_async`][asyncload.list_files_async] instead: this call blocks
    its thread until the listing is done.

    Note:
        Listing ``s3://``, ``gs://`` or ``az://`` starts obstore's runtime threads in this
        process; a worker *forked* from it afterwards would hang. The DataLoader starts its
        workers with ``forkserver`` by default, which is safe.

    Examples:
        >>> import asyncload
        >>> urls = asyncload.list_files("s3://bucket/train/")  # doctest: +SKIP
        >>> dataset = asyncload.RemoteFiles(urls)  # doctest: +SKIP
    """
    return list(_sync.run_detached(lambda: _list_and_close(prefix_url)))


# Sessions opened on read_sync's private loop are closed there at exit.
_sync.on_close(aclose)
