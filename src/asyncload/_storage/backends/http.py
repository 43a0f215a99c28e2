"""``http://`` and ``https://`` through aiohttp: one ClientSession per event loop.

The session is created lazily on first use in a loop, with a connector sized by
``pool_size`` (keep-alive on); hedges (``_base.hedging``) go through a second, smaller session
of their own, so that a hedge never queues behind the primaries of a full pool. Both are closed by
``asyncload.aclose``, or, when nobody calls that, by the loop's own shutdown: a parked async
generator holds the session and ``loop.shutdown_asyncgens()`` (which ``asyncio.run`` calls)
finalizes it.

Redirects are followed by hand so that a redirect to another host (or to ``file:``) is refused
unless ``StorageOptions.allow_cross_host_redirects`` is set. What a response or an exception
means (statuses, lengths, versions, error mapping) is read in ``backends.http_errors``.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any
from urllib.parse import urljoin, urlsplit

import aiohttp
from yarl import URL

from ..._exceptions import InvalidURL, RedirectError
from ..retry import AttemptFailed
from ..state import hedge_pool_size, pool_size
from .base import (
    Backend,
    ObjectInfo,
    Resume,
    StorageOptions,
    encode_url,
    hedging,
    register,
)
from .http_errors import (
    check_length,
    check_status,
    check_version,
    map_error,
    object_changed,
    parse_http_date,
    total_size,
)
from .pacing import PacedConnector
from .progress import watching

__all__ = ["HttpBackend", "map_error"]

_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_MAX_REDIRECTS = 10
# Bytes are the payload: ask for no transfer encoding so lengths and ranges mean what they say.
_BASE_HEADERS = {"Accept-Encoding": "identity"}


class _LoopClient:
    __slots__ = ("closer", "hedges", "loop", "session")

    def __init__(self, loop: asyncio.AbstractEventLoop, session: aiohttp.ClientSession) -> None:
        self.loop = loop
        self.session = session
        self.hedges: aiohttp.ClientSession | None = None  # made at the first hedge
        self.closer = _close_at_loop_shutdown(self)

    async def close(self) -> None:
        try:
            await self.session.close()
        finally:
            if self.hedges is not None:
                await self.hedges.close()

    async def aclose(self) -> None:
        """Close both sessions now, and retire the generator that would at loop shutdown."""
        await self.close()
        await self.closer.aclose()  # type: ignore[attr-defined]


class _Connector(PacedConnector):
    """Tells a hedged request (``watching``) when it opens a connection and when it has one:
    its race times it from there, not from when it joined the pool's line (a queue, aiohttp's
    limit or the pacing's, is no straggler; a connect is timed: a dropped SYN waits 1 s)."""

    async def _create_direct_connection(self, *args: Any, **kwargs: Any) -> Any:
        # aiohttp's TCP connect, after every wait in line (PacedConnector's included).
        watch = watching.get()
        if watch is not None:
            watch.connecting()
        return await super()._create_direct_connection(*args, **kwargs)

    async def connect(self, req: Any, traces: Any, timeout: Any) -> Any:
        conn = await super().connect(req, traces, timeout)
        watch = watching.get()
        if watch is not None:
            watch.connected()
        return conn


def _new_client_session(limit: int) -> aiohttp.ClientSession:
    # Paced: a burst of new connections would overflow a small listen backlog (see _pacing).
    return aiohttp.ClientSession(
        connector=_Connector(limit=limit, keepalive_timeout=30.0),
        auto_decompress=False,
        timeout=aiohttp.ClientTimeout(total=None),
        raise_for_status=False,
    )


async def _close_at_loop_shutdown(client: _LoopClient) -> AsyncIterator[None]:
    try:
        yield
    finally:
        await client.close()


class HttpBackend(Backend):
    """aiohttp-based backend for ``http`` and ``https`` URLs.

    Examples:
        >>> data = await asyncload.read("https://example.com/data/0001.bin")  # doctest: +SKIP
    """

    def __init__(self) -> None:
        self._clients: dict[int, _LoopClient] = {}
        self._ssl: dict[tuple[bool, str | None], ssl.SSLContext | bool] = {}
        # id(options) -> (options, headers, timeout, ssl): built once per options object, not
        # per request (options objects live as long as their configure() entry).
        self._per_options: dict[
            int,
            tuple[StorageOptions, dict[str, str], aiohttp.ClientTimeout, ssl.SSLContext | bool],
        ] = {}

    # -- clients -------------------------------------------------------------------------
    def _current_session(self) -> aiohttp.ClientSession | None:
        """This loop's session (the hedges' one in a hedge's task), if it is made and open."""
        loop = asyncio.get_running_loop()
        client = self._clients.get(id(loop))
        if client is None or client.loop is not loop or client.session.closed:
            return None
        session = client.hedges if hedging.get() else client.session
        return None if session is None or session.closed else session

    async def _new_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        client = self._clients.get(id(loop))
        if client is None or client.loop is not loop or client.session.closed:
            if client is not None and client.loop is loop:  # its hedges' session may be open
                await client.aclose()
            client = self._clients[id(loop)] = _LoopClient(loop, _new_client_session(pool_size()))
            # Parked in the loop's async generators: shutdown_asyncgens() closes the sessions.
            await client.closer.__anext__()
        if not hedging.get():
            return client.session
        if client.hedges is None or client.hedges.closed:
            client.hedges = _new_client_session(hedge_pool_size())
        return client.hedges

    async def aclose(self) -> None:
        loop = asyncio.get_running_loop()
        client = self._clients.pop(id(loop), None)
        # Sessions of loops that closed without aclose() were finalized by their loop.
        for key in [k for k, c in self._clients.items() if c.loop.is_closed()]:
            del self._clients[key]
        if client is not None and client.loop is loop:
            await client.aclose()

    @staticmethod
    def _timeout(options: StorageOptions) -> aiohttp.ClientTimeout:
        # Built once per options object (see _per_options), so not cached on its own.
        return aiohttp.ClientTimeout(
            total=options.total_timeout,
            sock_connect=options.connect_timeout,
            sock_read=options.read_timeout,
        )

    def _ssl_for(self, options: StorageOptions) -> ssl.SSLContext | bool:
        key = (options.verify, options.ca_bundle)
        ctx = self._ssl.get(key)
        if ctx is None:
            if not options.verify:
                ctx = False
            elif options.ca_bundle is None:
                ctx = True
            else:
                ctx = ssl.create_default_context(cafile=options.ca_bundle)
            self._ssl[key] = ctx
        return ctx

    # -- one request, redirects followed by hand -----------------------------------------
    async def _request(
        self, method: str, url: str, options: StorageOptions, extra: dict[str, str] | None
    ) -> aiohttp.ClientResponse:
        session = self._current_session() or await self._new_session()
        cached = self._per_options.get(id(options))
        if cached is None or cached[0] is not options:
            cached = self._per_options[id(options)] = (
                options,
                {**_BASE_HEADERS, **options.headers},
                self._timeout(options),
                self._ssl_for(options),
            )
        _, headers, timeout, ssl_arg = cached
        if extra:
            headers = {**headers, **extra}
        target = encode_url(url)
        watch = watching.get()  # a hedged race's primary: it reads how far this request got
        for _ in range(_MAX_REDIRECTS + 1):
            if watch is not None:
                watch.queued()  # until the connector says it has a connection (_Connector)
            try:
                resp = await session.request(
                    method,
                    URL(target, encoded=True),
                    headers=headers,
                    timeout=timeout,
                    ssl=ssl_arg,
                    allow_redirects=False,
                )
            except Exception as exc:
                raise map_error(exc, options) from exc
            connector = session.connector
            if isinstance(connector, PacedConnector):
                connector.settle(resp)
            if resp.status not in _REDIRECTS:
                if watch is not None:  # the body's progress, read by the race's timer
                    watch.answered(resp.content)
                return resp
            location = resp.headers.get("Location")
            resp.release()
            if not location or not options.allow_redirects:
                raise AttemptFailed(
                    RedirectError, f"{resp.status} redirect not followed", status=resp.status
                )
            target = urljoin(target, location)
            if urlsplit(target).scheme not in ("http", "https"):
                raise AttemptFailed(
                    RedirectError,
                    f"refused a redirect to a non-HTTP URL {target}",
                    status=resp.status,
                )
            if _origin(target) != _origin(url):  # parsed only on a redirect: a hot path
                if not options.allow_cross_host_redirects:
                    raise AttemptFailed(
                        RedirectError,
                        f"refused a redirect to another host ({target}); allow it with "
                        "asyncload.configure(prefix, allow_cross_host_redirects=True)",
                        status=resp.status,
                    )
                # Credentials configured for this host must not travel to another one.
                headers = {**_BASE_HEADERS, **(extra or {})}
        raise AttemptFailed(RedirectError, f"more than {_MAX_REDIRECTS} redirects")

    # -- the Backend interface -----------------------------------------------------------
    async def read(
        self, url: str, start: int | None, end: int | None, options: StorageOptions
    ) -> bytes:
        extra = None
        if start is not None or end is not None:
            first = start or 0
            extra = {"Range": f"bytes={first}-{end - 1}" if end is not None else f"bytes={first}-"}
        resp = await self._request("GET", url, options, extra)
        try:
            if resp.status == 416:
                return b""  # a range past the end: empty, as slicing would give
            await check_status(resp)
            try:
                data = await resp.read()
            except Exception as exc:
                raise map_error(exc, options) from exc
            check_length(resp, len(data))
            if extra is not None and resp.status == 200:
                # The server ignored Range and sent everything: cut the range out ourselves.
                data = data[start or 0 : end]
            return data
        finally:
            resp.release()

    def stream(
        self, url: str, start: int, chunk_size: int, options: StorageOptions
    ) -> AsyncGenerator[bytes, None]:
        return self._stream(url, start, chunk_size, options, None)

    def stream_version(
        self, url: str, start: int, chunk_size: int, options: StorageOptions, resume: Resume
    ) -> AsyncGenerator[bytes, None]:
        return self._stream(url, start, chunk_size, options, resume)

    async def _stream(
        self,
        url: str,
        start: int,
        chunk_size: int,
        options: StorageOptions,
        resume: Resume | None,
    ) -> AsyncGenerator[bytes, None]:
        extra = {"Range": f"bytes={start}-"} if start else None
        known = resume.etag if resume is not None and start else None
        if extra is not None and known is not None and not known.startswith("W/"):
            # Only the version we started with: If-Match answers 412 when it changed, and a
            # server that knows If-Range but not If-Match sends the new version whole (200).
            # Weak ETags are not allowed in either; those are compared after the response.
            extra["If-Match"] = known
            extra["If-Range"] = known
        resp = await self._request("GET", url, options, extra)
        try:
            if resp.status == 416:
                return
            if resp.status == 412 and known is not None:
                raise object_changed(known, None, start)
            await check_status(resp)
            if resume is not None:
                check_version(resp, resume, start)
            skip = start if extra is not None and resp.status == 200 else 0
            received = 0
            try:
                async for chunk in resp.content.iter_chunked(chunk_size):
                    received += len(chunk)
                    if skip:
                        cut = min(skip, len(chunk))
                        chunk, skip = chunk[cut:], skip - cut
                        if not chunk:
                            continue
                    yield chunk
            except AttemptFailed:
                raise
            except Exception as exc:
                raise map_error(exc, options) from exc
            check_length(resp, received)
        finally:
            resp.release()

    async def stat(self, url: str, options: StorageOptions) -> ObjectInfo:
        resp = await self._request("HEAD", url, options, None)
        try:
            if resp.status == 405:  # no HEAD here: ask for one byte and read the total
                resp.release()
                resp = await self._request("GET", url, options, {"Range": "bytes=0-0"})
            await check_status(resp)
            size = total_size(resp)
            modified = resp.headers.get("Last-Modified")
            return ObjectInfo(
                url=url,
                size=size,
                etag=resp.headers.get("ETag"),
                mtime=parse_http_date(modified) if modified else None,
            )
        finally:
            resp.release()

    async def list(self, prefix_url: str, options: StorageOptions) -> list[str]:
        raise AttemptFailed(
            InvalidURL,
            "plain HTTP has no way to list objects; pass the URLs to RemoteFiles yourself, "
            "or use an object-store URL (s3://, gs://, az://)",
        )


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    port = parts.port or (443 if scheme == "https" else 80)
    return scheme, (parts.hostname or "").lower(), port


_backend = HttpBackend()
register("http", _backend)
register("https", _backend)
