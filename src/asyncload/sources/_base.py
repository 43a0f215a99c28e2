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
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field
from typing import Any

from .._exceptions import InvalidURL
from .._retry import Retry

__all__ = [
    "Backend",
    "ObjectInfo",
    "StorageOptions",
    "backend_for",
    "pool_size",
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

    def __post_init__(self) -> None:
        if self.connect_timeout <= 0 or self.read_timeout <= 0:
            raise ValueError("connect_timeout and read_timeout must be positive")
        if self.total_timeout is not None and self.total_timeout <= 0:
            raise ValueError("total_timeout must be positive or None")
        if not isinstance(self.retry, Retry):
            raise TypeError(f"retry must be an asyncload.Retry, not {type(self.retry).__name__}")
        # Plain dicts: picklable and copied, so a caller mutating theirs changes nothing here.
        object.__setattr__(self, "headers", dict(self.headers))
        object.__setattr__(self, "extra", dict(self.extra))
        if self.credentials is not None:
            object.__setattr__(self, "credentials", dict(self.credentials))


DEFAULT_OPTIONS = StorageOptions()


class Backend(abc.ABC):
    """One storage protocol. Every method makes a single attempt and may raise
    ``AttemptFailed``; anything else is a bug or a cancellation.

    Examples:
        >>> class Memory(Backend):  # doctest: +SKIP
        ...     async def read(self, url, start, end, options):
        ...         return OBJECTS[url][start or 0 : end]
        ...     # stream, stat, list, aclose ...
        >>> register("mem", Memory())  # doctest: +SKIP
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

    @abc.abstractmethod
    async def stat(self, url: str, options: StorageOptions) -> ObjectInfo:
        """Size, etag and mtime of one object."""

    @abc.abstractmethod
    async def list(self, prefix_url: str, options: StorageOptions) -> list[str]:
        """Full URLs of every object under *prefix_url* (any order)."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook, most backends hold nothing
        """Close clients bound to the running event loop."""


_registry: dict[str, Backend] = {}

# Connections per host a lazily created client may keep; the loader sets its max_concurrency.
_pool_size = [64]


def pool_size() -> int:
    """The connection-pool size new clients are created with."""
    return _pool_size[0]


def set_pool_size(n: int) -> None:
    if n < 1:
        raise ValueError(f"pool size must be at least 1, got {n}")
    _pool_size[0] = n


def register(scheme: str, backend: Backend) -> None:
    """Serve URLs that start with ``scheme://`` with *backend* (replaces an earlier one)."""
    _registry[scheme.lower()] = backend


def registered_schemes() -> list[str]:
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
    """The backend serving *url*; ``InvalidURL`` lists the schemes there are."""
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
