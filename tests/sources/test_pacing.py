"""Pacing new connections: slow start for a new host, and a proven host trusted next pass."""

from __future__ import annotations

import asyncio
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
async def test_a_trusted_host_gets_a_batch_worth_of_connections_at_once(
    http_server: ObjectServer,
) -> None:
    urls = [http_server.put(f"{i}.bin", bytes([i]) * 100) for i in range(N)]
    http_server.latency = LATENCY
    _storage.set_pool_size(64)
    # What a worker receives from the main process (see test_a_pass_teaches_the_next_one).
    _storage.import_config(
        _storage.StorageConfig(prefixes=(), pool_size=64, connections=((_key(http_server), 500),))
    )
    # Capped at TRUSTED_BURST however much the host proved.
    assert _pacing.TRUSTED_BURST == N
    assert await _peak_within(http_server, urls, LATENCY * 0.8) == N


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
