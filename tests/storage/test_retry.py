"""The Retry policy and the retry loop, driven by a scripted operation (no network)."""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path

import pytest

import asyncload
from asyncload._exceptions import NotFound, ServerError
from asyncload._stats import loader_stats as _stats
from asyncload._storage.retry import AttemptFailed, Attempts, retrying


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
async def test_every_throttle_is_heard_once_even_from_one_failure_raised_again() -> None:
    # A backend may raise the same AttemptFailed object for every attempt (this file's own
    # scripts do): each answer is a throttle of its own for the stats and the in-flight limit.
    op = Script(*[transient()] * 3)
    before = _stats.recorder.counts["throttled"]
    assert await retrying(op, url="x://y", policy=asyncload.Retry(backoff=0.001)) == "ok"
    assert _stats.recorder.counts["throttled"] - before == 3


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


QUICK = asyncload.Retry(attempts=5, backoff=0.001)


@pytest.mark.asyncio
async def test_attempts_count_the_requests_a_failure_stands_for() -> None:
    # A hedged read whose twin failed too used two attempts: 2 + 2 + 1 reaches attempts=5.
    attempts = Attempts("x://y", QUICK)
    assert attempts.spare == 4
    await attempts.failed(transient(), requests=2)
    assert (attempts.done, attempts.spare) == (2, 2)
    await attempts.failed(transient(), requests=2)
    assert attempts.spare == 0
    with pytest.raises(ServerError) as info:
        await attempts.failed(transient())
    assert info.value.attempts == 5
    assert info.value.url == "x://y"


@pytest.mark.asyncio
async def test_final_error_is_raised_from_the_failures_cause() -> None:
    failure = AttemptFailed(NotFound, "missing", status=404)
    cause = OSError("the library's own error")
    failure.__cause__ = cause
    with pytest.raises(NotFound) as info:
        await Attempts("x://y", QUICK).failed(failure)
    assert info.value.__cause__ is cause
    assert info.value.attempts == 1


@pytest.mark.asyncio
async def test_progress_restarts_the_count() -> None:
    attempts = Attempts("x://y", asyncload.Retry(attempts=3, backoff=0.001))
    await attempts.failed(transient())
    await attempts.failed(transient())
    assert attempts.spare == 0
    before = attempts.started
    attempts.progress()  # a stream delivered bytes: its next failure is a fresh one
    assert (attempts.done, attempts.spare) == (0, 2)
    assert attempts.started >= before
    await attempts.failed(transient())
    await attempts.failed(transient())
    with pytest.raises(ServerError) as info:
        await attempts.failed(transient())
    assert info.value.attempts == 3


@pytest.mark.asyncio
async def test_judged_sees_each_failure_once_with_its_wait() -> None:
    seen: list[tuple[str, float | None]] = []
    attempts = Attempts(
        "x://y",
        asyncload.Retry(attempts=2, backoff=0.0),
        judged=lambda failure, wait: seen.append((failure.reason, wait)),
    )
    await attempts.failed(transient(502))
    with pytest.raises(ServerError):
        await attempts.failed(transient(503))
    assert seen == [("502", 0.0), ("503", None)]  # the last one is told there is no next


def test_blocking_retries_are_counted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    attempts = Attempts("s3://user:secret@bucket/key", asyncload.Retry(attempts=3, backoff=0.0))
    before = _stats.recorder.retries["503"]
    with caplog.at_level(logging.INFO, logger="asyncload.storage"):
        attempts.failed_sync(transient())
        attempts.failed_sync(transient())
        with pytest.raises(ServerError) as info:
            attempts.failed_sync(transient())
    assert info.value.attempts == 3
    assert _stats.recorder.retries["503"] == before + 2
    retried = [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()]
    assert len(retried) == 2
    assert "attempt 2/3 failed" in retried[1]
    assert "secret" not in "".join(retried)


def test_upload_retries_are_counted(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import obstore

    from asyncload._storage.backends import s3
    from asyncload.datasets._upload import put_file

    failures = [transient(), transient(500)]
    real_split = s3.split_bucket

    def flaky_split(url: str) -> tuple[str, str, str]:
        if failures:
            raise failures.pop(0)
        return real_split(url)

    puts: list[str] = []
    monkeypatch.setattr(s3, "split_bucket", flaky_split)
    monkeypatch.setattr(s3, "_build_store", lambda scheme, bucket, options: object())
    monkeypatch.setattr(obstore, "put", lambda store, key, path: puts.append(key))
    before = dict(_stats.recorder.retries)
    put_file(tmp_path / "shard.tar", "s3://bucket/shard.tar")
    assert puts == ["shard.tar"]
    assert _stats.recorder.retries["503"] == before.get("503", 0) + 1
    assert _stats.recorder.retries["500"] == before.get("500", 0) + 1


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
