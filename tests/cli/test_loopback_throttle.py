"""The tests' loopback store that pushes back: a token bucket per prefix and a line per prefix.

Over real loopback HTTP with an aiohttp client and bounded request loops; the in-flight
controller's tests and benchmarks rely on these answers being what S3 sends.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from .._http_server import ObjectServer

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]


async def _get(session: aiohttp.ClientSession, url: str) -> tuple[int, str, dict[str, str]]:
    async with session.get(url) as resp:
        return resp.status, await resp.text(), dict(resp.headers)


async def test_over_the_rate_answers_503_slowdown(http_server: ObjectServer) -> None:
    url = http_server.put("bucket/a/obj", b"x" * 100)
    http_server.throttle_rate, http_server.throttle_burst = 0.5, 3.0
    async with aiohttp.ClientSession() as session:
        answers = [await _get(session, url) for _ in range(8)]
    statuses = [status for status, _, _ in answers]
    assert statuses[:3] == [200, 200, 200]  # the burst
    assert statuses[3:] == [503] * 5
    _, body, headers = answers[-1]
    assert "<Code>SlowDown</Code>" in body
    assert headers["Content-Type"].startswith("application/xml")
    assert "Retry-After" not in headers
    assert http_server.throttled == 5


async def test_429_carries_retry_after(http_server: ObjectServer) -> None:
    url = http_server.put("bucket/b/obj", b"x")
    http_server.throttle_rate, http_server.throttle_burst = 0.5, 1.0
    http_server.throttle_status, http_server.throttle_retry_after = 429, 2.0
    async with aiohttp.ClientSession() as session:
        first = await _get(session, url)
        second = await _get(session, url)
    assert first[0] == 200
    assert second[0] == 429
    assert second[2]["Retry-After"] == "2"


async def test_token_bucket_holds_each_prefix_to_its_rate(http_server: ObjectServer) -> None:
    rate, burst = 200.0, 10.0
    urls = [http_server.put(f"bucket/{p}/obj", b"y" * 1000) for p in ("c", "d")]
    http_server.throttle_rate, http_server.throttle_burst = rate, burst
    ok = dict.fromkeys(urls, 0)
    throttled = 0
    duration = 1.0

    async def loop(session: aiohttp.ClientSession, url: str) -> None:
        nonlocal throttled
        # Bounded in time and in requests: 16 of these per prefix, each at most 400 requests.
        for _ in range(400):
            if time.monotonic() >= deadline:
                return
            status, _, _ = await _get(session, url)
            if status == 200:
                ok[url] += 1
            else:
                assert status == 503
                throttled += 1

    async with aiohttp.ClientSession() as session:
        started = time.monotonic()
        deadline = started + duration
        await asyncio.gather(*(loop(session, url) for url in urls for _ in range(16)))
        elapsed = time.monotonic() - started
    for url in urls:
        # Each prefix has its own bucket: no more than its rate over the run plus the burst,
        # and (the client kept it busy) most of that.
        assert ok[url] <= rate * elapsed + burst + 2, (ok, elapsed)
        assert ok[url] >= 0.5 * rate * duration, (ok, elapsed)
    assert throttled > 0
    assert http_server.throttled == throttled


async def test_a_line_makes_latency_grow_with_load(http_server: ObjectServer) -> None:
    url = http_server.put("bucket/e/obj", b"z")
    http_server.queue_slots, http_server.queue_service = 2, 0.05

    async def timed(session: aiohttp.ClientSession) -> float:
        start = time.monotonic()
        status, _, _ = await _get(session, url)
        assert status == 200
        return time.monotonic() - start

    async with aiohttp.ClientSession() as session:
        alone = await timed(session)
        together = await asyncio.gather(*(timed(session) for _ in range(6)))
    assert alone >= 0.05
    # Six requests through two slots: the last pair waits for two services before its own.
    assert max(together) >= 0.15, together
    assert min(together) < 0.15, together


async def test_pushback_is_off_by_default_and_after_reset(http_server: ObjectServer) -> None:
    http_server.throttle_rate, http_server.queue_slots = 0.001, 1
    http_server.reset()
    url = http_server.put("bucket/f/obj", b"w")
    async with aiohttp.ClientSession() as session:
        statuses = await asyncio.gather(*(_get(session, url) for _ in range(20)))
    assert {status for status, _, _ in statuses} == {200}
    assert http_server.throttled == 0
