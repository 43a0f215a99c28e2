"""The Retry policy and the retry loop, driven by a scripted operation (no network)."""

from __future__ import annotations

import random
import time

import pytest

import asyncload
from asyncload._exceptions import NotFound, ServerError
from asyncload._stats import loader_stats as _stats
from asyncload._storage.retry import AttemptFailed, retrying


def test_defaults_and_validation() -> None:
    r = asyncload.Retry()
    assert r.attempts == 5
    assert {429, 500, 502, 503, 504} == set(r.statuses)
    assert not {400, 401, 403, 404} & r.statuses
    with pytest.raises(ValueError, match="at least 1"):
        asyncload.Retry(attempts=0)
    with pytest.raises(ValueError, match="deadline"):
        asyncload.Retry(deadline=0)
    assert asyncload.Retry(statuses={503}).statuses == frozenset({503})


def test_full_jitter_bounds_grow_and_cap() -> None:
    random.seed(1)
    r = asyncload.Retry(backoff=1.0, max_backoff=4.0)
    for retry, cap in ((1, 1.0), (2, 2.0), (3, 4.0), (10, 4.0)):
        waits = [r.wait(retry) for _ in range(500)]
        assert 0 <= min(waits)
        assert max(waits) <= cap
        assert max(waits) > cap * 0.8  # full jitter spans the whole interval
    assert r.wait(1, retry_after=2.5) == 2.5


class Script:
    """An operation that fails with the given failures, then returns 'ok'."""

    def __init__(self, *failures: AttemptFailed) -> None:
        self.failures = list(failures)
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.failures:
            raise self.failures.pop(0)
        return "ok"


def transient(status: int = 503, retry_after: float | None = None) -> AttemptFailed:
    return AttemptFailed(
        ServerError,
        "boom",
        status=status,
        retryable=True,
        reason=str(status),
        retry_after=retry_after,
    )


@pytest.mark.asyncio
async def test_transient_failures_are_retried_and_counted() -> None:
    op = Script(transient(), transient(502))
    before = dict(_stats.recorder.retries)
    assert await retrying(op, url="x://y", policy=asyncload.Retry(backoff=0.001)) == "ok"
    assert op.calls == 3
    assert _stats.recorder.retries["503"] == before.get("503", 0) + 1
    assert _stats.recorder.retries["502"] == before.get("502", 0) + 1


@pytest.mark.asyncio
async def test_final_failure_reports_true_attempts() -> None:
    op = Script(*[transient()] * 5)
    with pytest.raises(ServerError) as info:
        await retrying(op, url="x://y", policy=asyncload.Retry(attempts=3, backoff=0.001))
    assert op.calls == 3
    assert info.value.attempts == 3
    assert info.value.url == "x://y"


@pytest.mark.asyncio
async def test_non_retryable_fails_at_once() -> None:
    op = Script(AttemptFailed(NotFound, "missing", status=404))
    with pytest.raises(NotFound):
        await retrying(op, url="x://y", policy=asyncload.Retry())
    assert op.calls == 1


@pytest.mark.asyncio
async def test_status_outside_policy_is_final() -> None:
    op = Script(transient(429))
    with pytest.raises(ServerError):
        await retrying(op, url="x://y", policy=asyncload.Retry(statuses={503}))
    assert op.calls == 1


@pytest.mark.asyncio
async def test_retry_after_is_waited_for() -> None:
    op = Script(transient(retry_after=0.3))
    t0 = time.monotonic()
    await retrying(op, url="x://y", policy=asyncload.Retry(backoff=0.0))
    assert time.monotonic() - t0 >= 0.3


@pytest.mark.asyncio
async def test_too_long_retry_after_gives_up_with_reason() -> None:
    op = Script(transient(retry_after=600))
    with pytest.raises(ServerError, match="max_retry_after") as info:
        await retrying(op, url="x://y", policy=asyncload.Retry(max_retry_after=10))
    assert op.calls == 1
    assert info.value.attempts == 1


@pytest.mark.asyncio
async def test_deadline_stops_retrying() -> None:
    op = Script(*[transient(retry_after=0.2)] * 10)
    t0 = time.monotonic()
    with pytest.raises(ServerError, match="deadline"):
        await retrying(op, url="x://y", policy=asyncload.Retry(attempts=10, deadline=0.5))
    assert time.monotonic() - t0 < 1.0
    assert 2 <= op.calls <= 3


@pytest.mark.asyncio
async def test_configure_picks_longest_prefix() -> None:
    from asyncload._storage import api as _storage

    try:
        _storage.configure("s3://", read_timeout=1.0)
        _storage.configure("s3://bucket", read_timeout=2.0)
        _storage.configure("s3://bucket/deep/", read_timeout=3.0)
        assert _storage.options_for("s3://bucket/deep/x").read_timeout == 3.0
        assert _storage.options_for("s3://bucket/x").read_timeout == 2.0
        assert _storage.options_for("s3://bucket2/x").read_timeout == 1.0
        assert _storage.options_for("gs://bucket/x").read_timeout == 30.0
        snapshot = _storage.export_config()
        _storage.reset()
        assert _storage.options_for("s3://bucket/x").read_timeout == 30.0
        import pickle

        _storage.import_config(pickle.loads(pickle.dumps(snapshot)))
        assert _storage.options_for("s3://bucket/x").read_timeout == 2.0
        with pytest.raises(TypeError, match="unknown storage option"):
            _storage.configure("s3://b", read_timout=1.0)
    finally:
        _storage.reset()
