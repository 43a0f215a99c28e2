"""Pacing new connections: slow start for a new host, and a proven host trusted next pass."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

import asyncload
from asyncload import _storage
from asyncload.sources import _pacing

from .._http_server import ObjectServer

pytestmark = pytest.mark.usefixtures("clean_storage")

N = 32
LATENCY = 0.5  # long enough that slow-start rounds can't overlap on a busy machine


def _key(server: ObjectServer) -> str:
    return f"{server.host}:{server.port}"


async def _peak_within(server: ObjectServer, urls: list[str], seconds: float) -> int:
    """Most requests in the server's handler at once during the first *seconds* of reading
    *urls* all at once (then the reads finish, and their bytes are checked)."""
    reads = asyncio.gather(*(asyncload.read(u) for u in urls))
    peak = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        peak = max(peak, server.active)
        await asyncio.sleep(0.005)
    try:
        assert await reads == [bytes([i]) * 100 for i in range(len(urls))]
    finally:
        await _storage.aclose()
    return peak


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_a_new_host_gets_a_small_burst_then_is_learned(http_server: ObjectServer) -> None:
    urls = [http_server.put(f"{i}.bin", bytes([i]) * 100) for i in range(N)]
    http_server.latency = LATENCY
    _storage.set_pool_size(64)
    assert _key(http_server) not in _pacing.learned()
    # Within the first round trip only the burst may be waiting for its first response.
    assert await _peak_within(http_server, urls, LATENCY * 0.8) == _pacing.BURST
    # Later rounds proved more kept-alive connections, which the process now remembers and
    # hands to workers it starts (the storage configuration they receive).
    proven = _pacing.learned()[_key(http_server)]
    assert proven > _pacing.BURST
    assert (_key(http_server), proven) in _storage.export_config().connections


@pytest.mark.asyncio
@pytest.mark.timeout(30)
@pytest.mark.parametrize(("proven", "expected"), [(40, 40), (500, _pacing.TRUSTED_BURST)])
async def test_a_trusted_host_gets_what_it_proved_at_once(
    http_server: ObjectServer, proven: int, expected: int
) -> None:
    # More reads than any host may get at once, and a pool with room for all of them.
    n = _pacing.TRUSTED_BURST + 16
    urls = [http_server.put(f"{i}.bin", bytes([i % 256]) * 100) for i in range(n)]
    http_server.latency = LATENCY
    _storage.configure(http_server.url, hedge=None)  # a hedge would be one more request
    _storage.set_pool_size(2 * n)
    # What a worker receives from the main process (see test_a_pass_teaches_the_next_one):
    # as many connections at once as the host held before, up to TRUSTED_BURST.
    hints = ((_key(http_server), proven),)
    _storage.import_config(dataclasses.replace(_storage.export_config(), connections=hints))
    reads = asyncio.gather(*(asyncload.read(u) for u in urls))
    peak = 0
    deadline = time.monotonic() + LATENCY * 0.8
    while time.monotonic() < deadline:
        peak = max(peak, http_server.active)
        await asyncio.sleep(0.005)
    try:
        assert await reads == [bytes([i % 256]) * 100 for i in range(n)]
    finally:
        await _storage.aclose()
    assert peak == expected


@pytest.mark.timeout(10)
def test_learning_keeps_the_most_and_ignores_other_counters() -> None:
    _pacing.learn((("connections:example.com:443", 7), ("hedges_sent", 99)))
    _pacing.learn((("connections:example.com:443", 3),))
    assert _pacing.learned() == {"example.com:443": 7}
    _pacing.forget()
    assert _pacing.learned() == {}


@pytest.mark.timeout(60)
def test_a_pass_teaches_the_next_one(http_server: ObjectServer) -> None:
    # Workers are new processes each pass (persistent_workers=False): what they proved about
    # the host comes back in their stats, so the next pass's workers start trusted.
    urls = [http_server.put(f"{i}.bin", bytes([i % 256]) * 100) for i in range(256)]
    http_server.latency = 0.05
    loader = asyncload.DataLoader(
        asyncload.RemoteFiles(urls), batch_size=16, num_workers=2, collate_fn=list
    )
    assert sum(len(b) for b in loader) == len(urls)
    assert _pacing.learned()[_key(http_server)] > _pacing.BURST


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_waiting_requests_take_returned_connections_first_come_first_served(
    http_server: ObjectServer,
) -> None:
    # 40 reads wait behind a new host's slow start. A read that comes after the first round's
    # connections went back to the pool must queue behind them, not take one of those idle
    # connections ahead of reads that have waited a whole round trip (a loader's head batch
    # asks first: its samples must not be overtaken by later batches').
    urls = [http_server.put(f"{i}.bin", bytes([i]) * 100) for i in range(40)]
    late = http_server.put("late.bin", b"late")
    http_server.latency = LATENCY
    _storage.configure(http_server.url, hedge=None)  # a hedge would be one more request
    _storage.set_pool_size(64)
    reads = asyncio.gather(*(asyncload.read(u) for u in urls))
    deadline = time.monotonic() + 10
    while sum(http_server.hits.values()) <= _pacing.BURST:  # the second round has begun
        assert time.monotonic() < deadline
        await asyncio.sleep(0.005)
    try:
        assert await asyncload.read(late) == b"late"
        assert await reads == [bytes([i]) * 100 for i in range(40)]
    finally:
        await _storage.aclose()
    # The first two rounds (4 new connections, then those 4 again and 12 new ones) went to the
    # 20 oldest reads; the late read waited its turn behind the rest.
    first_rounds = http_server.raw_paths[: _pacing.BURST * 5]
    assert sorted(first_rounds) == sorted(f"/{i}.bin" for i in range(20)), first_rounds
    assert sorted(http_server.raw_paths) == sorted([*(f"/{i}.bin" for i in range(40)), "/late.bin"])
