"""The default in-flight limit against a store that pushes back, end to end: real workers, the
loopback server's token bucket answering ``503 SlowDown`` (tests/_http_server.py).

Issue #33: two loaders of two workers with ``max_concurrency=128`` each drove such a store to
37% throttled answers, and both died after five attempts of some request. With the default
they converge under the store's rate, and nothing fails.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

import asyncload

from .._http_server import ObjectServer

pytestmark = pytest.mark.usefixtures("clean_storage")

RATE = 500.0  # GETs/s the store allows, over every prefix together
BURST = 50.0


def _read_all(urls: list[str], out: dict[str, Any], key: str) -> None:
    loader = asyncload.DataLoader(
        asyncload.RemoteFiles(urls), batch_size=16, num_workers=2, collate_fn=list
    )
    try:
        out[key] = [x for batch in loader for x in batch]
    except Exception as exc:  # handed to the test
        out[key] = exc
    out[key + ".stats"] = loader.stats()


@pytest.mark.timeout(120)
def test_two_default_loaders_share_a_throttling_store_and_nothing_fails(
    http_server: ObjectServer,
) -> None:
    n = 1600
    urls = [http_server.put(f"obj/{i}", i.to_bytes(4, "big")) for i in range(n)]
    http_server.latency = 0.05
    http_server.throttle_rate, http_server.throttle_burst = RATE, BURST
    out: dict[str, Any] = {}
    halves = {"a": urls[0::2], "b": urls[1::2]}
    threads = [threading.Thread(target=_read_all, args=(u, out, k)) for k, u in halves.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(100)
    for key, half in halves.items():
        got = out[key]
        assert not isinstance(got, BaseException), f"loader {key} failed: {got!r}"
        assert got == [int(u.rsplit("/", 1)[1]).to_bytes(4, "big") for u in half]  # once each
    stats = [out["a.stats"], out["b.stats"]]
    requests = sum(http_server.hits.values())
    # The store did push back, the loaders heard it (every throttle is retried and counted),
    # and the share of refused requests stayed small: the limits came down under the rate.
    # Only a copy cancelled as its twin won, its 503 sent and not yet read, goes unheard: one
    # per hedge at most (hedges are rare here; a throttle a copy read is heard: hedge.race).
    assert http_server.throttled > 0
    heard = sum(s.throttled for s in stats)
    assert http_server.throttled - sum(s.hedges_sent for s in stats) <= heard
    assert heard <= http_server.throttled
    assert http_server.throttled <= 0.25 * requests
    assert all(1 <= c <= 512 for s in stats for c in s.concurrency)
