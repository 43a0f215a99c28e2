"""What the storage layer of one process knows and keeps, as one object: ``StorageState``.

Every storage call (``read``, ``stream``, ``stat``, ``list_files``, whoever makes it) looks its
URL up in the state of its context: the configured prefixes and their options, the connection
pool size for new clients, what hosts proved of their connections (``HostMemory``), whether the
clients a standby worker built still match the environment, the hedge trackers per prefix and
the caches per directory. The state is a value a context owns, not module globals that other
layers write:

* a process has one (``process_state``): the main process's is filled by ``configure``, a
  worker's by ``import_config`` from the loader's ``StorageConfig``;
* a loader that runs its engine on a loop thread of this process (``num_workers=0``) serves it
  under a state of its own (``serving``), which shares the process's knowledge but sizes its
  clients for its own requests in flight.

The clients themselves stay with their backends (one per event loop, or per bucket and
options), since an open connection pool is a resource of the loop, not knowledge.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .backends.pacing_memory import HostMemory

if TYPE_CHECKING:
    from .backends.base import StorageOptions

__all__ = [
    "StorageState",
    "current",
    "hedge_pool_size",
    "pool_size",
    "process_state",
    "serving",
    "set_pool_size",
]

DEFAULT_POOL_SIZE = 64


class StorageState:
    """The storage layer's knowledge and settings for one context (see module doc).

    Args:
        pool_size: Connections a client built in this context may keep (all hosts together).
        shared: A state whose knowledge this one shares (its prefixes, hosts, hedge trackers
            and caches), with only the pool size its own.

    Examples:
        >>> state = StorageState(pool_size=16)
        >>> state.pool_size, state.prefixes
        (16, [])
        >>> StorageState(pool_size=256, shared=state).hosts is state.hosts
        True
    """

    __slots__ = ("built_under", "caches", "hedges", "hosts", "pool_size", "prefixes")

    def __init__(
        self, *, pool_size: int = DEFAULT_POOL_SIZE, shared: StorageState | None = None
    ) -> None:
        if pool_size < 1:
            raise ValueError(f"pool size must be at least 1, got {pool_size}")
        self.pool_size = pool_size
        """Connections a lazily built client may keep (aiohttp's ``limit``)."""
        if shared is None:
            self.prefixes: list[tuple[str, StorageOptions]] = []
            """``(prefix, options)`` pairs, longest prefix first (``configure``)."""
            self.hosts = HostMemory()
            """What hosts proved of their connections, and their caps (``pacing_memory``)."""
            self.built_under: dict[str, str] | None = None
            """The environment a standby worker built its clients under (``prewarm``)."""
            self.hedges: dict[tuple[int, str], Any] = {}
            """Hedge trackers by (options, origin): the latencies and budget of each store."""
            self.caches: dict[tuple[str, int | None], Any] = {}
            """One ``Cache`` per directory and size bound, so concurrent misses share a fetch."""
        else:
            self.prefixes = shared.prefixes
            self.hosts = shared.hosts
            self.built_under = shared.built_under
            self.hedges = shared.hedges
            self.caches = shared.caches

    def forget(self) -> None:
        """Forget the prefixes, hosts, hedge trackers and caches, in place (tests)."""
        self.prefixes.clear()
        self.hosts.forget()
        self.built_under = None
        self.hedges.clear()
        self.caches.clear()


# Per process: asyncload.read(url) may be called from anywhere in the process and holds no
# handle a state could ride in, so a process's state is found here; a worker fills its own from
# the loader's configuration (import_config).
_process = StorageState()
# A loop thread that serves a loader in this process (num_workers=0) reads under its own state.
_serving: contextvars.ContextVar[StorageState | None] = contextvars.ContextVar(
    "asyncload_storage_state", default=None
)


def process_state() -> StorageState:
    """This process's state (the main process's, or a worker's)."""
    return _process


def current() -> StorageState:
    """The state of this context: a loop thread's that serves a loader, else the process's."""
    state = _serving.get()
    return _process if state is None else state


@contextlib.contextmanager
def serving(state: StorageState) -> Iterator[StorageState]:
    """Run the storage calls of this thread, and of the tasks and loops it starts, in *state*."""
    token = _serving.set(state)
    try:
        yield state
    finally:
        _serving.reset(token)


def pool_size() -> int:
    """The connection-pool size new clients are created with, in this context."""
    return current().pool_size


def set_pool_size(n: int) -> None:
    """Connections per client built from now on in this context (a worker: its loader's
    requests in flight)."""
    if n < 1:
        raise ValueError(f"pool size must be at least 1, got {n}")
    current().pool_size = n


def hedge_pool_size() -> int:
    """Connections for hedges (``backends.base.hedging``), all hosts together: room for a
    burst of the 10 hedges a prefix may save up (``hedge.latency._MAX_TOKENS``) and then some."""
    return max(16, pool_size() // 8)
