"""Open new connections to one host a few at a time, not in a burst of hundreds of SYNs.

A server with a small listen backlog (``python -m http.server`` has 5) drops the SYNs that do
not fit in its accept queue; the kernel retries them after 1 s, then 3 s, so a burst of 64
connections turns a 1 ms request into a 1 s or 3 s one, silently. Holding the *connect* alone
is not enough: the handshake completes in the kernel before the server calls ``accept()``, so
a connection only proves that the server took it when its first response arrives.

``PacedConnector`` therefore lets at most ``burst`` connections per host be *unproven*
(opened, with no response yet). A slot is given back at the first response on the connection,
when the connection fails or closes unanswered (a request cancelled by a ``break``), or after
``grace`` seconds, so that a slow but healthy server (whose
first response takes longer than ``grace``) still gets its pool filled quickly: ``burst``
connections every ``grace`` seconds at the slowest.

A server that accepts promptly shows it: the first burst's connections, opened together, are
answered together (their first responses' latencies within ``QUICK_SPREAD``), where one that
accepts a connection every few milliseconds answers them one after another, each later by that
much. A host whose first burst came back together grows faster (``QUICK_GROWTH``), so that a
loader's first batch takes two round trips instead of three; any other keeps the slower growth.
However many it may open, a connector starts about ``PER_TURN`` new connections per turn of
the event loop, first come first served.

Slow start costs round trips, and every pass of a loader starts new worker processes with empty
pools: a host that has proven it takes *n* connections starts with ``min(n, TRUSTED_BURST)`` of
them in flight instead of ``burst``, and so does a pool that a ``break`` emptied mid-pass (a
persistent worker's). What a process learned of its hosts, and hands on to the
next pass's workers, is ``pacing_memory``.

A listen backlog can be smaller than what a host proved it holds, and a server busy serving may
leave its accept queue full: then a SYN is dropped, and its connect completes only when the
kernel retries it, after 1 s. A connect that took that long (``SYN_RETRY``) is that evidence, so
the host's new connections in flight are capped from then on at half as many as were under way
when it started, in this pass and, like what a host proved, in the next ones: the worker's
``pacing_memory`` carries the cap to the main process, and ``trust`` to the next workers. The
first overflow costs its requests that second; later ones are avoided.

That second is not waited out either: a connect still under way well after the host's fastest
(``HEDGE_FACTOR`` times it, ``HEDGE_FLOOR`` at least) is raced by a fresh one, whose SYN finds
the room the server has made since, and the first to connect is used. (A dropped SYN is not
resent by the kernel for 1 s; a SYN delayed on its way is rarely that late.) A fresh attempt
counts among the host's connects under way while it lasts, as its SYN does at the server. The
first attempt goes on in the background until ``SYN_RETRY``: if it is still under way then, that
is the evidence for the cap as above, and it is dropped; if it connects sooner, it was late, not
lost, and is closed. Closing the connector cancels every attempt and waits for them to end.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
from typing import Any

import aiohttp

from ..state import current
from .pacing_memory import HostMemory

__all__ = [
    "GROWTH",
    "HEDGES",
    "HEDGE_FACTOR",
    "HEDGE_FLOOR",
    "PER_TURN",
    "QUICK_GROWTH",
    "SYN_RETRY",
    "TRUSTED_BURST",
    "PacedConnector",
]

# Seconds after which a connection with no response gives its slot back anyway (a stalled
# server must not hold up new connections for good); the first SYN retry comes at 1 s.
GRACE = 1.0
# New connections in flight at once, at most, for a host an earlier pass proved (see module
# doc). A pass's whole window goes out at its start: its first batch alone, the rest at most 10 ms
# later (``_engine._map.HEAD_START``). Held to 32, the rest left only as the first responses came
# in, and sending them took the CPU that reading the head batch needed. 128 is the default
# max_concurrency (a worker's pool); the slow start that proved n had about 2n/3 new connections
# in flight at once already, and a host whose accept queue overflows is capped (``SYN_RETRY``).
TRUSTED_BURST = 128
# Seconds a connect takes when its first SYN was dropped: the kernel retries after 1 s (then 3 s).
# No healthy connect takes this long; one that does overflowed the server's accept queue (or
# lost its SYN to congestion, which calls for the same care).
SYN_RETRY = 0.9
# A connect still under way HEDGE_FACTOR times the host's fastest connect after it started, and
# HEDGE_FLOOR seconds at least, is raced by a fresh attempt; HEDGES of them at most, each at twice
# the last one's delay, and none once SYN_RETRY is near (the kernel's own retry comes first).
# Loopback connects take 0.1-0.5 ms and one to a nearby region 1-5 ms: an attempt 50 ms late
# lost its SYN (or its SYN-ACK), which the kernel resends only after 1 s.
HEDGE_FACTOR = 4
HEDGE_FLOOR = 0.05
HEDGES = 3
# New connections in flight that each answered kept-alive connection earns: GROWTH (a pool that
# triples per round trip), or QUICK_GROWTH (x7) for a host whose first burst was answered
# together. At 50 ms and 2 workers the first batch (32) then takes two round trips (4, then
# those 4 and 28 new) instead of three (4, then 4 and 12 new, then the rest). Not for every
# host: a server that accepts 20 connections a second, with a queue of 2, took 5.9-32.6 s for
# a first pass of 64 requests at x7 for all, against 3.3-4.5 s at x3, as each proof it gave
# sent six more SYNs at its full queue. Its first burst is not answered together.
GROWTH = 2
QUICK_GROWTH = 6
# New connections a connector starts per turn of the event loop (a budget that a callback refills
# once a turn: one turn may use the rest of the last budget and the new one). The slow start
# grants dozens at once, the moment the head batch's responses prove their connections: started
# in one turn, their connects and requests (~0.2 ms of CPU each) ran ahead of the head batch's
# last steps, which waited 15-50 ms for them. Held to this many a turn, they interleave.
PER_TURN = 8
# A first burst was answered together if its first responses' latencies (from each connect's
# start) lie within QUICK_SPREAD seconds of each other: jitter, not a queue. Accepting one
# connection every 10 ms or slower spreads any two of them further. (Not a share of the
# latency: a server that accepts every 15 ms and answers in 900 ms would pass 5% of it.)
QUICK_SPREAD = 0.010
# A host's answered connections are pruned of closed ones once they are this many, and then
# twice as many as were left: a pool that churns its connections does not grow the set for good.
_PRUNE_AT = 64


# The host and connection key of the request whose connection this task opens (_create_connection
# to _wrap_create_connection, which sees only the proxy's request when there is one).
_CONNECTING: contextvars.ContextVar[tuple[_Host, Any] | None] = contextvars.ContextVar(
    "asyncload_pace_connecting", default=None
)


def _discard(task: asyncio.Task[Any]) -> None:
    """Drop a connect attempt: cancel it, close what it connects, let go of what it raises."""
    task.add_done_callback(_close_connected)
    task.cancel()


def _close_connected(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is None:
        task.result()[0].close()  # (transport, protocol)


class _Host:
    __slots__ = (
        "_prune_at",
        "fastest",
        "firsts",
        "kept",
        "key",
        "memory",
        "most",
        "pending",
        "proven",
        "quick",
        "unproven",
        "waiters",
        "woken",
    )

    def __init__(self, key: str, memory: HostMemory | None = None) -> None:
        self.key = key
        # What the connector's storage context knows of the host (pacing_memory): read at the
        # start, told what this connector proves.
        self.memory = current().hosts if memory is None else memory
        self.pending = 0  # connects under way, not yet a protocol
        self.fastest: float | None = None  # the quickest connect to the host, in seconds
        # unproven connection -> its grace timer, and when its connect started
        self.unproven: dict[Any, tuple[asyncio.TimerHandle, float]] = {}
        # The first burst's first-response latencies, until `quick` is known: whether the host
        # answered that burst together (see module doc).
        self.firsts: list[float] = []
        self.quick: bool | None = None
        self.proven: set[Any] = set()  # answered connections (closed ones pruned now and then)
        self._prune_at = _PRUNE_AT
        self.kept: set[Any] = set()  # connections that went back to the pool after a response
        self.most = 0  # the most of those held at once
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self.woken = 0  # waiters told to go that have not run yet: they keep their turn

    def limit(self, burst: int) -> int:
        # Slow start: every kept-alive connection the server has answered on earns GROWTH more
        # new connections in flight (QUICK_GROWTH if it answered the first burst together); a
        # server that closes after each response (HTTP/1.0, http.server) stays at `burst`.
        # A connection still reading its body also says `should_close` (aiohttp: its payload
        # is not at EOF): it counts again once released, so it is skipped now, not forgotten.
        self._prune()
        return self._limit(burst, sum(1 for p in self.proven if not p.should_close))

    def _limit(self, burst: int, kept: int) -> int:
        growth = QUICK_GROWTH if self.quick else GROWTH
        # What the host has proven (the process's memory, which this connector teaches too): a
        # pool emptied mid-pass (a `break` closes the requests in flight) starts again from
        # there, as the next pass's new workers would, not from `burst`.
        trusted = min(self.memory.proven(self.key), TRUSTED_BURST)
        limit = max(burst + growth * kept, trusted)
        cap = self.memory.cap(self.key)  # the context's: a hedge session's overflow counts too
        return limit if cap is None else min(limit, cap)

    def room(self, burst: int, *, need: int = 1) -> int:
        """New connections that may be opened now, exact up to *need*: where at least that
        many are sure without counting the pool's kept-alive connections, that lower bound
        (only ``min(room, need)`` is exact)."""
        under_way = self.pending + len(self.unproven)
        # The limit with none kept alive bounds it from below. Counting them walks the whole
        # pool, and a busy pool is asked on every release with requests waiting and on every
        # request that finds no idle connection: with 128 connections and 1 KB answers at
        # 0 ms, HttpBackend.read took 296-364 us of CPU a request with the walk, 236-247
        # without (128 tasks, 3 interleaved pairs).
        sure = self._limit(burst, 0) - under_way
        return sure if sure >= need else self.limit(burst) - under_way

    def prove(self, proto: Any) -> None:
        """*proto*, a new connection, got its first response."""
        self.proven.add(proto)
        if len(self.proven) >= self._prune_at:  # closed ones go now and then, not every time
            self._prune()

    def _prune(self) -> None:
        self.proven = {p for p in self.proven if p.is_connected()}
        self._prune_at = max(_PRUNE_AT, 2 * len(self.proven))

    def kept_alive(self, proto: Any) -> None:
        """*proto* went back to the pool after a response: the server keeps connections alive.
        (An answered connection proves nothing more: HTTP/1.0 closes each after its response,
        and a host that does was trusted with as many at once as it had answered at a time.)"""
        if proto in self.kept:
            return
        self.kept.add(proto)
        if len(self.kept) > self.most:  # a record, perhaps: count only those still open
            self.kept = {p for p in self.kept if p.is_connected()}
            if len(self.kept) > self.most:
                self.most = len(self.kept)
                self.memory.remember_proven(self.key, self.most)

    def answered(self, latency: float | None, burst: int) -> None:
        """A new connection got its first response *latency* seconds after its connect began
        (None: it failed, or gave its slot back unanswered). Once *burst* have, the host's
        growth is known: quick if they came back together."""
        if self.quick is not None:
            return
        if latency is None:  # a stall or a failure in the first burst: no quick growth
            self.quick = False
            return
        self.firsts.append(latency)
        if len(self.firsts) >= max(burst, 2):
            self.quick = max(self.firsts) - min(self.firsts) <= QUICK_SPREAD
            self.firsts = []

    def hedge_due(self, hedges: int, last: float) -> float | None:
        """Seconds after a connect's start at which its next fresh attempt is due, it having
        had *hedges* already, the last (or the connect itself) begun *last* seconds after it;
        None while no connect to the host has finished (nothing to compare with yet), or when
        no more are due (``HEDGES`` of them, or the kernel's own retry comes first)."""
        if self.fastest is None or hedges >= HEDGES:
            return None
        delay = max(HEDGE_FLOOR, HEDGE_FACTOR * self.fastest)
        due = max(delay * 2**hedges, last + delay)  # one at a time, however late the first
        return due if due < SYN_RETRY else None

    def connected(self, seconds: float) -> None:
        """A connect to the host took *seconds*."""
        if self.fastest is None or seconds < self.fastest:
            self.fastest = seconds

    def overflowed(self, under_way: int) -> None:
        """A connect waited for a SYN retry while *under_way* new connections were (itself
        included; see module doc): cap the new connections in flight at half that."""
        cap = max(1, under_way // 2)
        known = self.memory.cap(self.key)
        if known is None or cap < known:
            self.memory.remember_cap(self.key, cap)

    def wake(self, n: int) -> None:
        """Let the first *n* waiters go, in the order they came."""
        while n > 0 and self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                self.woken += 1
                n -= 1


class PacedConnector(aiohttp.TCPConnector):
    """A ``aiohttp.TCPConnector`` that paces new connections per host (see module doc).

    Requests that find neither an idle kept-alive connection nor room for a new one wait in
    line, first come first served: a connection the server gives back goes to the request that
    has waited longest, not to whichever request happens to ask next. (A loader asks for its
    samples in batch order, so the head batch is not starved by later ones while the pool is
    still growing.)

    Examples:
        >>> connector = PacedConnector(limit=64)  # doctest: +SKIP
        >>> session = aiohttp.ClientSession(connector=connector)  # doctest: +SKIP
    """

    def __init__(
        self, *args: Any, burst: int | None = None, grace: float = GRACE, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self._pace_memory = current().hosts
        self._pace_burst = self._pace_memory.first_burst() if burst is None else burst
        self._pace_grace = grace
        self._pace_hosts: dict[tuple[str, int | None], _Host] = {}
        # unproven protocol -> its host and connection key
        self._pace_host_of: dict[Any, tuple[_Host, Any]] = {}
        # New connections this turn of the loop may still start, and those waiting for a turn.
        self._pace_turn_left = PER_TURN
        self._pace_turn_waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._pace_refill_due = False
        # Connect attempts under way, and first attempts that a fresh one beat, kept until
        # SYN_RETRY as evidence (module doc).
        self._pace_attempts: set[asyncio.Task[Any]] = set()
        self._pace_late: dict[asyncio.Task[Any], asyncio.TimerHandle] = {}

    def _pace_host(self, host_name: str, port: int | None) -> _Host:
        host = self._pace_hosts.get((host_name, port))
        if host is None:
            key = f"{host_name}:{port}"
            host = self._pace_hosts[host_name, port] = _Host(key, self._pace_memory)
        return host

    def _pace_can_go(self, key: Any, host: _Host) -> bool:
        return bool(self._conns.get(key)) or host.room(self._pace_burst) > 0

    async def connect(self, req: Any, traces: Any, timeout: Any) -> Any:
        key = req.connection_key
        host = self._pace_host(req.host, req.port)
        if host.waiters or host.woken or not self._pace_can_go(key, host):
            await self._pace_wait(key, host, first=False)
            self._pace_check_open()
            while not self._pace_can_go(key, host):  # woken, then beaten to it: keep the turn
                await self._pace_wait(key, host, first=True)
                self._pace_check_open()
            self._pace_wake(key, host)  # room for more than this one: pass it down the line
        return await super().connect(req, traces, timeout)

    def _pace_check_open(self) -> None:
        if self._closed:  # closed while this request waited (see _close)
            raise aiohttp.ClientConnectionError("Connector is closed.")

    def _close(self, *args: Any, **kwargs: Any) -> Any:
        # aiohttp cancels the requests waiting for its own limit; those waiting here are let go
        # at once instead (not cancelled: their callers did not ask for that), and fail as a
        # closed connector's requests do, without opening a connection.
        result = super()._close(*args, **kwargs)
        for host in self._pace_hosts.values():
            host.wake(len(host.waiters))
            for grace, _ in host.unproven.values():
                grace.cancel()
            host.unproven.clear()
        self._pace_host_of.clear()
        while self._pace_turn_waiters:
            waiter = self._pace_turn_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
        for due in self._pace_late.values():
            due.cancel()
        self._pace_late.clear()
        for attempt in list(self._pace_attempts):
            _discard(attempt)  # its socket closes as it ends
            if isinstance(result, list):  # aiohttp 3.12+ waits for what it closes
                result.append(attempt)
        return result

    async def _wrap_create_connection(self, *args: Any, **kwargs: Any) -> Any:
        # The TCP connect (and TLS handshake) of one new connection, raced by fresh attempts
        # when it is late (module doc). Its host is the request's, also through a proxy.
        host, key = _CONNECTING.get() or (
            self._pace_host(kwargs["req"].host, kwargs["req"].port),
            kwargs["req"].connection_key,
        )
        under_way = host.pending + len(host.unproven)
        loop = asyncio.get_running_loop()
        began = loop.time()
        first = self._pace_attempt(loop, host, key, args, kwargs, hedge=False)
        attempts = {first: 0.0}  # those under way -> when each began, after the first
        hedges = 0
        last = 0.0
        try:
            while True:
                due = host.hedge_due(hedges, last)
                elapsed = loop.time() - began
                if due is not None and elapsed >= due:
                    attempts[self._pace_attempt(loop, host, key, args, kwargs, hedge=True)] = (
                        elapsed
                    )
                    hedges += 1
                    last = elapsed
                    continue
                if due is not None:
                    wait: float | None = due - elapsed
                elif host.fastest is None:
                    wait = HEDGE_FLOOR  # look again once another connect has finished
                else:
                    wait = None
                done, _ = await asyncio.wait(
                    attempts, timeout=wait, return_when=asyncio.FIRST_COMPLETED
                )
                for task in done:
                    if task.cancelled() and task is first:  # only _close cancels it
                        raise aiohttp.ClientConnectionError("Connector is closed.")
                    if task.cancelled() or task.exception() is not None:
                        if task is first:  # refused, or its connect timeout: the race is over
                            raise task.exception()  # type: ignore[misc]
                        del attempts[task]  # a fresh one failed: the others go on
                        continue
                    took = loop.time() - began - attempts.pop(task)
                    host.connected(took)
                    if task is first and took >= SYN_RETRY:
                        host.overflowed(under_way)
                    if first in attempts:  # beaten: it may yet show a dropped SYN
                        del attempts[first]
                        first.add_done_callback(_close_connected)
                        self._pace_late[first] = loop.call_at(
                            began + SYN_RETRY, self._pace_late_due, first, host, under_way
                        )
                    return task.result()
        finally:
            for task in attempts:  # fresh attempts that lost, or all when it failed
                _discard(task)

    def _pace_attempt(
        self,
        loop: asyncio.AbstractEventLoop,
        host: _Host,
        key: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        hedge: bool,
    ) -> asyncio.Task[Any]:
        """Start one connect attempt; the connector knows of it until it ends (``_close``). A
        fresh one counts among the host's connects under way, as its SYN does at the server."""
        task = loop.create_task(super()._wrap_create_connection(*args, **kwargs))
        self._pace_attempts.add(task)
        task.add_done_callback(self._pace_attempts.discard)
        if hedge:
            host.pending += 1

            def ended(_: asyncio.Task[Any]) -> None:
                host.pending -= 1
                self._pace_wake(key, host)

            task.add_done_callback(ended)
        return task

    def _pace_late_due(self, first: asyncio.Task[Any], host: _Host, under_way: int) -> None:
        """SYN_RETRY after it began: a first attempt that a fresh one beat and that is still
        under way lost its SYN to a full accept queue (module doc). Late or lost, it goes."""
        del self._pace_late[first]
        if not first.done():
            host.overflowed(under_way)
        first.cancel()  # what it connects is closed (its callback since it was beaten)

    async def _pace_wait(self, key: Any, host: _Host, *, first: bool) -> None:
        waiter = asyncio.get_running_loop().create_future()
        if first:
            host.waiters.appendleft(waiter)
        else:
            host.waiters.append(waiter)
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():  # woken, then cancelled
                host.woken -= 1
                self._pace_wake(key, host)  # pass on the turn it was given
            else:
                waiter.cancel()
            raise
        host.woken -= 1

    async def _create_connection(self, req: Any, traces: Any, timeout: Any) -> Any:
        key = req.connection_key
        host = self._pace_host(req.host, req.port)
        # connect() kept the line; this only holds a request whose idle connection was stale.
        while host.room(self._pace_burst) <= 0:
            await self._pace_wait(key, host, first=True)
            self._pace_check_open()
        host.pending += 1
        loop = asyncio.get_running_loop()
        started = 0.0
        connecting = False
        try:
            if self._pace_turn_left > 0 and not self._pace_turn_waiters:
                self._pace_turn_left -= 1
                self._pace_refill_soon(loop)
            else:
                await self._pace_next_turn(loop)  # the refill counts it
                self._pace_check_open()
            started = loop.time()
            connecting = True
            token = _CONNECTING.set((host, key))
            try:
                proto = await super()._create_connection(req, traces, timeout)
            finally:
                _CONNECTING.reset(token)
        except BaseException as exc:
            host.pending -= 1
            if connecting and isinstance(exc, Exception):
                host.answered(None, self._pace_burst)  # a connect that failed: no quick growth
            self._pace_wake(key, host)
            raise
        host.pending -= 1
        grace = loop.call_later(self._pace_grace, self._pace_release, proto, False)
        host.unproven[proto] = (grace, started)
        self._pace_host_of[proto] = (host, key)
        return proto

    async def _pace_next_turn(self, loop: asyncio.AbstractEventLoop) -> None:
        """Wait, in line, for a turn of the loop with room for one more new connection."""
        waiter = loop.create_future()
        self._pace_turn_waiters.append(waiter)
        self._pace_refill_soon(loop)  # whatever the budget: one is always due while any wait
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():  # given a connect, then cancelled
                self._pace_turn_left += 1
            else:
                waiter.cancel()
            raise

    def _pace_refill_soon(self, loop: asyncio.AbstractEventLoop) -> None:
        if not self._pace_refill_due:
            self._pace_refill_due = True
            loop.call_soon(self._pace_refill)

    def _pace_refill(self) -> None:
        """A new turn of the loop: ``PER_TURN`` more new connections, first to those waiting."""
        self._pace_refill_due = False
        self._pace_turn_left = PER_TURN
        waiters = self._pace_turn_waiters
        while waiters and self._pace_turn_left > 0:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                self._pace_turn_left -= 1
        if waiters:  # still waiting: the next turn lets more go
            self._pace_refill_soon(asyncio.get_running_loop())

    def _pace_wake(self, key: Any, host: _Host) -> None:
        """Wake as many waiters as there are idle connections and room for new ones."""
        if host.waiters:
            idle = len(self._conns.get(key, ()))
            need = len(host.waiters) + host.woken - idle  # room enough to wake them all
            host.wake(max(host.room(self._pace_burst, need=need), 0) + idle - host.woken)

    def _release(self, key: Any, protocol: Any, *, should_close: bool = False) -> None:
        pooled = not (self._closed or self._force_close or should_close or protocol.should_close)
        super()._release(key, protocol, should_close=should_close)
        if not pooled:
            # Closed before its first response: a request cancelled half-way (a `break` out of
            # the training loop, a hedge's loser). It holds no place in the server's accept
            # queue now, so its slot is free at once, not after `grace` (a persistent pass
            # after a `break` waited 1 s for its first batch); its host learns nothing from it.
            self._pace_forget(protocol)
        host = self._pace_hosts.get((key.host, key.port))
        if host is not None:
            if pooled:
                host.kept_alive(protocol)
            self._pace_wake(key, host)  # a kept-alive connection may be back in the pool

    def _pace_release(self, proto: Any, answered: bool) -> None:
        found = self._pace_forget(proto)
        if found is None:
            return
        host, key, started = found
        if answered:
            host.prove(proto)
            latency: float | None = asyncio.get_running_loop().time() - started
        else:
            latency = None
        host.answered(latency, self._pace_burst)
        self._pace_wake(key, host)

    def _pace_forget(self, proto: Any) -> tuple[_Host, Any, float] | None:
        """Stop counting unproven *proto* against its host: its host, connection key and when
        its connect started (``None`` if it held no slot)."""
        found = self._pace_host_of.pop(proto, None)
        if found is None:
            return None
        host, key = found
        grace, started = host.unproven.pop(proto)
        grace.cancel()
        return host, key, started

    def settle(self, response: aiohttp.ClientResponse) -> None:
        """The server answered *response*: its connection stops holding a slot."""
        if self._pace_host_of:
            proto = getattr(response, "_protocol", None)
            if proto is None and response.connection is not None:
                proto = response.connection.protocol
            if proto is not None:
                self._pace_release(proto, True)
