"""``s3://``, ``gs://`` and ``az://`` through obstore (Rust object_store; ~100 µs of CPU per GET).

One store per bucket (container) per process, built on first use from the bucket URL, the cloud's
standard environment variables, and the options configured for the URL's prefix. obstore's own
retries are turned off (``max_retries=0``) so that ``asyncload.Retry`` alone decides, and
the attempt count in errors and stats is the true one.

Fork safety: obstore runs a Tokio runtime in background threads. A process forked from a parent
that has used obstore inherits the runtime's state without its threads and hangs on first use.
Worker processes must therefore be started with ``forkserver`` or ``spawn`` (the DataLoader's
default) whenever the main process touches these URLs, e.g. through ``asyncload.list_files``.
"""

from __future__ import annotations

import os
import re
from collections.abc import AsyncGenerator
from datetime import timedelta
from typing import Any

from .._exceptions import (
    ConnectError,
    IncompleteRead,
    InvalidURL,
    NotFound,
    PermissionDenied,
    RequestTimeout,
    ServerError,
    StorageError,
)
from .._retry import AttemptFailed
from ._base import Backend, ObjectInfo, StorageOptions, pool_size, register

__all__ = ["ObjectStoreBackend", "map_error", "split_bucket"]

_STATUS = re.compile(r"(?:status(?: code)?:? )(\d{3})")
# Without a total timeout a large object would be cut off at obstore's default of 30 s; the
# read timeout is what catches a stalled body.
_NO_TOTAL_TIMEOUT = timedelta(hours=24)

_CREDENTIAL_HINTS = {
    "s3": "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (plus AWS_SESSION_TOKEN for temporary "
    "credentials), or call asyncload.configure('s3://bucket', credentials={'access_key_id': ..., "
    "'secret_access_key': ...}); check the bucket policy and AWS_ENDPOINT_URL",
    "gs": "set GOOGLE_APPLICATION_CREDENTIALS (or GOOGLE_SERVICE_ACCOUNT) to a service-account "
    "key file, or call asyncload.configure('gs://bucket', "
    "credentials={'service_account_key': ...})",
    "az": "set AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY (or "
    "AZURE_STORAGE_SAS_KEY), or call asyncload.configure('az://container', "
    "credentials={'account_key': ...})",
}


def split_bucket(url: str) -> tuple[str, str, str]:
    """``"s3://bucket/a/b"`` → ``("s3", "bucket", "a/b")``."""
    scheme, _, rest = url.partition("://")
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise AttemptFailed(InvalidURL, f"no bucket in {url!r}; expected {scheme}://bucket/key")
    return scheme.lower(), bucket, key


def _s3_endpoint(options: StorageOptions) -> str | None:
    return (
        options.endpoint
        or os.environ.get("AWS_ENDPOINT_URL_S3")
        or os.environ.get("AWS_ENDPOINT_URL")
        or os.environ.get("AWS_ENDPOINT")
    )


def _build_store(scheme: str, bucket: str, options: StorageOptions) -> Any:
    try:
        from obstore.store import from_url
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise AttemptFailed(
            InvalidURL, f"{scheme}:// URLs need obstore: pip install 'asyncload-torch[s3]' ({exc})"
        ) from exc
    config: dict[str, Any] = {}
    allow_http = options.allow_http
    if scheme == "s3":
        endpoint = _s3_endpoint(options)
        if options.endpoint:
            config["endpoint"] = options.endpoint
        if options.region:
            config["region"] = options.region
        if allow_http is None:
            allow_http = bool(endpoint and endpoint.startswith("http://"))
    elif options.endpoint:
        config["endpoint"] = options.endpoint
    config.update(options.credentials or {})
    config.update(options.extra)
    client: dict[str, Any] = {
        "connect_timeout": timedelta(seconds=options.connect_timeout),
        "read_timeout": timedelta(seconds=options.read_timeout),
        "timeout": (
            timedelta(seconds=options.total_timeout) if options.total_timeout else _NO_TOTAL_TIMEOUT
        ),
        "pool_max_idle_per_host": str(pool_size()),
    }
    if allow_http:
        client["allow_http"] = True
    if not options.verify:
        client["allow_invalid_certificates"] = True
    if options.ca_bundle:
        with open(options.ca_bundle, "rb") as f:
            client["root_certificate"] = f.read()
    if options.headers:
        client["default_headers"] = dict(options.headers)
    # asyncload.Retry decides; obstore makes exactly one attempt per call.
    retry = {"max_retries": 0, "retry_timeout": timedelta(seconds=options.read_timeout * 4)}
    build: Any = from_url  # its overloads want TypedDicts; ours are checked above
    try:
        return build(
            f"{scheme}://{bucket}", config=config, client_options=client, retry_config=retry
        )
    except Exception as exc:
        raise AttemptFailed(InvalidURL, f"cannot configure the {scheme} store: {exc}") from exc


def map_error(exc: BaseException, scheme: str = "s3") -> AttemptFailed:
    """Translate an obstore exception from one attempt into an AttemptFailed."""
    from obstore.exceptions import (
        InvalidPathError,
        PermissionDeniedError,
        UnauthenticatedError,
    )

    text = str(exc)
    summary = text.split("\n\nDebug source", 1)[0].strip()
    if len(summary) > 400:
        summary = summary[:400] + "…"
    match = _STATUS.search(text)
    status = int(match.group(1)) if match else None
    if isinstance(exc, FileNotFoundError) or status == 404:
        return AttemptFailed(NotFound, "no such object", status=status or 404)
    if isinstance(exc, (PermissionDeniedError, UnauthenticatedError)) or status in (401, 403):
        return AttemptFailed(
            PermissionDenied,
            f"access denied: {summary}; {_CREDENTIAL_HINTS.get(scheme, '')}".rstrip("; "),
            status=status,
        )
    if "SlowDown" in text:
        return AttemptFailed(
            ServerError,
            "throttled (SlowDown)",
            status=status or 503,
            retryable=True,
            reason="SlowDown",
        )
    if status is not None and (status >= 500 or status == 429):
        return AttemptFailed(
            ServerError, summary, status=status, retryable=True, reason=str(status)
        )
    if status is not None and status >= 400:
        return AttemptFailed(StorageError, summary, status=status)
    if isinstance(exc, (InvalidPathError, ValueError)):
        return AttemptFailed(InvalidURL, summary)
    if "ConnectionRefused" in text or "dns error" in text:
        return AttemptFailed(ConnectError, f"cannot connect: {summary}")
    if "TimedOut" in text or "timed out" in text or "Timeout" in text:
        return AttemptFailed(RequestTimeout, summary, retryable=True, reason="timeout")
    if "kind: Body" in text or "kind: Decode" in text:
        return AttemptFailed(IncompleteRead, summary, retryable=True, reason="incomplete")
    return AttemptFailed(ConnectError, summary, retryable=True, reason="connection")


class ObjectStoreBackend(Backend):
    """obstore-based backend for S3 (and S3-compatible), Google Cloud Storage and Azure Blob.

    Examples:
        >>> asyncload.configure("s3://bucket", endpoint="http://127.0.0.1:9000")  # doctest: +SKIP
        >>> data = await asyncload.read("s3://bucket/train/0001.jpg")  # doctest: +SKIP
    """

    def __init__(self) -> None:
        # (scheme, bucket, id(options)) -> (options, store); options kept so the id stays valid.
        self._stores: dict[tuple[str, str, int], tuple[StorageOptions, Any]] = {}
        self._pid = os.getpid()

    def clear(self) -> None:
        """Forget every store (new options or credentials take effect on next use)."""
        self._stores.clear()

    def _store(self, scheme: str, bucket: str, options: StorageOptions) -> Any:
        if self._pid != os.getpid():  # a store never crosses a fork
            self._stores.clear()
            self._pid = os.getpid()
        key = (scheme, bucket, id(options))
        entry = self._stores.get(key)
        if entry is None:
            entry = self._stores[key] = (options, _build_store(scheme, bucket, options))
        return entry[1]

    async def read(
        self, url: str, start: int | None, end: int | None, options: StorageOptions
    ) -> bytes:
        import obstore

        scheme, bucket, key = split_bucket(url)
        store = self._store(scheme, bucket, options)
        try:
            if end is not None:
                first = start or 0
                if end <= first:
                    return b""
                return bytes(await obstore.get_range_async(store, key, start=first, end=end))
            result = await obstore.get_async(
                store, key, options={"range": {"offset": start}} if start else None
            )
            data = await result.bytes_async()
        except Exception as exc:
            raise map_error(exc, scheme) from exc
        lo, hi = result.range
        if len(data) != hi - lo:
            raise AttemptFailed(
                IncompleteRead,
                f"body has {len(data)} bytes, expected {hi - lo}",
                retryable=True,
                reason="incomplete",
            )
        return bytes(data)

    async def stream(
        self, url: str, start: int, chunk_size: int, options: StorageOptions
    ) -> AsyncGenerator[bytes, None]:
        import obstore

        scheme, bucket, key = split_bucket(url)
        store = self._store(scheme, bucket, options)
        try:
            result = await obstore.get_async(
                store, key, options={"range": {"offset": start}} if start else None
            )
            async for chunk in result.stream(min_chunk_size=chunk_size):
                yield bytes(chunk)
        except AttemptFailed:
            raise
        except Exception as exc:
            raise map_error(exc, scheme) from exc

    async def stat(self, url: str, options: StorageOptions) -> ObjectInfo:
        import obstore

        scheme, bucket, key = split_bucket(url)
        store = self._store(scheme, bucket, options)
        try:
            meta = await obstore.head_async(store, key)
        except Exception as exc:
            raise map_error(exc, scheme) from exc
        modified = meta.get("last_modified")
        return ObjectInfo(
            url=url,
            size=int(meta["size"]),
            etag=meta.get("e_tag"),
            mtime=modified.timestamp() if modified is not None else None,
        )

    async def list(self, prefix_url: str, options: StorageOptions) -> list[str]:
        import obstore

        scheme, bucket, prefix = split_bucket(prefix_url)
        store = self._store(scheme, bucket, options)
        base = f"{scheme}://{bucket}/"
        urls: list[str] = []
        try:
            # object_store follows continuation tokens; 1,000 keys per page is S3's maximum.
            async for page in obstore.list(store, prefix.rstrip("/") or None, chunk_size=1000):
                urls.extend(base + meta["path"] for meta in page)
        except Exception as exc:
            raise map_error(exc, scheme) from exc
        return urls


_backend = ObjectStoreBackend()
for _scheme in ("s3", "gs", "az"):
    register(_scheme, _backend)
