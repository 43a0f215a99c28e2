"""What this process has learned of the hosts it reads, for pacing their new connections.

Slow start costs round trips: at 50 ms per request a pool of 128 takes ~5 of them to fill, and
every pass of a loader starts new worker processes with empty pools. So a process remembers how
many kept-alive connections each host has held at once (``learned``). A worker's knowledge
travels to the main process as a ``PacingMemory`` value beside its batches (never inside its
stats: counters are for people, this is control data), the main process hands what its workers
learned to the next pass's workers (``trust``, through the storage configuration), and
a host that has proven it takes *n* connections starts with ``min(n, TRUSTED_BURST)`` of them in
flight instead of ``burst`` (``pacing.TRUSTED_BURST``).

A host whose accept queue overflowed has its new connections in flight capped (``caps``; see
``pacing``), in this pass and in the next ones, the same way. Every connector of the process
(``pacing.PacedConnector``) starts from this knowledge, a hedge session's too, and from the
share of ``BURST`` that this process, one of a loader's workers, gets (``share``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

__all__ = ["BURST", "MIN_BURST", "HostMemory", "PacingMemory"]

# New connections per host that may await their first response at once, for all the processes
# of a loader together: each of its n workers gets BURST // n (``share``), MIN_BURST at least.
# Python's http.server queues 6 connections and accepts slowly when busy; what overflows anyway
# is caught by the cap (``pacing.SYN_RETRY``), but each dropped SYN waits 1 s, then 3 s, then
# 7 s, so a bigger first burst is not worth its speed: at 16 (a 2-worker whole run 0.82-0.88 of
# the raw loop instead of 0.74-0.79), a server that accepts 20 connections a second took 31 s to
# answer 64 requests instead of 1.6 s. (4 per process before: the same 8 with 2 workers, 32 with 8.)
BURST = 8
MIN_BURST = 2
_MAX_HOSTS = 1024


@dataclasses.dataclass(frozen=True, slots=True)
class PacingMemory:
    """What one process knows of its hosts, as a value: it goes to workers in their storage
    configuration and comes back from them beside their batches (``snapshot``, ``trust``)."""

    connections: tuple[tuple[str, int], ...] = ()
    """Kept-alive connections per ``host:port`` that hosts proved to hold at once."""
    burst_caps: tuple[tuple[str, int], ...] = ()
    """New connections in flight per ``host:port``, at most, for hosts whose accept queue
    overflowed."""


class HostMemory:
    """What one storage context learned of its hosts' connections (see module doc).

    Every connector of the context (a hedge session's too) starts a host from it: the most
    kept-alive connections any of them saw the host hold, the smallest cap any set for it after
    an overflow (the host's accept queue is one), and this process's share of ``BURST``.

    Examples:
        >>> hosts = HostMemory()
        >>> hosts.remember_proven("example.com:443", 40)
        >>> hosts.proven("example.com:443"), hosts.cap("example.com:443")
        (40, None)
        >>> hosts.snapshot()
        PacingMemory(connections=(('example.com:443', 40),), burst_caps=())
    """

    __slots__ = ("_caps", "_learned", "_sharers")

    def __init__(self) -> None:
        self._learned: dict[str, int] = {}  # host:port -> most kept-alive connections at once
        self._caps: dict[str, int] = {}  # host:port -> most new connections in flight
        # The processes reading the same hosts that this one shares BURST with (a loader's
        # workers): connectors are built lazily, later, with no loader to ask.
        self._sharers = 1

    def share(self, n: int) -> None:
        """This process is one of *n* (a loader's workers) that read the same hosts: connectors
        made from now on start new hosts with its share of ``BURST``."""
        self._sharers = max(1, n)

    def first_burst(self) -> int:
        """New connections a new host may have awaiting their first response at once, in this
        process (its share of ``BURST``)."""
        return max(MIN_BURST, BURST // self._sharers)

    def learned(self) -> dict[str, int]:
        """Connections per ``host:port`` that hosts have proven to take."""
        return dict(self._learned)

    def caps(self) -> dict[str, int]:
        """New connections in flight per ``host:port``, at most, for hosts whose accept queue
        overflowed."""
        return dict(self._caps)

    def snapshot(self) -> PacingMemory:
        """This knowledge, as a value to send to another process."""
        return PacingMemory(tuple(self._learned.items()), tuple(self._caps.items()))

    def trust(self, memory: PacingMemory) -> None:
        """Add what another process learned (its ``snapshot``): new connectors start a host
        from the most connections any process saw it hold, and the smallest cap any set."""
        for key, n in memory.connections:
            _remember(self._learned, key, n, max)
        for key, n in memory.burst_caps:
            _remember(self._caps, key, n, min)

    def forget(self) -> None:
        """Forget every host's proven connections and caps, and the processes sharing."""
        self._learned.clear()
        self._caps.clear()
        self._sharers = 1

    def proven(self, key: str) -> int:
        """Connections that ``host:port`` *key* has proven to take (0: none yet)."""
        return self._learned.get(key, 0)

    def cap(self, key: str) -> int | None:
        """New connections in flight that *key* may have at once, if its accept queue
        overflowed."""
        return self._caps.get(key)

    def remember_proven(self, key: str, n: int) -> None:
        """*key* held *n* kept-alive connections at once: remember it, if more than before."""
        _remember(self._learned, key, n, max)

    def remember_cap(self, key: str, n: int) -> None:
        """*key* overflowed: cap its new connections in flight at *n*, if fewer than before."""
        _remember(self._caps, key, n, min)


def _remember(known: dict[str, int], key: str, n: int, keep: Callable[[int, int], int]) -> None:
    """Keep *n* for *key* if *keep* (max, min) prefers it to what *known* has."""
    if n <= 0:
        return
    old = known.get(key)
    if old is None or keep(n, old) != old:
        if len(known) >= _MAX_HOSTS and old is None:
            known.clear()
        known[key] = n
