"""What a storage backend is, the options it receives, and the registry of URL schemes.

A backend makes **one attempt** per call and reports failure as
``AttemptFailed``; retries, stats and the public errors live in
``asyncload._storage``. Each backend module maps its library's exceptions in one function
(``map_error``), the way httpcore's ``map_exceptions`` does, so nothing library-specific leaks
out of the module.

Adding a scheme is one small module::

    class MemoryBackend(Backend):
        ...
    register("mem", MemoryBackend())
"""

from __future__ import annotations

import abc
import contextvars
import re
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, urlsplit

from ..._exceptions import InvalidURL
from ..._redact import split_authority
from ..retry import AttemptFailed, Hedge, Retry

__all__ = [
    "Backend",
    "ObjectInfo",
    "Resume",
    "StorageOptions",
    "backend_for",
    "encode_url",
    "hedging",
    "register",
    "registered_schemes",
    "split_scheme",
]


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """What [`asyncload.stat`][asyncload.stat] knows about one object.

    Examples:
        >>> info = await asyncload.stat("s3://bucket/images/0001.jpg")  # doctest: +SKIP
        >>> info.size, info.etag  # doctest: +SKIP
        (48213, '"9b2cf535f27731c974343645a3985328"')
    """

    url: str
    """The URL that was asked about."""
    size: int
    """Size in bytes."""
    etag: str | None
    """The entity tag, quotes included as the server sent it; ``None`` when there is none."""
    mtime: float | None
    """Last modification as a POSIX timestamp; ``None`` when unknown."""


@dataclass(frozen=True, slots=True)
class StorageOptions:
    """Settings for every URL under one prefix; see [`asyncload.configure`][asyncload.configure].

    Options a backend has no use for are ignored by it (``region`` means nothing to a web
    server). All fields are picklable, so the same settings reach every worker process.

    Examples:
        >>> import asyncload
        >>> opts = asyncload.StorageOptions(endpoint="http://127.0.0.1:9000", read_timeout=10.0)
        >>> asyncload.configure("s3://my-bucket", opts)  # doctest: +SKIP
    """

    endpoint: str | None = None
    """S3-compatible endpoint URL (MinIO, R2, moto); overrides ``AWS_ENDPOINT_URL``."""
    region: str | None = None
    """Cloud region (S3)."""
    credentials: Mapping[str, str] | None = field(default=None, repr=False)
    """Backend configuration keys that carry secrets, e.g. ``{"access_key_id": ...,
    "secret_access_key": ...}`` for S3 or ``{"account_key": ...}`` for Azure. Never printed."""
    headers: Mapping[str, str] = field(default_factory=dict, repr=False)
    """Extra HTTP headers sent with every request (e.g. ``Authorization``). Never printed."""
    connect_timeout: float = 10.0
    """Seconds to establish a connection (TCP and TLS), per attempt."""
    read_timeout: float = 30.0
    """Seconds to wait for each read on the socket, per attempt: a stalled body times out."""
    total_timeout: float | None = None
    """Seconds for a whole attempt, body included (``None``: bounded by the two above)."""
    retry: Retry = field(default_factory=Retry)
    """The retry policy."""
    allow_redirects: bool = True
    """Follow HTTP redirects to the same scheme, host and port."""
    allow_cross_host_redirects: bool = False
    """Also follow redirects to another host (headers from ``headers`` are then not sent)."""
    verify: bool = True
    """Verify TLS certificates. Turning this off is for throwaway test servers only."""
    ca_bundle: str | None = None
    """Path to a PEM file of extra CA certificates to trust (private CAs)."""
    allow_http: bool | None = None
    """Allow plain-HTTP object-store endpoints; ``None`` allows them when the endpoint is http."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Backend-specific settings passed through unchanged (obstore config keys for S3/GCS/Azure)."""
    hedge: Hedge | None = field(default_factory=Hedge)
    """Hedged reads: a second GET for a request that straggles ([`Hedge`][asyncload.Hedge]);
    ``None`` switches them off. Never used for local files."""
    cache_dir: str | None = None
    """Directory of the local cache of whole objects, shared by every process on the machine
    (``None``: the ``ASYNCLOAD_CACHE_DIR`` environment variable, or no cache)."""
    cache_max_bytes: int | None = None
    """Size cap of ``cache_dir``; least recently used objects are evicted (``None``: no cap)."""
    cache_revalidate: bool = False
    """Check a cached object's ETag and size against the store (a HEAD) before using it."""

    def __post_init__(self) -> None:
        if self.connect_timeout <= 0 or self.read_timeout <= 0:
            raise ValueError("connect_timeout and read_timeout must be positive")
        if self.total_timeout is not None and self.total_timeout <= 0:
            raise ValueError("total_timeout must be positive or None")
        if not isinstance(self.retry, Retry):
            raise TypeError(f"retry must be an asyncload.Retry, not {type(self.retry).__name__}")
        if self.hedge is not None and not isinstance(self.hedge, Hedge):
            raise TypeError(
                f"hedge must be an asyncload.Hedge or None, not {type(self.hedge).__name__}"
            )
        if self.cache_max_bytes is not None and self.cache_max_bytes < 1:
            raise ValueError(
                f"cache_max_bytes must be positive or None, got {self.cache_max_bytes}"
            )
        # Plain dicts: picklable and copied, so a caller mutating theirs changes nothing here.
        object.__setattr__(self, "headers", dict(self.headers))
        object.__setattr__(self, "extra", dict(self.extra))
        if self.credentials is not None:
            object.__setattr__(self, "credentials", dict(self.credentials))


DEFAULT_OPTIONS = StorageOptions()


@dataclass(slots=True)
class Resume:
    """What one [`stream`][asyncload.stream] download knows about the object across its attempts.

    The first attempt's backend records the object's version (``etag``, ``size``); an attempt
    that resumes at ``start > 0`` asks only for that version (HTTP ``If-Match`` and
    ``If-Range``, S3 ``if_match``) and checks what it got, so two versions are never spliced.
    A changed object is reported as ``AttemptFailed(ObjectChanged, ..., status=412)``.

    Examples:
        >>> resume = Resume()
        >>> resume.etag is None
        True
    """

    etag: str | None = None
    """The validator of the first response (an ETag, or a backend's own, e.g. local files)."""
    size: int | None = None
    """The object's full size as the first response announced it, when known."""


class Backend(abc.ABC):
    """One storage protocol (URL scheme): subclass it and [`register`][asyncload.sources.register]
    an instance to make ``asyncload.read``, ``stream``, ``stat`` and ``list_files`` (and so
    every dataset) work with a new scheme.

    Every method makes a **single attempt** and reports a failure by raising
    [`AttemptFailed`][asyncload.sources.AttemptFailed]; retries, hedged reads, the local cache,
    stats and the public errors are handled around it. Any other exception is taken for a bug
    (or a cancellation) and propagates as it is. ``options`` is the
    [`StorageOptions`][asyncload.StorageOptions] configured for the URL's prefix.

    Examples:
        >>> import asyncload
        >>> from asyncload.sources import AttemptFailed, Backend, register
        >>> OBJECTS = {"mem://b/a.txt": b"hello"}
        >>> class Memory(Backend):
        ...     async def read(self, url, start, end, options):
        ...         if url not in OBJECTS:
        ...             raise AttemptFailed(asyncload.NotFound, "no such object", status=404)
        ...         return OBJECTS[url][start or 0 : end]
        ...     async def stream(self, url, start, chunk_size, options):
        ...         yield await self.read(url, start, None, options)
        ...     async def stat(self, url, options):
        ...         return asyncload.ObjectInfo(url, len(OBJECTS[url]), None, None)
        ...     async def list(self, prefix_url, options):
        ...         return [u for u in OBJECTS if u.startswith(prefix_url)]
        >>> register("mem", Memory())
        >>> asyncload.read_sync("mem://b/a.txt")
        b'hello'
    """

    @abc.abstractmethod
    async def read(
        self, url: str, start: int | None, end: int | None, options: StorageOptions
    ) -> bytes:
        """Bytes ``[start, end)`` of the object; all of it when both are ``None``."""

    @abc.abstractmethod
    def stream(
        self, url: str, start: int, chunk_size: int, options: StorageOptions
    ) -> AsyncGenerator[bytes, None]:
        """Chunks of roughly *chunk_size* bytes from offset *start* to the end."""

    def stream_version(
        self, url: str, start: int, chunk_size: int, options: StorageOptions, resume: Resume
    ) -> AsyncGenerator[bytes, None]:
        """Like [`stream`][asyncload.stream], but of one version of the object only: what
        [`stream`][asyncload.stream] calls, with the same *resume* on every attempt.

        When ``resume.etag`` is ``None``, record the object's validator (and size) there from
        the response. Otherwise (a resume at ``start > 0``) read only that version (HTTP
        ``If-Match``/``If-Range``, obstore ``GetOptions(if_match=...)``) and raise
        ``AttemptFailed(ObjectChanged, ..., status=412)`` when the object is another one now.

        The default is plain ``stream``, which cannot tell that the object was replaced
        between a cut and the resume; backends override it.
        """
        del resume
        return self.stream(url, start, chunk_size, options)

    @abc.abstractmethod
    async def stat(self, url: str, options: StorageOptions) -> ObjectInfo:
        """Size, etag and mtime of one object."""

    @abc.abstractmethod
    async def list(self, prefix_url: str, options: StorageOptions) -> list[str]:
        """Full URLs of every object under *prefix_url* (any order)."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook, most backends hold nothing
        """Close clients bound to the running event loop."""


# Per process: read(url) finds the backend by the URL's scheme alone, and every reader of the
# process shares its clients; a worker rebuilds it by importing the modules that register.
_registry: dict[str, Backend] = {}

# True in the task of a hedge (_hedge). A backend whose connection pool is a Python queue
# (aiohttp's) sends hedges on connections of their own: a hedge is sent when its primary's pool
# is busiest, and one waiting in that pool's queue would wait as long as its straggler.
hedging: contextvars.ContextVar[bool] = contextvars.ContextVar("asyncload_hedging", default=False)


def register(scheme: str, backend: Backend) -> None:
    """Serve URLs that start with ``scheme://`` with *backend* (replaces an earlier one).

    Register in the main process before iterating a loader, at import time of a module the
    workers import too (with ``forkserver`` and ``spawn`` they import your modules again, not
    your registrations): the module that defines the backend is a good place.

    Args:
        scheme: The URL scheme, without ``://``; compared in lower case.
        backend: The [`Backend`][asyncload.sources.Backend] instance that serves it.

    Examples:
        >>> from asyncload.sources import register, registered_schemes
        >>> register("mem", Memory())  # doctest: +SKIP
        >>> "mem" in registered_schemes()  # doctest: +SKIP
        True
    """
    _registry[scheme.lower()] = backend


def registered_schemes() -> list[str]:
    """The registered URL schemes, sorted; ``""`` stands for plain paths.

    Examples:
        >>> from asyncload.sources import registered_schemes
        >>> {"http", "https", "file", ""} <= set(registered_schemes())
        True
    """
    return sorted(_registry)


def split_scheme(url: str) -> str:
    """The URL's scheme in lower case, ``""`` for a plain path."""
    end = url.find("://")
    if end <= 0:
        return ""
    scheme = url[:end]
    known = _SCHEMES.get(scheme)  # every sample's URL passes here: skip re-validating
    if known is not None:
        return known
    if not scheme.replace("+", "").replace("-", "").isalnum():
        return ""
    if len(_SCHEMES) < 64:
        _SCHEMES[scheme] = scheme.lower()
    return scheme.lower()


_SCHEMES: dict[str, str] = {}


def backend_for(url: str) -> Backend:
    """The backend serving *url*; ``InvalidURL`` lists the schemes there are.

    Examples:
        >>> from asyncload.sources import backend_for
        >>> type(backend_for("https://example.com/x")).__name__
        'HttpBackend'
    """
    if not isinstance(url, str):
        raise InvalidURL(f"a URL must be a str, not {type(url).__name__}: {url!r}")
    try:
        return _registry[split_scheme(url)]
    except KeyError:
        known = ", ".join(f"{s}://" if s else "plain paths" for s in registered_schemes())
        raise InvalidURL(
            f"no storage backend for the scheme of {url!r}; registered: {known}. "
            "Register one with asyncload.sources.register(scheme, backend)",
            url=url,
        ) from None


# Printable ASCII but space, and no stray `%`: a URL that can go on the wire as it is.
_WIRE_READY = re.compile(r"[\x21-\x7e]*\Z")
_STRAY_PERCENT = re.compile(r"%(?![0-9A-Fa-f]{2})")
# RFC 3986 reserved characters and `%` stay as they are (they carry meaning, and presigned
# signatures were computed over them); everything else that cannot be sent is percent-encoded.
_KEEP = "!#$%&'()*+,/:;=?@[]~"
# Host parts whose port and IPv6 literal urlsplit accepted. It only looks at the host part, and
# a loader sends thousands of URLs to a handful of hosts: parsing each (~5 us) was the costliest
# step of a URL's check, on the path of every request.
_SOUND_NETLOCS: set[str] = set()
_MAX_NETLOCS = 1024


def encode_url(url: str) -> str:
    """*url* as it must go on the wire, or ``AttemptFailed`` (``InvalidURL``).

    Spaces, TABs, control and non-ASCII characters in the path and query are percent-encoded
    (UTF-8), as is a ``%`` that starts no escape; escapes already there are kept, so a presigned
    URL stays valid. What cannot name one object is refused instead of being silently changed:
    a lone surrogate, whitespace in the host, a port out of range, a broken IPv6 literal.

    Examples:
        >>> encode_url("http://h/a b\\tc.bin?x=ä")
        'http://h/a%20b%09c.bin?x=%C3%A4'
    """
    if _WIRE_READY.match(url) and "%" not in url:
        checked = url
    else:
        try:
            url.encode("utf-8")
        except UnicodeEncodeError as exc:
            bad = url[exc.start]
            raise AttemptFailed(
                InvalidURL,
                f"the URL holds a lone surrogate ({bad!a} at position {exc.start}), which "
                "no URL can carry; it usually comes from bytes decoded with "
                "errors='surrogateescape': build the URL from the real file name",
            ) from None
        head, netloc, tail = split_authority(url)
        if not _WIRE_READY.match(netloc):
            raise AttemptFailed(
                InvalidURL,
                "the URL's host part holds a space, a control or a non-ASCII character; "
                "fix the host name (internationalized names go in their xn-- form)",
            )
        tail = _STRAY_PERCENT.sub("%25", tail)
        checked = head + netloc + quote(tail, safe=_KEEP)
    netloc = split_authority(checked)[1]
    if netloc not in _SOUND_NETLOCS:
        try:
            urlsplit(checked).port  # noqa: B018 - parses the port and any IPv6 literal
        except ValueError as exc:
            raise AttemptFailed(InvalidURL, f"malformed URL ({exc})") from None
        if len(_SOUND_NETLOCS) >= _MAX_NETLOCS:
            _SOUND_NETLOCS.clear()
        _SOUND_NETLOCS.add(netloc)
    return checked
