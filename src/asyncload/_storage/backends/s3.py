"""``s3://``, ``gs://`` and ``az://`` through obstore (Rust object_store; 0.1-0.3 ms CPU a GET).

One store per bucket (container) per process, built on first use from the bucket URL, the cloud's
standard environment variables, and the options configured for the URL's prefix, mapped to each
store's own configuration keys by ``._cloud_config``. obstore's own
retries are turned off (``max_retries=0``) so that [`Retry`][asyncload.Retry] alone decides, and
the attempt count in errors and stats is the true one (an attempt is one GET, or two where a
whole read falls back to a plain one, below).

A whole object is read with one call, a range from its start to far past its end (which the
store clamps), not ``get_async`` then ``bytes_async``: each call's answer crosses from
obstore's threads to the event loop (a wake-up and the GIL), and one crossing instead of two
cost 264-288 us of CPU per 100 KB object against 363-419 us, in a raw loop of 4,096 reads
at 128 in flight, 50 ms (2026-11-28). An empty object cannot be ranged (416): a plain GET
reads it; an endpoint that ignores ranges gets plain GETs from its first answer on. A read
that must match a version (``if_match``) keeps the plain GET, whose answer carries the ETag
to check.

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

from ..._exceptions import (
    ConnectError,
    IncompleteRead,
    InvalidURL,
    NotFound,
    ObjectChanged,
    PermissionDenied,
    RequestTimeout,
    ServerError,
    StorageError,
)
from ..retry import AttemptFailed
from ..state import current, pool_size
from .base import DEFAULT_OPTIONS, Backend, ObjectInfo, Resume, StorageOptions, register
from .cloud import check_options, store_config, unmatched_refusal

__all__ = ["ObjectStoreBackend", "map_error", "split_bucket"]

_STATUS = re.compile(r"(?:status(?: code)?:? )(\d{3})")
_TLS = re.compile(r"certificate|UnknownIssuer|InvalidCertificate|tls handshake", re.IGNORECASE)
_CHANGED = (
    "the object changed since the first byte was read (its ETag no longer matches); "
    "read it again from the start"
)
# Without a total timeout a large object would be cut off at obstore's default of 30 s; the
# read timeout is what catches a stalled body.
_NO_TOTAL_TIMEOUT = timedelta(hours=24)
# The end of a range that reads an object to its end: the store clamps it (module doc).
_TO_END = 1 << 62
# object_store's refusals of an answer to a ranged GET that a plain GET does not need: a 200
# (an endpoint that ignores ranges), a 206 without a Content-Range it can read.
_UNRANGED = re.compile(r"non-partial response when range requested|Content-Range")

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


def _build_store(scheme: str, bucket: str, options: StorageOptions) -> Any:
    try:
        from obstore.store import from_url
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise AttemptFailed(
            InvalidURL, f"{scheme}:// URLs need obstore: pip install 'asyncload-torch[s3]' ({exc})"
        ) from exc
    try:
        config, client = store_config(scheme, options)
    except OSError as exc:  # an unreadable ca_bundle / SSL_CERT_FILE
        raise AttemptFailed(ConnectError, f"cannot read the CA bundle: {exc}") from exc
    client.update(
        connect_timeout=timedelta(seconds=options.connect_timeout),
        read_timeout=timedelta(seconds=options.read_timeout),
        timeout=(
            timedelta(seconds=options.total_timeout) if options.total_timeout else _NO_TOTAL_TIMEOUT
        ),
        pool_max_idle_per_host=str(pool_size()),
    )
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
        PreconditionError,
        UnauthenticatedError,
    )

    text = str(exc)
    summary = text.split("\n\nDebug source", 1)[0].strip()
    if len(summary) > 400:
        summary = summary[:400] + "…"
    match = _STATUS.search(text)
    status = int(match.group(1)) if match else None
    if isinstance(exc, PreconditionError) or status == 412:
        return AttemptFailed(ObjectChanged, _CHANGED, status=412)
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
    if status is None and _TLS.search(text):
        # Waiting will not make a certificate valid: fail on the first attempt.
        return AttemptFailed(
            ConnectError,
            f"TLS verification failed ({summary}); trust a private CA with "
            "asyncload.configure(prefix, ca_bundle='/path/to/ca.pem') or SSL_CERT_FILE",
        )
    if "ConnectionRefused" in text or "dns error" in text:
        return AttemptFailed(ConnectError, f"cannot connect: {summary}")
    if "TimedOut" in text or "timed out" in text or "Timeout" in text:
        return AttemptFailed(RequestTimeout, summary, retryable=True, reason="timeout")
    if "kind: Body" in text or "kind: Decode" in text:
        return AttemptFailed(IncompleteRead, summary, retryable=True, reason="incomplete")
    return AttemptFailed(ConnectError, summary, retryable=True, reason="connection")


class ObjectStoreBackend(Backend):
    """obstore-based backend for S3 (and S3-compatible), Google Cloud Storage and Azure Blob.

    ``read`` and ``stream`` take an optional ``if_match`` ETag: the GET is then conditional
    (``If-Match``), and a response for another version of the object, refused by the store
    (412) or noticed here from its ETag (emulators that ignore ``If-Match``), fails with a
    non-retryable ``StorageError`` of status 412 instead of splicing versions.

    Examples:
        >>> asyncload.configure("s3://bucket", endpoint="http://127.0.0.1:9000")  # doctest: +SKIP
        >>> data = await asyncload.read("s3://bucket/train/0001.jpg")  # doctest: +SKIP
    """

    def __init__(self) -> None:
        # (scheme, bucket, id(options)) -> (options, store); options kept so the id stays valid.
        self._stores: dict[tuple[str, str, int], tuple[StorageOptions, Any]] = {}
        # (scheme, bucket) whose endpoint answered a ranged GET in a way object_store refuses
        # (the whole object, or no Content-Range): its whole reads are plain GETs.
        self._unranged: set[tuple[str, str]] = set()
        self._pid = os.getpid()

    def clear(self) -> None:
        """Forget every store (new options or credentials take effect on next use)."""
        self._stores.clear()
        self._unranged.clear()

    def prewarm(self, prefix: str, options: StorageOptions) -> None:
        """Build the store of the bucket a configured *prefix* names (``_storage.prewarm``)."""
        scheme, bucket, _ = split_bucket(prefix)
        self._store(scheme, bucket, options)

    def check_options(self, prefix: str, options: StorageOptions) -> None:
        """Reject, at ``configure()`` time, config keys the prefix's cloud does not know."""
        check_options(prefix, prefix.partition("://")[0].lower(), options)

    def _store(self, scheme: str, bucket: str, options: StorageOptions) -> Any:
        if self._pid != os.getpid():  # a store never crosses a fork
            self._stores.clear()
            self._pid = os.getpid()
        key = (scheme, bucket, id(options))
        entry = self._stores.get(key)
        if entry is None:
            if options is DEFAULT_OPTIONS:
                # The context's configured prefixes (the storage state, not the API above us).
                refusal = unmatched_refusal(scheme, bucket, tuple(current().prefixes))
                if refusal:
                    raise AttemptFailed(InvalidURL, refusal)
            entry = self._stores[key] = (options, _build_store(scheme, bucket, options))
        return entry[1]

    async def read(
        self,
        url: str,
        start: int | None,
        end: int | None,
        options: StorageOptions,
        *,
        if_match: str | None = None,
    ) -> bytes:
        import obstore

        scheme, bucket, key = split_bucket(url)
        store = self._store(scheme, bucket, options)
        try:
            if end is not None:
                first = start or 0
                if end <= first:
                    return b""
                if if_match is None:
                    return bytes(await obstore.get_range_async(store, key, start=first, end=end))
            elif if_match is None and (scheme, bucket) not in self._unranged:
                try:
                    return bytes(
                        await obstore.get_range_async(store, key, start=start or 0, end=_TO_END)
                    )
                except Exception as exc:
                    if map_error(exc, scheme).status == 416:
                        # Nothing from `start` on (an empty object): the plain GET says what is.
                        pass
                    elif _UNRANGED.search(str(exc)):
                        # The endpoint does not do ranges as object_store expects (it sent the
                        # whole object, or no Content-Range): plain GETs for this bucket.
                        self._unranged.add((scheme, bucket))
                    else:
                        raise
            result = await obstore.get_async(store, key, options=_get_options(start, end, if_match))
            _check_version(result, if_match)
            data = await result.bytes_async()
        except AttemptFailed:
            raise
        except Exception as exc:
            raise _map_conditional(exc, scheme, if_match) from exc
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
        self,
        url: str,
        start: int,
        chunk_size: int,
        options: StorageOptions,
        *,
        if_match: str | None = None,
    ) -> AsyncGenerator[bytes, None]:
        import obstore

        scheme, bucket, key = split_bucket(url)
        store = self._store(scheme, bucket, options)
        try:
            result = await obstore.get_async(
                store, key, options=_get_options(start or None, None, if_match)
            )
            _check_version(result, if_match)
            async for chunk in result.stream(min_chunk_size=chunk_size):
                yield bytes(chunk)
        except AttemptFailed:
            raise
        except Exception as exc:
            raise _map_conditional(exc, scheme, if_match) from exc

    async def stream_version(
        self, url: str, start: int, chunk_size: int, options: StorageOptions, resume: Resume
    ) -> AsyncGenerator[bytes, None]:
        """``stream`` of one version: the first response's ETag is kept in *resume* and a
        resumed GET (``start > 0``) is conditional on it (``If-Match``)."""
        import obstore

        scheme, bucket, key = split_bucket(url)
        store = self._store(scheme, bucket, options)
        if_match = resume.etag if start else None
        try:
            result = await obstore.get_async(
                store, key, options=_get_options(start or None, None, if_match)
            )
            _check_version(result, if_match)
            if resume.etag is None:
                resume.etag = result.meta.get("e_tag")
                resume.size = result.meta.get("size")
            async for chunk in result.stream(min_chunk_size=chunk_size):
                yield bytes(chunk)
        except AttemptFailed:
            raise
        except Exception as exc:
            raise _map_conditional(exc, scheme, if_match) from exc

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
            # object_store follows continuation tokens (S3, GCS and Azure page at 1,000 or
            # 5,000 keys); chunk_size only sizes the batches handed to us.
            async for page in obstore.list(store, prefix.rstrip("/") or None, chunk_size=1000):
                urls.extend(base + meta["path"] for meta in page)
        except Exception as exc:
            raise map_error(exc, scheme) from exc
        return urls


def _get_options(start: int | None, end: int | None, if_match: str | None) -> Any:
    options: dict[str, Any] = {}
    if end is not None:
        options["range"] = (start or 0, end)
    elif start:
        options["range"] = {"offset": start}
    if if_match is not None:
        options["if_match"] = if_match
    return options or None


def _map_conditional(exc: BaseException, scheme: str, if_match: str | None) -> AttemptFailed:
    failure = map_error(exc, scheme)
    if if_match is not None and failure.status == 416:
        # The range was valid for the version we started on: the object has since shrunk.
        return AttemptFailed(ObjectChanged, _CHANGED, status=412)
    return failure


def _bare(etag: str) -> str:
    return etag.removeprefix("W/").strip('"')


def _check_version(result: Any, if_match: str | None) -> None:
    """Refuse a response for another version than *if_match*, even if the store sent it."""
    if if_match is None:
        return
    etag = result.meta.get("e_tag")
    if etag is not None and _bare(etag) != _bare(if_match):
        raise AttemptFailed(ObjectChanged, _CHANGED, status=412)


_backend = ObjectStoreBackend()
for _scheme in ("s3", "gs", "az"):
    register(_scheme, _backend)
