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

__all__ = [
    "BURST",
    "MIN_BURST",
    "PacingMemory",
    "cap",
    "caps",
    "first_burst",
    "forget",
    "learned",
    "proven",
    "remember_cap",
    "remember_proven",
    "share",
    "snapshot",
    "trust",
]

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


# host:port -> the most kept-alive connections it held at once for one process. Per process:
# every connector of the process starts from what any of them proved, and export_config sends
# it to the next pass's workers.
_learned: dict[str, int] = {}
# host:port -> the most new connections it may have in flight at once, after an overflow.
# Per process: the host's accept queue is one, so an overflow seen by any connector (a hedge
# session's too) caps them all.
_caps: dict[str, int] = {}
# The processes reading the same hosts that this one shares BURST with (a loader's workers).
# Per process: import_config sets it when the worker starts, and the connectors the backends
# build later, lazily, have no loader to ask.
_sharers = 1


def share(n: int) -> None:
    """This process is one of *n* (a loader's workers) that read the same hosts: connectors
    made from now on start new hosts with its share of ``BURST``."""
    global _sharers
    _sharers = max(1, n)


def first_burst() -> int:
    """New connections a new host may have awaiting their first response at once, in this
    process (its share of ``BURST``)."""
    return max(MIN_BURST, BURST // _sharers)


def learned() -> dict[str, int]:
    """Connections per ``host:port`` that hosts have proven to take (this process's knowledge)."""
    return dict(_learned)


def caps() -> dict[str, int]:
    """New connections in flight per ``host:port``, at most, for hosts whose accept queue
    overflowed (this process's knowledge)."""
    return dict(_caps)


def snapshot() -> PacingMemory:
    """This process's knowledge, as a value to send to another process."""
    return PacingMemory(tuple(_learned.items()), tuple(_caps.items()))


def trust(memory: PacingMemory) -> None:
    """Add what another process learned (its ``snapshot``): new connectors start a host from
    the most connections any process saw it hold, and the smallest cap any set for it."""
    for key, n in memory.connections:
        _remember(_learned, key, n, max)
    for key, n in memory.burst_caps:
        _remember(_caps, key, n, min)


def forget() -> None:
    """Forget every host's proven connections and caps, and the processes sharing (tests)."""
    global _sharers
    _learned.clear()
    _caps.clear()
    _sharers = 1


def _remember(known: dict[str, int], key: str, n: int, keep: Callable[[int, int], int]) -> None:
    """Keep *n* for *key* if *keep* (max, min) prefers it to what *known* has."""
    if n <= 0:
        return
    old = known.get(key)
    if old is None or keep(n, old) != old:
        if len(known) >= _MAX_HOSTS and old is None:
            known.clear()
        known[key] = n


def proven(key: str) -> int:
    """Connections that ``host:port`` *key* has proven to take (0: none yet)."""
    return _learned.get(key, 0)


def cap(key: str) -> int | None:
    """New connections in flight that *key* may have at once, if its accept queue overflowed."""
    return _caps.get(key)


def remember_proven(key: str, n: int) -> None:
    """*key* held *n* kept-alive connections at once: remember it, if more than before."""
    _remember(_learned, key, n, max)


def remember_cap(key: str, n: int) -> None:
    """*key* overflowed: cap its new connections in flight at *n*, if fewer than before."""
    _remember(_caps, key, n, min)
