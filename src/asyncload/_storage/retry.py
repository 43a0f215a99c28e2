"""The retry policy every storage request runs under, and the loop that applies it.

Backends make exactly one attempt per call and describe a failure as an ``AttemptFailed``
(what went wrong, whether trying again can help, what the server asked for). ``Attempts``
keeps the count for every loop that retries them (``retrying`` here; the hedged read, the
resuming stream and the shard upload elsewhere): it sleeps with exponential backoff and full
jitter, honours ``Retry-After``, counts retries in ``asyncload._stats``, and finally raises the
public error from ``asyncload._exceptions`` with the true number of attempts.

What is retried (the same classes botocore's standard mode retries):

* connection resets and disconnects, timeouts, bodies shorter than announced;
* HTTP 429, 500, 502, 503, 504 and S3 ``SlowDown``.

What is never retried: 400/401/403/404 and other 4xx, refused connections and unknown hosts
(the address is wrong; waiting will not fix it), TLS verification failures.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from .._control.aside import sleep_aside
from .._exceptions import StorageError
from .._redact import redact_url
from .._stats import loader_stats as _stats
from .._stats import recorder as _recorder

__all__ = [
    "AttemptFailed",
    "Attempts",
    "Hedge",
    "Retry",
    "backoff",
    "give_up",
    "hear",
    "heard",
    "is_throttle",
    "next_wait",
    "retrying",
]

log = logging.getLogger("asyncload.storage")

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Retry:
    """How often, and how patiently, a failed storage request is tried again.

    The wait before retry *n* (1-based) is ``uniform(0, min(max_backoff, backoff * 2**(n-1)))``
    ("full jitter"), unless the server sent ``Retry-After``: then exactly that long. A
    ``Retry-After`` longer than ``max_retry_after`` ends the retries at once instead of hammering
    the server early.

    Examples:
        >>> import asyncload
        >>> patient = asyncload.Retry(attempts=10, backoff=0.5, deadline=120.0)
        >>> asyncload.configure("s3://flaky-bucket", retry=patient)  # doctest: +SKIP
        >>> never = asyncload.Retry(attempts=1)
        >>> 503 in never.statuses
        True
    """

    attempts: int = 5
    """Total attempts per request, the first one included (``1`` disables retries)."""
    backoff: float = 0.1
    """Upper bound of the first jittered wait, in seconds; doubles with every retry."""
    max_backoff: float = 20.0
    """Cap on the jittered wait, in seconds."""
    max_retry_after: float = 120.0
    """Longest ``Retry-After`` obeyed, in seconds; a longer one fails the request."""
    deadline: float | None = None
    """Seconds from the first attempt after which no new attempt starts (``None``: no limit)."""
    statuses: frozenset[int] = frozenset({429, 500, 502, 503, 504})
    """HTTP statuses that are retried."""

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"Retry(attempts={self.attempts}) must be at least 1")
        if self.backoff < 0 or self.max_backoff < 0 or self.max_retry_after < 0:
            raise ValueError("Retry backoff, max_backoff and max_retry_after must be >= 0")
        if self.deadline is not None and self.deadline <= 0:
            raise ValueError(f"Retry(deadline={self.deadline}) must be positive or None")
        # Accept any iterable of ints (a set, a list) and keep the instance hashable.
        object.__setattr__(self, "statuses", frozenset(self.statuses))

    def wait(self, retry: int, retry_after: float | None = None) -> float:
        """Seconds to sleep before retry number *retry* (1-based)."""
        if retry_after is not None:
            return max(0.0, retry_after)
        cap = min(self.max_backoff, self.backoff * 2 ** (retry - 1))
        return random.uniform(0.0, cap)


class AttemptFailed(Exception):
    """One attempt of a storage backend failed: what a [`Backend`][asyncload.sources.Backend]
    raises instead of its library's exceptions.

    asyncload decides from it whether to try again (``retryable``, ``status`` against the
    prefix's [`Retry`][asyncload.Retry], ``retry_after``), counts the retry under ``reason`` in
    ``loader.stats().retries``, and after the last attempt raises ``kind`` with the message,
    the URL (credentials redacted) and the number of attempts.

    Examples:
        >>> import asyncload
        >>> from asyncload.sources import AttemptFailed
        >>> failure = AttemptFailed(
        ...     asyncload.ServerError, "the store is busy", status=503, retryable=True,
        ...     reason="503", retry_after=1.0,
        ... )
        >>> failure.retryable, failure.status
        (True, 503)
        >>> raise AttemptFailed(asyncload.NotFound, "no such object", status=404)  # doctest: +SKIP

    Attributes:
        kind: The public error class to raise if this is the last attempt.
        message: What happened, in words; the URL and status are appended later.
        status: The HTTP status (or equivalent), ``None`` when no response came.
        retryable: Whether another attempt can help (given a retry policy's statuses).
        reason: The short key retries are counted under (``"503"``, ``"timeout"``, ...).
        retry_after: Seconds the server asked us to wait, if it did.
        requests: Requests this failure stands for: 2 when a hedged twin failed as well
            (a hedged read); each one counts as an attempt.
    """

    # Heard already by the hedged round that raised it (``heard``): the retry loop that judges
    # it next does not hear it again. A class default: a backend's subclass may not call
    # this __init__.
    _heard = False

    def __init__(
        self,
        kind: type[StorageError],
        message: str,
        *,
        status: int | None = None,
        retryable: bool = False,
        reason: str = "error",
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.status = status
        self.retryable = retryable
        self.reason = reason
        self.retry_after = retry_after
        self.requests = 1

    def public(self, url: str, attempts: int) -> StorageError:
        """The public exception to raise for this failure after *attempts* attempts."""
        return self.kind(self.message, url=url, status=self.status, attempts=attempts)


# Answers that mean "too many requests" rather than "broken": S3's 503 SlowDown (and any 503,
# which stores send when overloaded), 429, and anything that says when to come back.
_THROTTLE_STATUSES = frozenset({429, 503})


def is_throttle(failure: AttemptFailed) -> bool:
    """Whether *failure* is the store pushing back (``503 SlowDown``, ``429``, ``Retry-After``)."""
    return (
        failure.status in _THROTTLE_STATUSES
        or failure.retry_after is not None
        or failure.reason == "SlowDown"
    )


def hear(failure: AttemptFailed, sent: float) -> None:
    """Tell the stats and the running engine's in-flight limit of *failure* if it is a throttle
    (``note_throttle``); *sent* is when the attempt went out (``time.monotonic``).

    Called once per answer: by the retry loop that judges it (``next_wait``), or by a hedged
    round as soon as one of its copies fails, since the round may end with another copy's
    answer (``hedge.race``); the failure a round raises is marked ``heard`` for the loop.
    """
    if is_throttle(failure):
        _recorder.note_throttle(sent, failure.retry_after)


def heard(failure: AttemptFailed) -> None:
    """Mark *failure*, which its hedged round heard, so that ``next_wait`` does not hear it
    again when it judges it."""
    failure._heard = True


def _should_retry(failure: AttemptFailed, policy: Retry) -> bool:
    if not failure.retryable:
        return False
    # A status outside the policy's list is final even when the backend would retry it.
    return failure.status is None or failure.status in policy.statuses or failure.status < 400


class Attempts:
    """The count of attempts of one request, and what to do when one of them fails.

    Every retry loop keeps its count here: ``retrying``, the hedged read (a hedge that failed
    too is an attempt: ``failed(failure, requests=2)``), the resuming stream (``progress``
    starts the count again) and the blocking shard upload (``failed_sync``). A failure is
    judged by ``next_wait`` once; then the request gives up with the public error (raised
    ``from`` the failure's cause) or counts, logs and sleeps before the next attempt.

    Examples:
        >>> import asyncio
        >>> import asyncload
        >>> from asyncload._storage.retry import AttemptFailed, Attempts
        >>> async def twice_busy() -> int:
        ...     tries = Attempts("s3://bucket/key", asyncload.Retry(attempts=3, backoff=0.0))
        ...     for _ in range(2):
        ...         tries.sent()  # an attempt goes out ... and fails
        ...         busy = AttemptFailed(asyncload.ServerError, "busy", status=503, retryable=True)
        ...         await tries.failed(busy)
        ...     return tries.spare
        >>> asyncio.run(twice_busy())  # the third attempt is the last one
        0

    Args:
        url: The URL requested, for the error and the log (credentials are redacted).
        policy: The retry policy that says whether and when to try again.
        started: When the first attempt went out (default: now); the deadline counts from it.
        judged: Called once per failure with the wait ``next_wait`` chose (``None``: no next
            attempt), before giving up or waiting (the hedged read hushes hedges with it).
    """

    __slots__ = ("_judged", "_sent", "done", "policy", "started", "url")

    def __init__(
        self,
        url: str,
        policy: Retry,
        *,
        started: float | None = None,
        judged: Callable[[AttemptFailed, float | None], None] | None = None,
    ) -> None:
        self.url = url
        self.policy = policy
        self.started = time.monotonic() if started is None else started
        self._sent = self.started
        self._judged = judged
        self.done = 0
        """Attempts made and failed since the count (re)started."""

    @property
    def spare(self) -> int:
        """Attempts the policy leaves besides the next one (hedges may use them)."""
        return self.policy.attempts - self.done - 1

    def sent(self) -> None:
        """Mark now as when the next attempt goes out (a throttle is dated by it)."""
        self._sent = time.monotonic()

    def progress(self) -> None:
        """Start the count (and the deadline) again: the request got somewhere (a stream
        delivered bytes), so its next failure is a fresh one, not a repeat."""
        self.done = 0
        self.started = time.monotonic()

    def _judge(self, failure: AttemptFailed, requests: int) -> float:
        self.done += requests
        wait = next_wait(failure, self.policy, self.done, self.started, sent=self._sent)
        if self._judged is not None:
            self._judged(failure, wait)
        if wait is None:
            raise give_up(failure, self.url, self.done) from failure.__cause__
        return wait

    async def failed(self, failure: AttemptFailed, requests: int = 1) -> None:
        """Count *failure* (standing for *requests* attempts) and wait for the next attempt.

        Raises:
            StorageError: There is no next attempt: the public error, with the attempts made.
        """
        wait = self._judge(failure, requests)
        await backoff(failure, self.url, wait, self.done, self.policy)

    def failed_sync(self, failure: AttemptFailed, requests: int = 1) -> None:
        """``failed`` for blocking code (``time.sleep``): counted and logged the same way.

        Raises:
            StorageError: There is no next attempt: the public error, with the attempts made.
        """
        wait = self._judge(failure, requests)
        _note_retry(failure, self.url, wait, self.done, self.policy)
        time.sleep(wait)


async def retrying(
    op: Callable[[], Awaitable[T]],
    *,
    url: str,
    policy: Retry,
    first: AttemptFailed | None = None,
    started: float | None = None,
) -> T:
    """Run ``op()`` until it succeeds or *policy* says stop; raise the public error then.

    Errors that are not ``AttemptFailed`` propagate unchanged (cancellation included).
    A caller that made the first attempt itself (a hot path) passes its failure as *first*
    and the attempt's start as *started*.
    """
    attempts = Attempts(url, policy, started=started)
    failure = first
    while True:
        if failure is None:
            attempts.sent()
            try:
                return await op()
            except AttemptFailed as exc:
                failure = exc
        await attempts.failed(failure)
        failure = None


def give_up(failure: AttemptFailed, url: str, attempts: int) -> StorageError:
    """The public error for a failure that is final, counted in the stats."""
    error = failure.public(url, attempts)
    _stats.note_error(type(error).__name__)
    return error


async def backoff(
    failure: AttemptFailed, url: str, wait: float, attempt: int, policy: Retry
) -> None:
    """Count, log and sleep before the next attempt, outside the sample's fetch slot
    (``_control/aside.py``: the in-flight limit counts the requests being answered)."""
    _note_retry(failure, url, wait, attempt, policy)
    await sleep_aside(wait)


def _note_retry(failure: AttemptFailed, url: str, wait: float, attempt: int, policy: Retry) -> None:
    _stats.note_retry(failure.reason)
    log.info(
        "retrying %s in %.2fs after attempt %d/%d failed: %s",
        redact_url(url),
        wait,
        attempt,
        policy.attempts,
        redact_url(failure.message),
    )


def next_wait(
    failure: AttemptFailed,
    policy: Retry,
    attempt: int,
    started: float,
    *,
    sent: float | None = None,
) -> float | None:
    """The seconds to wait before the next attempt, or ``None`` when there is none.

    Every failure a retry loop sees is judged here, so a throttle is heard here too
    (``hear``, with *sent*, when the attempt went out: the running engine cuts its in-flight
    limit once per overload, not once per answer to it). A hedged round hears each of its
    copies' failures itself, as it comes, since another copy may yet answer.
    """
    if failure._heard:
        # Its hedged round heard it. The mark is spent: a backend may raise the same object
        # for a later answer, which is a new one.
        failure._heard = False
    else:
        hear(failure, started if sent is None else sent)
    if attempt >= policy.attempts or not _should_retry(failure, policy):
        return None
    if failure.retry_after is not None and failure.retry_after > policy.max_retry_after:
        failure.message += (
            f"; the server asked to retry after {failure.retry_after:g}s, longer than "
            f"Retry(max_retry_after={policy.max_retry_after:g})"
        )
        return None
    wait = policy.wait(attempt, failure.retry_after)
    if policy.deadline is not None and time.monotonic() - started + wait > policy.deadline:
        failure.message += f"; Retry(deadline={policy.deadline:g}s) reached"
        return None
    return wait


@dataclass(frozen=True, slots=True)
class Hedge:
    """When a straggling GET gets a second, identical request (``StorageOptions.hedge``).

    The delay before the hedge is the *percentile* of the prefix's recent latencies, learned
    online, but never below *min_delay*. At most *budget* (a fraction) of the requests of a
    prefix are hedges. Set ``hedge=None`` to switch hedging off for a prefix.

    Examples:
        >>> import asyncload
        >>> asyncload.configure("s3://bucket", hedge=asyncload.Hedge(budget=0.02))  # doctest: +SKIP
        >>> asyncload.configure("https://cheap.example", hedge=None)  # doctest: +SKIP
        >>> asyncload.Hedge().budget
        0.05
    """

    budget: float = 0.05
    """Largest fraction of requests that may be hedges (each one is an extra GET you pay for)."""
    percentile: float = 0.95
    """Which percentile of recent latencies a request must exceed before it is hedged."""
    min_delay: float = 0.05
    """Floor of the delay, in seconds: no hedge is sent sooner, whatever the latencies."""

    def __post_init__(self) -> None:
        if not 0.0 < self.budget <= 1.0:
            raise ValueError(f"Hedge(budget={self.budget}) must be in (0, 1]; hedge=None is off")
        if not 0.5 <= self.percentile < 1.0:
            raise ValueError(f"Hedge(percentile={self.percentile}) must be in [0.5, 1)")
        if self.min_delay < 0:
            raise ValueError(f"Hedge(min_delay={self.min_delay}) must be >= 0")
