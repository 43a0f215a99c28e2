"""Every error asyncload raises derives from ``LoadError``.

Each subclass also inherits the built-in exception a caller already expects, so
``except FileNotFoundError`` or ``except TimeoutError`` keep working::

    LoadError
    ├── StorageError                    a request to storage failed (url, status, attempts)
    │   ├── NotFound                    + FileNotFoundError   404, NoSuchKey, ENOENT
    │   ├── PermissionDenied            + PermissionError     401, 403, EACCES
    │   ├── ConnectError                + ConnectionError     refused, reset, DNS, TLS
    │   ├── ServerError                                       5xx, 429, SlowDown after retries
    │   ├── IncompleteRead                                    body shorter than announced
    │   ├── InvalidURL                  + ValueError          unknown scheme, malformed URL
    │   ├── RedirectError                                     redirect to another host, not followed
    │   ├── ObjectChanged                                     replaced while a stream resumed
    │   └── RequestTimeout              (+ Timeout)           connect or read timed out
    ├── Timeout                         + TimeoutError
    │   ├── RequestTimeout              (+ StorageError)
    │   └── BatchTimeout                + RuntimeError        DataLoader(timeout=...) exceeded
    ├── WorkerError                     + RuntimeError        a worker died or could not start
    ├── NotPicklable                    + TypeError           dataset/collate_fn can't be sent
    ├── ArchiveError                    + ValueError          unsafe or corrupt tar shard
    └── SampleErrorBudgetExceeded       + RuntimeError        more samples skipped than allowed

Warnings (``warnings.warn`` categories)::

    UserWarning
    └── AsyncloadWarning                something works, not the way it was asked for
        ├── BlockedLoopWarning          a blocking call inside async code held a worker's loop
        └── StuckSampleWarning          a sample's fetch has awaited for minutes, loop turning

Messages never contain credentials: every URL passes through ``redact_url``.
"""

from __future__ import annotations

import os
import sys
from types import FrameType

from ._redact import redact_url

__all__ = [
    "ArchiveError",
    "AsyncloadWarning",
    "BatchTimeout",
    "BlockedLoopWarning",
    "ConnectError",
    "IncompleteRead",
    "InvalidURL",
    "LoadError",
    "NotFound",
    "NotPicklable",
    "ObjectChanged",
    "PermissionDenied",
    "RedirectError",
    "RequestTimeout",
    "SampleErrorBudgetExceeded",
    "ServerError",
    "StorageError",
    "StuckSampleWarning",
    "Timeout",
    "WorkerError",
    "add_note",
    "user_stacklevel",
]


class LoadError(Exception):
    """Root of every error raised by asyncload.

    Examples:
        >>> try:
        ...     raise NotFound("missing", url="s3://bucket/key", status=404)
        ... except LoadError as exc:
        ...     print(type(exc).__name__, exc.url)
        NotFound s3://bucket/key
    """


class StorageError(LoadError):
    """A read, stat or list against storage failed.

    Attributes:
        url: The URL, with credentials redacted.
        status: The HTTP status (or the closest equivalent), ``None`` when no response came.
        attempts: How many attempts were made, retries included.
    """

    def __init__(
        self, message: str, *, url: str | None = None, status: int | None = None, attempts: int = 1
    ) -> None:
        self.url = redact_url(url) if url is not None else None
        self.status = status
        self.attempts = attempts
        message = redact_url(message)
        details = []
        if self.url is not None and self.url not in message:
            details.append(self.url)
        if status is not None:
            details.append(f"status {status}")
        if attempts > 1:
            details.append(f"after {attempts} attempts")
        if details:
            message = f"{message} ({', '.join(details)})"
        super().__init__(message)

    def __reduce__(self) -> tuple[object, ...]:
        # Keyword-only fields must survive the trip from a worker process to the main one.
        return (
            _rebuild_storage_error,
            (type(self), self.args[0], self.url, self.status, self.attempts),
        )


def _rebuild_storage_error(
    cls: type[StorageError], message: str, url: str | None, status: int | None, attempts: int
) -> StorageError:
    exc = cls.__new__(cls)
    Exception.__init__(exc, message)
    exc.url, exc.status, exc.attempts = url, status, attempts
    return exc


class NotFound(StorageError, FileNotFoundError):
    """The object does not exist (HTTP 404, S3 NoSuchKey, a missing file). Never retried."""


class PermissionDenied(StorageError, PermissionError):
    """Credentials are missing or not allowed to read the object (401/403). Never retried."""


class ConnectError(StorageError, ConnectionError):
    """No connection could be made or kept (refused, reset, DNS, TLS verification)."""


class ServerError(StorageError):
    """The server kept failing (5xx, 429, SlowDown) after every retry was spent."""


class IncompleteRead(StorageError):
    """The body ended before its announced length, on every attempt."""


class InvalidURL(StorageError, ValueError):
    """The URL is malformed or its scheme has no registered backend."""


class RedirectError(StorageError):
    """A redirect went to another host or to a non-HTTP URL and was not followed.

    Cross-host redirects are refused unless ``allow_cross_host_redirects=True`` is configured for
    the prefix; redirects to ``file:`` and other schemes are always refused. Never retried.
    """


class ObjectChanged(StorageError):
    """The object was replaced while [`stream`][asyncload.stream] was reading it. Never retried.

    A cut download is resumed only for the version it started with (``If-Match``/``If-Range``
    with the first response's ETag); bytes of two versions are never spliced. Part of the old
    version was already delivered, so read the object again from the start.
    """


class Timeout(LoadError, TimeoutError):
    """Something took longer than its deadline."""


class RequestTimeout(StorageError, Timeout):
    """Connecting, or reading the body, exceeded its timeout on every attempt."""


class BatchTimeout(Timeout, RuntimeError):
    """No batch arrived within ``DataLoader(timeout=...)`` seconds.

    Also a ``RuntimeError``, which is what torch's DataLoader raises in this case.
    """


class WorkerError(LoadError, RuntimeError):
    """A worker process died, was killed, or could not be started.

    Attributes:
        worker_id: The worker's id (0-based), or ``None``.
        pid: The worker's process id, or ``None``.
        exitcode: Its exit code; negative values are the signal that killed it.
    """

    def __init__(
        self,
        message: str,
        *,
        worker_id: int | None = None,
        pid: int | None = None,
        exitcode: int | None = None,
    ) -> None:
        super().__init__(message)
        self.worker_id = worker_id
        self.pid = pid
        self.exitcode = exitcode


class NotPicklable(LoadError, TypeError):
    """An object the workers need (dataset, collate_fn, worker_init_fn) can't be pickled."""


class ArchiveError(LoadError, ValueError):
    """A tar shard is corrupt or holds an unsafe member (absolute path, ``..``, link, device)."""


class AsyncloadWarning(UserWarning):
    """Something works, but not the way it was asked for (e.g. a start-method fallback)."""


class BlockedLoopWarning(AsyncloadWarning):
    """A blocking call inside ``async def`` held a worker's event loop longer than a threshold.

    Every other request of that worker waits meanwhile. Raised once per worker (and again when
    a loop stays blocked for 10 s), naming the dataset, the sample index and the blocking line.
    Await an async client instead, or move the blocking code off the loop with
    ``await asyncio.to_thread(...)``. ``ASYNCLOAD_SLOW_CALLBACK`` sets the threshold in seconds
    (default 0.1; ``0`` turns the check off).

    Examples:
        >>> import warnings, asyncload
        >>> warnings.simplefilter("error", asyncload.BlockedLoopWarning)  # make it fatal
    """


class StuckSampleWarning(AsyncloadWarning):
    """A sample's fetch has awaited something for a long time while the loop went on turning.

    Not a blocking call (``BlockedLoopWarning``): the event loop runs, but one
    ``async def __getitem__`` waits on an await that never completes (a future nobody sets, a
    lock never released, a request with no timeout). With ``timeout=0`` the DataLoader waits
    for it for ever, as torch's does; this says which sample and where it waits. Raised once
    per worker, naming the dataset, the index and the coroutine's stack.
    ``ASYNCLOAD_STUCK_SAMPLE`` sets the threshold in seconds (default 300; ``0`` turns the
    check off).

    Examples:
        >>> import warnings, asyncload
        >>> warnings.simplefilter("error", asyncload.StuckSampleWarning)  # make it fatal
    """


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``, also on Python 3.10 (where it is kept but not displayed)."""
    if sys.version_info >= (3, 11):
        exc.add_note(note)
    else:  # pragma: no cover - Python 3.10
        notes = getattr(exc, "__notes__", None) or []
        exc.__notes__ = [*notes, note]  # type: ignore[attr-defined]


class SampleErrorBudgetExceeded(LoadError, RuntimeError):
    """More samples failed than ``DataLoader(max_sample_errors=...)`` allows.

    The message lists the first failures (index, URL where the error names one, cause).

    Examples:
        >>> loader = asyncload.DataLoader(
        ...     ds, sample_errors="skip", max_sample_errors=10
        ... )  # doctest: +SKIP
    """


PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
"""The asyncload package's folder: a frame whose file lies under it is asyncload's own."""


def user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning raised by our caller at the user's line.

    Counts the frames up to the first one outside the asyncload package (works before
    Python 3.12's ``skip_file_prefixes``).
    """
    level = 1
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(PACKAGE_DIR):
        frame = frame.f_back
        level += 1
    return level
