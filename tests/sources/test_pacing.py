"""Pacing new connections: slow start for a new host, and a proven host trusted next pass."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import http.server
import itertools
import socket
import threading
import time
from collections.abc import AsyncIterator, Coroutine, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest

import asyncload
from asyncload._storage import api as _storage
from asyncload._storage.backends import pacing as _pacing
from asyncload._storage.backends import pacing_memory as _memory
from asyncload._storage.state import current

from .._http_server import ObjectServer

pytestmark = pytest.mark.usefixtures("clean_storage")

N = 32
LATENCY = 0.5  # long enough that slow-start rounds can't overlap on a busy machine


def _hosts() -> _memory.HostMemory:
    """What this context's storage state knows of its hosts."""
    return current().hosts


def _key(server: ObjectServer) -> str:
    return f"{server.host}:{server.port}"


async def _first_round_peak(server: ObjectServer, urls: list[str]) -> int:
    """Most requests in the server's handler at once in the first round trip of reading *urls*
    all at once (then the reads finish, and their bytes are checked). The round lasts until
    the server answers its first request: counted by answers, not by a clock, so that a busy
    machine's slow connects still fall in their round."""
    server.finished = 0
    reads = asyncio.gather(*(asyncload.read(u) for u in urls))
    peak = 0
    while not reads.done() and not server.finished:
        peak = max(peak, server.active)
        await asyncio.sleep(0.002)
    try:
        assert await reads == [bytes([i % 256]) * 100 for i in range(len(urls))]
    finally:
        await _storage.aclose()
    return peak


async def _paced_get(session: aiohttp.ClientSession, url: str) -> bytes:
    """GET *url* as the HTTP backend does: its connector learns of the first response."""
    async with session.get(url) as resp:
        connector = session.connector
        assert isinstance(connector, _pacing.PacedConnector)
        connector.settle(resp)
        return await resp.read()


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_a_new_host_gets_a_small_burst_then_is_learned(http_server: ObjectServer) -> None:
    urls = [http_server.put(f"{i}.bin", bytes([i]) * 100) for i in range(N)]
    http_server.latency = LATENCY
    _storage.set_pool_size(64)
    assert _key(http_server) not in _hosts().learned()
    # Within the first round trip only the burst may be waiting for its first response: all of
    # it in a process that shares it with no other.
    assert _hosts().first_burst() == _memory.BURST
    assert await _first_round_peak(http_server, urls) == _memory.BURST
    # Later rounds proved more kept-alive connections, which the process now remembers and
    # hands to workers it starts (the storage configuration they receive).
    proven = _hosts().learned()[_key(http_server)]
    assert proven > _memory.BURST
    assert (_key(http_server), proven) in _storage.export_config().pacing.connections


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
    _storage.import_config(
        dataclasses.replace(_storage.export_config(), pacing=_memory.PacingMemory(hints))
    )
    assert await _first_round_peak(http_server, urls) == expected


@pytest.mark.timeout(10)
def test_learning_keeps_the_most() -> None:
    _hosts().trust(_memory.PacingMemory((("example.com:443", 7),)))
    _hosts().trust(_memory.PacingMemory((("example.com:443", 3), ("other:80", 0))))
    assert _hosts().learned() == {"example.com:443": 7}
    assert _hosts().snapshot() == _memory.PacingMemory((("example.com:443", 7),))
    _hosts().forget()
    assert _hosts().learned() == {}


@pytest.mark.timeout(60)
def test_a_pass_teaches_the_next_one(http_server: ObjectServer) -> None:
    # Workers are new processes each pass (persistent_workers=False): what they proved about
    # the host comes back beside their batches, so the next pass's workers start trusted.
    urls = [http_server.put(f"{i}.bin", bytes([i % 256]) * 100) for i in range(256)]
    http_server.latency = 0.05
    loader = asyncload.DataLoader(
        asyncload.RemoteFiles(urls), batch_size=16, num_workers=2, collate_fn=list
    )
    assert sum(len(b) for b in loader) == len(urls)
    assert _hosts().learned()[_key(http_server)] > _memory.BURST


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_waiting_requests_take_returned_connections_first_come_first_served(
    http_server: ObjectServer, monkeypatch: pytest.MonkeyPatch
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
    _hosts().share(2)  # one of 2 workers: a burst of 4, so that 40 reads take several rounds
    # Rounds of 4 and 16 whatever the spread of the first burst's answers (x7 growth would put
    # 32 in the second round, of which the server may take any 16 first).
    monkeypatch.setattr(_pacing, "QUICK_GROWTH", _pacing.GROWTH)
    assert _hosts().first_burst() == 4
    reads = asyncio.gather(*(asyncload.read(u) for u in urls))
    deadline = time.monotonic() + 10
    while sum(http_server.hits.values()) <= 4:  # the second round has begun
        assert time.monotonic() < deadline
        await asyncio.sleep(0.005)
    try:
        assert await asyncload.read(late) == b"late"
        assert await reads == [bytes([i]) * 100 for i in range(40)]
    finally:
        await _storage.aclose()
    # The first two rounds (4 new connections, then those 4 again and 12 new ones) went to the
    # 20 oldest reads; the late read waited its turn behind the rest.
    first_rounds = http_server.raw_paths[:20]
    assert sorted(first_rounds) == sorted(f"/{i}.bin" for i in range(20)), first_rounds
    assert sorted(http_server.raw_paths) == sorted([*(f"/{i}.bin" for i in range(40)), "/late.bin"])


@pytest.mark.asyncio
@pytest.mark.timeout(30)
# Large bodies are still being read when their connections are proven (aiohttp then says a
# connection `should_close`): they count once released (they once never counted again).
@pytest.mark.parametrize("size", [100, 1 << 20], ids=["small", "1MiB"])
async def test_a_host_that_answers_its_first_burst_together_grows_faster(
    http_server: ObjectServer, size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The first burst (4) comes back together: each of its kept-alive connections earns
    # QUICK_GROWTH new ones, so the second round holds those 4 and 4 + 24 new requests (with
    # GROWTH, 4 and 4 + 8).
    #
    # "Together" as this server can: it runs in a thread of this process, so its answers wait
    # for the GIL while this loop reads a body or opens the next round. Sent 0.2 ms apart, the
    # burst was settled 4-12 ms apart (1 MiB bodies: 2.5 ms more per answer), past QUICK_SPREAD
    # (10 ms) in 4 runs of 5 on a busy machine; a server in a process of its own shows no such
    # spread. Where QUICK_SPREAD's line lies is tested without a server, below.
    monkeypatch.setattr(_pacing, "QUICK_SPREAD", LATENCY / 5)
    urls = [http_server.put(f"{i}.bin", bytes([i]) * size) for i in range(64)]
    http_server.latency = LATENCY
    _storage.configure(http_server.url, hedge=None)
    _storage.set_pool_size(64)
    _hosts().share(2)
    http_server.finished = 0
    reads = asyncio.gather(*(asyncload.read(u) for u in urls))
    # The second round lasts until one of its requests is answered (the fifth answer): sampled
    # by rounds, not by a clock, so a busy machine's slow connects still count in their round.
    # (A third round's requests need this loop to send them: none start between the reads.)
    peak = 0
    while not reads.done() and http_server.finished <= 4:
        peak = max(peak, http_server.active)
        await asyncio.sleep(0.002)
    try:
        assert await reads == [bytes([i]) * size for i in range(64)]
    finally:
        await _storage.aclose()
    assert peak == 4 + 4 + _pacing.QUICK_GROWTH * 4


@pytest.mark.timeout(10)
def test_a_first_burst_answered_together_is_told_from_one_answered_in_turn() -> None:
    def quick(*latencies: float | None) -> bool | None:
        host = _pacing._Host("example.com:80")
        for latency in latencies:
            host.answered(latency, 4)
        return host.quick

    assert quick(0.050, 0.051, 0.052, 0.0535) is True  # jitter
    assert quick(0.050, 0.051, 0.052) is None  # not the whole burst yet
    # One accept every 50 ms: each first response a queue's wait later than the last.
    assert quick(0.050, 0.100, 0.150, 0.200) is False
    assert quick(0.0003, 0.0006, 0.002, 0.040) is False  # one of them waited
    # One accept every 15 ms, each answered 900 ms later: slow responses hide no queue.
    assert quick(0.900, 0.915, 0.930, 0.945) is False
    assert quick(0.050, None) is False  # a first response that never came
    assert quick(0.050, 0.200, 0.050, 0.050, 0.050, 0.050) is False  # decided once


class _Conn:
    """A pooled connection as ``_Host`` sees it, counting in *reads* how often its state is
    read (kept alive: connected, and not closing)."""

    def __init__(self, reads: collections.Counter[str], *, connected: bool = True) -> None:
        self.reads = reads
        self.connected = connected

    def is_connected(self) -> bool:
        self.reads["state"] += 1
        return self.connected

    @property
    def should_close(self) -> bool:
        self.reads["state"] += 1
        return False


def _trusting(n: int, *, cap: int | None = None) -> _memory.HostMemory:
    """What a process knows of example.com:80: it proved *n* connections, capped at *cap*."""
    memory = _memory.HostMemory()
    if n:
        memory.remember_proven("example.com:80", n)
    if cap is not None:
        memory.remember_cap("example.com:80", cap)
    return memory


@pytest.mark.timeout(10)
def test_a_trusted_host_finds_room_without_walking_its_pool() -> None:
    # A busy pool is asked for room on every release with requests waiting, and on every
    # request that finds no idle connection: walking its connections each time cost
    # HttpBackend.read 296-364 us of CPU a request against 236-247 without (1 KB at 0 ms,
    # 128 tasks).
    reads: collections.Counter[str] = collections.Counter()
    host = _pacing._Host("example.com:80", _trusting(128))
    for _ in range(100):
        host.prove(_Conn(reads))
    host.pending = 3
    reads.clear()
    assert host.room(4) >= 1
    assert host.room(4, need=125) >= 125
    assert reads["state"] == 0
    # More than the trusted floor gives: the kept-alive connections are counted.
    assert host.room(4, need=200) == 4 + _pacing.GROWTH * 100 - 3
    assert reads["state"] == 2 * 100  # each one's is_connected and should_close


@pytest.mark.timeout(10)
def test_room_is_exact_up_to_what_the_caller_needs() -> None:
    # The decisions room() feeds: "any room?" (need 1) and "room to wake them all?" (need
    # the waiters). Up to need, the floor and the pool's count agree; past it, the floor may
    # say less, never more.
    reads: collections.Counter[str] = collections.Counter()
    for trusted, cap, quick, kept, under_way in itertools.product(
        (0, 8, 128), (None, 2, 40), (None, True), (0, 5, 30), (0, 7, 60)
    ):
        host = _pacing._Host("example.com:80", _trusting(trusted, cap=cap))
        host.quick = quick
        for _ in range(kept):
            host.prove(_Conn(reads))
        host.pending = under_way
        exact = host.limit(4) - under_way
        for need in (-3, 0, 1, 5, 40, 200):
            room = host.room(4, need=need)
            assert room <= exact
            assert min(room, need) == min(exact, need), (trusted, cap, quick, kept, need)


@pytest.mark.timeout(10)
def test_a_host_forgets_closed_connections_as_its_pool_churns() -> None:
    reads: collections.Counter[str] = collections.Counter()
    host = _pacing._Host("example.com:80", _memory.HostMemory())
    most = 0
    for _ in range(1000):  # a server that closes each connection after a few requests
        host.prove(_Conn(reads, connected=False))
        most = max(most, len(host.proven))
    assert most < _pacing._PRUNE_AT
    host.prove(_Conn(reads))
    assert host.room(4, need=5) == 4 + _pacing.GROWTH * 1
    assert len(host.proven) == 1


@pytest.mark.asyncio
@pytest.mark.timeout(10)
async def test_a_release_wakes_as_many_waiters_as_there_is_room_for() -> None:
    reads: collections.Counter[str] = collections.Counter()
    connector = _pacing.PacedConnector(limit=64, burst=4)
    try:
        host = _pacing._Host("example.com:80", _trusting(8))
        loop = asyncio.get_running_loop()
        waiters = [loop.create_future() for _ in range(10)]
        host.waiters.extend(waiters)
        host.woken, host.pending = 2, 1  # two woken that have not run yet, one connecting
        # Room for 8 - 1 new connections, of which the two woken take theirs: 5 more go.
        connector._pace_wake("k", host)
        assert sum(w.done() for w in waiters) == 5
        # Ten kept-alive connections earn 4 + 2 x 10 in flight: room for the other 5.
        for _ in range(10):
            host.prove(_Conn(reads))
        connector._pace_wake("k", host)
        assert all(w.done() for w in waiters)
        # The two woken count against the room too: a floor of 7 is short of 6 waiters and
        # 2 woken, so the pool is counted (4 + 2 x 10) and all 6 go, not 7 - 2.
        host = _pacing._Host("example.com:80", _trusting(7))
        for _ in range(10):
            host.prove(_Conn(reads))
        waiters = [loop.create_future() for _ in range(6)]
        host.waiters.extend(waiters)
        host.woken = 2
        connector._pace_wake("k", host)
        assert all(w.done() for w in waiters)
    finally:
        await connector.close()


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_a_host_that_accepts_slowly_keeps_the_slow_growth(
    slow_accept: SlowAcceptServer,
) -> None:
    # One accept() every 50 ms: the burst's first responses come one after another, and each
    # proven connection earns GROWTH new ones, not QUICK_GROWTH (a burst at a full queue).
    connector = _pacing.PacedConnector(limit=16, burst=4)
    async with aiohttp.ClientSession(connector=connector) as session:
        got = await asyncio.gather(
            *(_paced_get(session, f"{slow_accept.url}/{i}") for i in range(4))
        )
        assert got == [bytes([i]) * 100 for i in range(4)]
        host = connector._pace_hosts["127.0.0.1", int(slow_accept.key.rsplit(":", 1)[1])]
        assert host.quick is False


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_new_connections_start_a_few_per_turn_of_the_loop(http_server: ObjectServer) -> None:
    # A trusted host may get 48 new connections at once; they start PER_TURN per turn of the
    # loop, first come first served, so that other work (a head batch's last samples) runs
    # between them.
    urls = [http_server.put(f"{i}.bin", bytes([i]) * 100) for i in range(48)]
    http_server.latency = 0.05
    key = _key(http_server)
    _hosts().trust(_memory.PacingMemory(((key, 48),)))
    turn = 0
    ticking = True

    def tick() -> None:
        nonlocal turn
        turn += 1
        if ticking:
            asyncio.get_running_loop().call_soon(tick)

    started: list[tuple[int, str]] = []

    class Recording(_pacing.PacedConnector):
        async def _wrap_create_connection(self, *args: Any, req: Any, **kwargs: Any) -> Any:
            started.append((turn, req.url.path))  # the connect itself starts now
            return await super()._wrap_create_connection(*args, req=req, **kwargs)

    connector = Recording(limit=64, burst=4)
    asyncio.get_running_loop().call_soon(tick)
    try:
        async with aiohttp.ClientSession(connector=connector) as session:
            got = await asyncio.gather(*(_paced_get(session, u) for u in urls))
    finally:
        ticking = False
    assert got == [bytes([i]) * 100 for i in range(48)]
    per_turn = collections.Counter(t for t, _ in started)
    assert len(started) == 48
    assert max(per_turn.values()) == _pacing.PER_TURN
    assert len(per_turn) >= 48 // _pacing.PER_TURN
    assert [p for _, p in started] == [f"/{i}.bin" for i in range(48)]  # in the order asked


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_a_host_whose_first_connect_fails_keeps_the_slow_growth() -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    connector = _pacing.PacedConnector(limit=16, burst=4)
    async with aiohttp.ClientSession(connector=connector) as session:
        with pytest.raises(aiohttp.ClientConnectorError):
            await session.get(f"http://127.0.0.1:{port}/0")
        assert connector._pace_hosts["127.0.0.1", port].quick is False


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_a_late_request_gets_its_turn_when_those_let_go_before_it_are_cancelled(
    http_server: ObjectServer,
) -> None:
    # A turn lets 8 waiting requests go; one more comes before they run, and joins the line;
    # then the 8 are cancelled. Their budget comes back, and the late request must still get
    # a turn (it waited for ever, and every new connection behind it).
    for i in range(100):
        http_server.put(f"{i}.bin", bytes([i]) * 100)
    http_server.latency = 0.05
    _hosts().trust(
        _memory.PacingMemory(((_key(http_server), 64),))
    )  # room for all: the turns are the only limit
    connector = _pacing.PacedConnector(limit=64, burst=4)
    async with aiohttp.ClientSession(connector=connector) as session:

        def get(i: int) -> Coroutine[Any, Any, bytes]:
            return _paced_get(session, f"{http_server.url}/{i}.bin")

        first = [asyncio.ensure_future(get(i)) for i in range(16)]
        await asyncio.sleep(0)
        assert len(connector._pace_turn_waiters) == 8
        late = asyncio.ensure_future(get(99))
        loop = asyncio.get_running_loop()
        loop.call_soon(lambda: [t.cancel() for t in first[8:]])  # after the refill lets them go
        assert await asyncio.wait_for(late, 5) == bytes([99]) * 100
        await asyncio.gather(*first, return_exceptions=True)
        more = await asyncio.wait_for(asyncio.gather(*(get(i) for i in range(20))), 5)
        assert more == [bytes([i]) * 100 for i in range(20)]


@pytest.mark.asyncio
@pytest.mark.timeout(30)
@pytest.mark.parametrize("trusted", [True, False], ids=["waiting-for-a-turn", "slow-start"])
async def test_closing_the_connector_fails_the_requests_that_wait_at_once(
    http_server: ObjectServer, trusted: bool
) -> None:
    for i in range(40):
        http_server.put(f"{i}.bin", bytes([i]) * 100)
    http_server.latency = 0.3
    if trusted:  # 40 at once: 8 go, 32 wait for their turns
        _hosts().trust(_memory.PacingMemory(((_key(http_server), 64),)))
    # else the slow start's burst (4) goes, 36 wait for room
    opened_after_close = 0

    class Counting(_pacing.PacedConnector):
        async def _wrap_create_connection(self, *args: Any, **kwargs: Any) -> Any:
            nonlocal opened_after_close
            opened_after_close += self._closed
            return await super()._wrap_create_connection(*args, **kwargs)

    connector = Counting(limit=64, burst=4)
    session = aiohttp.ClientSession(connector=connector)

    async def get(i: int) -> bytes:
        async with session.get(f"{http_server.url}/{i}.bin") as resp:
            return await resp.read()

    tasks = [asyncio.ensure_future(get(i)) for i in range(40)]
    await asyncio.sleep(0)
    host = connector._pace_hosts["127.0.0.1", http_server.port]
    assert len(connector._pace_turn_waiters if trusted else host.waiters) >= 32
    await session.close()
    done, pending = await asyncio.wait(tasks, timeout=2)
    assert not pending  # none waits on (for a grace period, or for ever)
    for task in done:
        assert isinstance(task.exception(), aiohttp.ClientConnectionError)
    assert opened_after_close == 0
    assert host.pending == 0


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_a_request_cancelled_while_waiting_for_its_turn_gives_it_back(
    http_server: ObjectServer,
) -> None:
    urls = [http_server.put(f"{i}.bin", bytes([i]) * 100) for i in range(40)]
    http_server.latency = 0.05
    key = _key(http_server)
    _hosts().trust(_memory.PacingMemory(((key, 40),)))
    connector = _pacing.PacedConnector(limit=64, burst=4)
    async with aiohttp.ClientSession(connector=connector) as session:
        get = functools.partial(_paced_get, session)
        tasks = [asyncio.ensure_future(get(u)) for u in urls]
        await asyncio.sleep(0)  # they start, and most wait for a turn
        assert len(connector._pace_turn_waiters) == 40 - _pacing.PER_TURN
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        host = connector._pace_hosts["127.0.0.1", http_server.port]
        assert host.pending == 0
        assert not connector._pace_turn_waiters
        # Nothing was lost: new requests still get their turns and their bytes.
        assert await asyncio.gather(*(get(u) for u in urls[:20])) == [
            bytes([i]) * 100 for i in range(20)
        ]


@pytest.mark.asyncio
@pytest.mark.timeout(30)
@pytest.mark.parametrize(("sharers", "burst"), [(2, 4), (4, 2), (100, _memory.MIN_BURST)])
async def test_a_loaders_workers_share_the_first_burst(
    http_server: ObjectServer, sharers: int, burst: int
) -> None:
    urls = [http_server.put(f"{i}.bin", bytes([i]) * 100) for i in range(N)]
    http_server.latency = LATENCY
    _storage.configure(http_server.url, hedge=None)
    _storage.import_config(_storage.export_config(), pool_size=64, sharers=sharers)
    assert await _first_round_peak(http_server, urls) == burst


@pytest.mark.timeout(60)
def test_a_new_host_sees_one_burst_from_all_the_workers(http_server: ObjectServer) -> None:
    # 2 workers, 4 new connections each: 8 requests at the server in the first round trip.
    urls = [http_server.put(f"{i}.bin", bytes([i % 256]) * 100) for i in range(128)]
    http_server.latency = LATENCY
    _storage.configure(http_server.url, hedge=None)
    http_server.finished = 0
    peaks: list[int] = []

    def watch() -> None:
        deadline = time.monotonic() + 30  # bounded: the loader's pass ends well before
        while not http_server.active and time.monotonic() < deadline:
            time.sleep(0.001)
        while not http_server.finished and time.monotonic() < deadline:  # the first round
            peaks.append(http_server.active)
            time.sleep(0.002)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    loader = asyncload.DataLoader(
        asyncload.RemoteFiles(urls), batch_size=16, num_workers=2, collate_fn=list
    )
    assert [x for batch in loader for x in batch] == [bytes([i % 256]) * 100 for i in range(128)]
    watcher.join(30)
    assert max(peaks) == _memory.BURST


class SlowAcceptServer:
    """A keep-alive HTTP server whose accept queue overflows: a listen backlog of 1 (two
    connections wait at most), and one ``accept()`` every 50 ms. ``GET /{i}`` answers 100
    bytes of ``i % 256`` at once. Threads, all daemonic; ``close()`` stops accepting."""

    EVERY = 0.05

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1)
        self.key = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.url = f"http://{self.key}"
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.wait(self.EVERY):
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(10)  # bounded: an idle connection ends by itself
        buf = b""
        with conn:
            try:
                while True:
                    while b"\r\n\r\n" not in buf:
                        data = conn.recv(65536)
                        if not data:
                            return
                        buf += data
                    head, buf = buf.split(b"\r\n\r\n", 1)
                    i = int(head.split(b" ")[1].strip(b"/"))
                    body = bytes([i % 256]) * 100
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + body)
            except OSError:
                return

    def close(self) -> None:
        self._closed.set()
        self.sock.close()


def _listen_overflows() -> int | None:
    """Linux's count of SYNs dropped because an accept queue was full (this namespace)."""
    try:
        lines = Path("/proc/net/netstat").read_text().splitlines()
    except OSError:
        return None
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names.startswith("TcpExt:"):
            return dict(zip(names.split()[1:], map(int, values.split()[1:]), strict=True)).get(
                "ListenOverflows"
            )
    return None


@pytest.fixture
def slow_accept() -> Iterator[SlowAcceptServer]:
    server = SlowAcceptServer()
    yield server
    server.close()


async def _timed_reads(urls: list[str]) -> float:
    t0 = time.monotonic()
    try:
        got = await asyncio.gather(*(asyncload.read(u) for u in urls))
    finally:
        await _storage.aclose()
    assert got == [bytes([int(u.rsplit("/", 1)[1]) % 256]) * 100 for u in urls]
    return time.monotonic() - t0


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_an_overflowed_accept_queue_caps_the_host_from_then_on(
    slow_accept: SlowAcceptServer,
) -> None:
    _storage.configure(slow_accept.url, hedge=None, connect_timeout=30)
    _storage.set_pool_size(16)
    before = _listen_overflows()
    # A new host's burst (8) does not fit a queue of two: the kernel drops SYNs, which it
    # retries after 1 s. A first attempt still under way at SYN_RETRY is the evidence (its fresh
    # rivals find room sooner, or not), so the pass, 16 accepts 50 ms apart, outlasts it.
    assert await _timed_reads([f"{slow_accept.url}/{i}" for i in range(16)]) >= _pacing.SYN_RETRY
    if before is not None:
        assert (_listen_overflows() or 0) > before  # the drops were real
    cap = _hosts().caps()[slow_accept.key]
    assert 1 <= cap <= 2  # half of the 3 or 4 under way when a dropped SYN left
    assert (slow_accept.key, cap) in _storage.export_config().pacing.burst_caps

    # The next pass's workers trust what the host proved (16 at once), within its cap.
    config = _storage.export_config()
    _hosts().forget()
    pacing = dataclasses.replace(config.pacing, connections=((slow_accept.key, 16),))
    _storage.import_config(dataclasses.replace(config, pacing=pacing))
    before = _listen_overflows()
    assert await _timed_reads([f"{slow_accept.url}/{i}" for i in range(16, 48)]) < 0.9
    if before is not None:
        assert _listen_overflows() == before


class GatedServer:
    """An HTTP server with a listen backlog of 0 (one connection waits, at most) that accepts
    only while ``accepting`` is set: a connection left in its queue meanwhile (``fill``) makes
    the kernel drop the next SYN. ``GET /{i}`` answers 100 bytes of ``i % 256``, then closes.
    Threads, all daemonic; ``close()`` stops accepting."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(0)
        self.sock.settimeout(0.01)
        self.port = self.sock.getsockname()[1]
        self.key = f"127.0.0.1:{self.port}"
        self.accepting = threading.Event()
        self._closed = threading.Event()
        self._idle = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            if not self.accepting.is_set():
                self._idle.set()
                self.accepting.wait(0.01)
                continue
            self._idle.clear()
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(10)  # bounded: an idle connection ends by itself
        with conn:
            try:
                head = b""
                while b"\r\n\r\n" not in head:
                    data = conn.recv(65536)
                    if not data:
                        return
                    head += data
                i = int(head.split(b" ")[1].strip(b"/"))
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\nConnection: close\r\n\r\n"
                    + bytes([i % 256]) * 100
                )
            except OSError:
                return

    def fill(self) -> socket.socket:
        """Stop accepting, and leave one connection in the queue: it is full."""
        self.accepting.clear()
        self._idle.clear()
        assert self._idle.wait(5)  # out of accept(): the filler stays queued
        return socket.create_connection(("127.0.0.1", self.port), timeout=5)

    def close(self) -> None:
        self._closed.set()
        self.sock.close()


@pytest.fixture
def gated() -> Iterator[GatedServer]:
    server = GatedServer()
    server.accepting.set()
    yield server
    server.close()


def _syn_sent(port: int) -> int:
    """This process's sockets still connecting to *port* on 127.0.0.1."""
    me = psutil.Process()
    connections = getattr(me, "net_connections", None) or me.connections  # psutil < 6
    return sum(
        1
        for c in connections(kind="tcp")
        if c.raddr and c.raddr.port == port and c.status == psutil.CONN_SYN_SENT
    )


@contextlib.asynccontextmanager
async def _racing(
    session: aiohttp.ClientSession, gated: GatedServer
) -> AsyncIterator[tuple[asyncio.Future[bytes], float]]:
    """A read of ``/1`` whose SYN the full queue dropped, 150 ms after it began (fresh attempts
    due at 50 and 100 ms), and when it began; a fast connect before it taught the host."""
    url = f"http://{gated.key}"
    assert await _paced_get(session, f"{url}/0") == bytes([0]) * 100
    with gated.fill():
        t0 = time.monotonic()
        read = asyncio.ensure_future(_paced_get(session, f"{url}/1"))
        await asyncio.sleep(0.15)
        yield read, t0


@pytest.mark.asyncio
@pytest.mark.timeout(30)
@pytest.mark.parametrize("hedges", [0, _pacing.HEDGES])
async def test_a_connect_whose_syn_was_dropped_is_raced_by_a_fresh_one(
    gated: GatedServer, hedges: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The kernel resends a dropped SYN after 1 s. A fresh attempt, 50 ms late at the most
    # (HEDGE_FLOOR; this host's connects take well under 1 ms), gets in once the queue has
    # room; the first attempt, still under way at SYN_RETRY, is the evidence for the cap all
    # the same. Without fresh attempts (0, the control), the connect waits for that second.
    monkeypatch.setattr(_pacing, "HEDGES", hedges)
    connector = _pacing.PacedConnector(limit=64, burst=4)
    async with aiohttp.ClientSession(connector=connector) as session:
        async with _racing(session, gated) as (read, t0):
            assert _syn_sent(gated.port) == min(hedges, 2) + 1  # at 0, 50 and 100 ms
            gated.accepting.set()  # the filler is taken: room for one
            assert await read == bytes([1]) * 100
            took = time.monotonic() - t0
        assert (took < _pacing.SYN_RETRY) == bool(hedges), took
        await asyncio.sleep(max(0.0, t0 + _pacing.SYN_RETRY + 0.2 - time.monotonic()))
        assert _hosts().caps() == {gated.key: 1}  # half of the one under way, 1 at least
        assert _syn_sent(gated.port) == 0  # the first attempt was let go


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_a_request_cancelled_while_its_connect_is_raced_leaves_no_socket(
    gated: GatedServer,
) -> None:
    connector = _pacing.PacedConnector(limit=64, burst=4)
    async with aiohttp.ClientSession(connector=connector) as session:
        async with _racing(session, gated) as (read, _):
            assert _syn_sent(gated.port) == 3
            read.cancel()
            with pytest.raises(asyncio.CancelledError):
                await read
            await asyncio.sleep(0.01)  # the attempts' sockets close as their tasks end
            assert _syn_sent(gated.port) == 0
    assert _hosts().caps() == {}  # cancelled before SYN_RETRY: no evidence either way


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_closing_the_connector_while_a_connect_is_raced_leaves_no_socket(
    gated: GatedServer,
) -> None:
    connector = _pacing.PacedConnector(limit=64, burst=4)
    session = aiohttp.ClientSession(connector=connector)
    try:
        async with _racing(session, gated) as (read, _):
            assert _syn_sent(gated.port) == 3
            await session.close()  # waits for the attempts it cancels
            assert _syn_sent(gated.port) == 0
            with pytest.raises((aiohttp.ClientError, asyncio.CancelledError)):
                await read
    finally:
        await session.close()
    assert not connector._pace_attempts
    assert not connector._pace_late


@pytest.mark.timeout(10)
def test_a_host_keeps_its_lowest_cap() -> None:
    _hosts().trust(_memory.PacingMemory((("example.com:443", 40),), (("example.com:443", 8),)))
    _hosts().trust(_memory.PacingMemory(burst_caps=(("example.com:443", 2),)))
    _hosts().trust(_memory.PacingMemory(burst_caps=(("example.com:443", 5), ("other:80", 0))))
    assert _hosts().caps() == {"example.com:443": 2}
    assert _hosts().learned() == {"example.com:443": 40}
    _hosts().forget()
    assert _hosts().caps() == {}


@pytest.mark.timeout(90)
def test_a_pass_that_overflowed_caps_the_next_one(slow_accept: SlowAcceptServer) -> None:
    # The cap a worker set rides to the main process in its stats, for the next pass.
    _storage.configure(slow_accept.url, hedge=None, connect_timeout=30)
    urls = [f"{slow_accept.url}/{i}" for i in range(64)]
    loader = asyncload.DataLoader(
        asyncload.RemoteFiles(urls), batch_size=16, num_workers=2, collate_fn=list
    )
    assert [x for batch in loader for x in batch] == [bytes([i]) * 100 for i in range(64)]
    assert 1 <= _hosts().caps()[slow_accept.key] <= 2
    assert (slow_accept.key, _hosts().caps()[slow_accept.key]) in (
        _storage.export_config().pacing.burst_caps
    )


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_a_host_that_closes_after_each_response_is_never_trusted(tmp_path: Path) -> None:
    # python -m http.server speaks HTTP/1.0: every connection is answered, then closed. Its
    # answered connections must not be taken for ones it keeps alive (the next pass would
    # open that many at once at a backlog of 5).
    for i in range(32):
        (tmp_path / f"{i}.bin").write_bytes(bytes([i]) * 100)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    serve = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    serve.daemon = True
    serve.start()
    key = f"127.0.0.1:{server.server_address[1]}"
    try:
        _storage.configure(f"http://{key}", hedge=None)
        _storage.set_pool_size(64)
        urls = [f"http://{key}/{i}.bin" for i in range(32)]
        try:
            assert await asyncio.gather(*(asyncload.read(u) for u in urls)) == [
                bytes([i]) * 100 for i in range(32)
            ]
        finally:
            await _storage.aclose()
    finally:
        server.shutdown()
        server.server_close()
    assert key not in _hosts().learned()
    assert key not in dict(_storage.export_config().pacing.connections)


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_connections_closed_before_their_first_response_free_their_slots_at_once(
    http_server: ObjectServer,
) -> None:
    # A `break` out of the training loop cancels the requests in flight: their connections
    # close unanswered, and hold no place in the server's accept queue. Their slots must not
    # wait out the grace period (a persistent pass's next first batch came 1 s late).
    urls = [http_server.put(f"{i}.bin", bytes([i]) * 100) for i in range(8)]
    http_server.latency = LATENCY
    connector = _pacing.PacedConnector(limit=64, burst=4, grace=20.0)
    async with aiohttp.ClientSession(connector=connector) as session:
        get = functools.partial(_paced_get, session)
        tasks = [asyncio.ensure_future(get(u)) for u in urls[:4]]
        host = None
        for _ in range(500):  # until the four are connected and wait for their answers
            await asyncio.sleep(0.005)
            host = connector._pace_hosts.get(("127.0.0.1", http_server.port))
            if host is not None and len(host.unproven) == 4:
                break
        assert host is not None
        assert len(host.unproven) == 4
        assert host.room(4) == 0
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert not host.unproven
        assert host.room(4) == 4
        assert host.quick is None  # a cancelled request says nothing of the host
        t0 = time.monotonic()
        assert await asyncio.gather(*(get(u) for u in urls[4:])) == [
            bytes([i]) * 100 for i in range(4, 8)
        ]
        assert time.monotonic() - t0 < 10  # answered, not held for the 20 s grace


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_a_pool_emptied_mid_pass_starts_again_from_what_the_host_proved(
    http_server: ObjectServer,
) -> None:
    # What the host proves during the pass (the process's memory) counts at once, not only
    # for the next pass's workers: after a `break` closed every connection, a persistent
    # worker opens as many as the host held, as a new worker would.
    url = http_server.put("0.bin", b"x" * 100)
    key = _key(http_server)
    connector = _pacing.PacedConnector(limit=64, burst=4)
    async with aiohttp.ClientSession(connector=connector) as session:
        assert await _paced_get(session, url) == b"x" * 100
        host = connector._pace_hosts["127.0.0.1", http_server.port]
        before = host.limit(4)
        assert before < 40
        _hosts().remember_proven(key, 40)  # as this connector's kept_alive records it
        assert host.limit(4) == 40
