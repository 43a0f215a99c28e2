"""What one HTTP attempt's response or exception means: sizes, versions and ``AttemptFailed``.

``backends.http`` sends the requests; this module reads their answers. A status, a short body, a
missing
length or an aiohttp/socket exception becomes an ``AttemptFailed`` naming the asyncload error
and whether a retry may help, so nothing aiohttp-specific leaks past the backend.
"""

from __future__ import annotations

import asyncio
import errno
import re
import time
from email.utils import parsedate_to_datetime

import aiohttp

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
from .base import Resume, StorageOptions

__all__ = [
    "check_length",
    "check_status",
    "check_version",
    "map_error",
    "object_changed",
    "parse_http_date",
    "total_size",
]

# How much of an error body is read for its message (S3 error XML fits).
_ERROR_BODY_BYTES = 4096
_XML_FIELD = re.compile(r"<(\w+)>([^<]{1,300})</\1>")
# OpenSSL's words for "the peer did not answer in TLS" (a plain-HTTP port, usually).
_NOT_TLS = (
    "wrong_version_number",
    "wrong version number",
    "record layer failure",
    "packet length too long",
    "http request",
    "unexpected eof while reading",
)


def parse_http_date(value: str) -> float | None:
    try:
        return parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError, IndexError):
        return None


def _retry_after(resp: aiohttp.ClientResponse) -> float | None:
    value = resp.headers.get("Retry-After")
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    when = parse_http_date(value)
    return None if when is None else max(0.0, when - time.time())


def check_version(resp: aiohttp.ClientResponse, resume: Resume, start: int) -> None:
    """Record the first response's version in *resume*; refuse another one on a resume."""
    etag = resp.headers.get("ETag")
    size = total_size(resp) if resp.status == 206 or resp.content_length is not None else None
    if resume.etag is None or not start:
        resume.etag = etag or resp.headers.get("Last-Modified")
        resume.size = size
        return
    now = etag or resp.headers.get("Last-Modified")
    # A server that ignores If-Match/If-Range (or Range: a 200) still names what it sent.
    if now is not None and now.removeprefix("W/") != resume.etag.removeprefix("W/"):
        raise object_changed(resume.etag, now, start)
    if size is not None and resume.size is not None and size != resume.size:
        raise object_changed(resume.etag, f"{now} (size {resume.size} -> {size})", start)


def object_changed(old: str, new: str | None, start: int) -> AttemptFailed:
    became = f"became {new}" if new else "no longer matches"
    return AttemptFailed(
        ObjectChanged,
        f"the object was replaced while it was being streamed (ETag {old} {became}); "
        f"{start} bytes of the old version were already delivered, so it was not resumed "
        "with the new one: read it again from the start",
        status=412,
    )


async def _body_hint(resp: aiohttp.ClientResponse) -> str:
    """The first line of an error body (S3's `<Code>`/`<Message>`), for the message."""
    try:
        raw = await asyncio.wait_for(resp.content.read(_ERROR_BODY_BYTES), 1.0)
    except Exception:
        return ""
    text = raw.decode("utf-8", "replace")
    code = _XML_FIELD.findall(text)
    if code:
        said = "; ".join(f"{k}: {v.strip()}" for k, v in code if k in ("Code", "Message"))
    else:
        said = " ".join(text.split())[:200]
    return f"; the server said: {said}" if said else ""


async def check_status(resp: aiohttp.ClientResponse) -> None:
    status = resp.status
    if status < 300:
        return
    hint = await _body_hint(resp)
    if status in (404, 410):
        raise AttemptFailed(NotFound, "no such object", status=status)
    if status in (401, 403):
        raise AttemptFailed(
            PermissionDenied,
            "access denied; send credentials with asyncload.configure(prefix, "
            "headers={'Authorization': ...}) or use a (fresh) presigned URL" + hint,
            status=status,
        )
    if status >= 500 or status == 429:
        raise AttemptFailed(
            ServerError,
            f"server answered {status} {resp.reason or ''}".rstrip(),
            status=status,
            retryable=True,
            reason=str(status),
            retry_after=_retry_after(resp),
        )
    raise AttemptFailed(
        StorageError, f"request refused: {status} {resp.reason}{hint}", status=status
    )


def check_length(resp: aiohttp.ClientResponse, received: int) -> None:
    announced = resp.content_length
    if announced is not None and received != announced:
        raise AttemptFailed(
            IncompleteRead,
            f"body has {received} bytes but Content-Length announced {announced}",
            retryable=True,
            reason="incomplete",
        )


def total_size(resp: aiohttp.ClientResponse) -> int:
    content_range = resp.headers.get("Content-Range", "")
    if resp.status == 206 and "/" in content_range:
        total = content_range.rsplit("/", 1)[1]
        if total.isdigit():
            return int(total)
    if resp.content_length is None:
        raise AttemptFailed(StorageError, "the server did not say how large the object is")
    return resp.content_length


def map_error(exc: BaseException, options: StorageOptions) -> AttemptFailed:
    """Translate an aiohttp (or socket) exception from one attempt into an AttemptFailed."""
    if isinstance(exc, AttemptFailed):
        return exc
    if isinstance(exc, aiohttp.ClientSSLError) and any(
        word in str(exc).lower() for word in _NOT_TLS
    ):
        return AttemptFailed(
            ConnectError,
            f"the TLS handshake failed because the server did not answer in TLS ({exc}): "
            "is this server plain HTTP? Then use an http:// URL",
        )
    if isinstance(exc, aiohttp.ClientSSLError):
        return AttemptFailed(
            ConnectError,
            f"TLS verification failed ({exc}); trust a private CA with "
            "asyncload.configure(prefix, ca_bundle='/path/to/ca.pem')",
        )
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return AttemptFailed(
            RequestTimeout,
            f"connect timed out after {options.connect_timeout:g}s",
            retryable=True,
            reason="timeout",
        )
    if isinstance(exc, (aiohttp.ServerTimeoutError, asyncio.TimeoutError)):
        return AttemptFailed(
            RequestTimeout,
            f"read timed out (read_timeout={options.read_timeout:g}s)",
            retryable=True,
            reason="timeout",
        )
    if isinstance(exc, aiohttp.ClientPayloadError):
        return AttemptFailed(
            IncompleteRead, f"body ended early: {exc}", retryable=True, reason="incomplete"
        )
    if isinstance(exc, aiohttp.ClientConnectorDNSError):
        return AttemptFailed(ConnectError, f"unknown host: {exc}")
    if isinstance(exc, aiohttp.ClientConnectorError):
        if exc.os_error.errno == errno.EMFILE:
            # Our own limit, not the server's: waiting won't help, and the fix is local.
            return AttemptFailed(
                ConnectError,
                f"cannot connect: {exc}. This process ran out of file descriptors: raise the "
                "limit (`ulimit -n`, RLIMIT_NOFILE) or lower the DataLoader's max_concurrency",
            )
        # A refused connection means the address is wrong or the server is down: fail fast.
        refused = exc.os_error.errno == errno.ECONNREFUSED
        return AttemptFailed(
            ConnectError,
            f"cannot connect: {exc}",
            retryable=not refused,
            reason="connect",
        )
    if isinstance(exc, (aiohttp.InvalidURL, ValueError)):
        # yarl refuses some URLs urlsplit lets through (text after an IPv6 literal).
        return AttemptFailed(InvalidURL, f"malformed URL: {exc}")
    if isinstance(exc, (aiohttp.ClientError, OSError)):
        return AttemptFailed(
            ConnectError, f"connection lost: {exc!r}", retryable=True, reason="connection"
        )
    raise exc
