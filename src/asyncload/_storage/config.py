"""Per-prefix storage settings: what ``configure`` sets and the storage functions look up.

``options_for`` picks the ``StorageOptions`` of a URL's longest configured prefix. The settings
live in the context's ``StorageState`` (``state.py``), with the pool size and what hosts
proved: ``configure`` in the main process fills the process's, and they reach workers as a
frozen ``StorageConfig`` through ``export_config`` / ``import_config``, which the DataLoader's
worker start-up calls. ``asyncload._storage`` re-exports every public name here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping
from typing import Any

from .backends import base as _base
from .backends.base import DEFAULT_OPTIONS, StorageOptions
from .backends.pacing_memory import PacingMemory
from .state import StorageState, current, pool_size, process_state, serving, set_pool_size

__all__ = [
    "StorageConfig",
    "configure",
    "configure_all",
    "export_config",
    "forget_stale_clients",
    "import_config",
    "learn_pacing",
    "options_for",
    "pacing_snapshot",
    "pool_size",
    "pool_size_here",
    "prewarm",
    "set_pool_size",
]

_OPTION_NAMES = frozenset(f.name for f in dataclasses.fields(StorageOptions))


@dataclasses.dataclass(frozen=True, slots=True)
class StorageConfig:
    """Everything ``configure`` set in one process: what ``export_config`` returns."""

    prefixes: tuple[tuple[str, StorageOptions], ...]
    """``(prefix, options)`` pairs, longest prefix first."""
    pool_size: int
    """Connection-pool size for lazily created clients."""
    pacing: PacingMemory
    """What this process's connections learned of their hosts (``backends.pacing_memory``)."""


# What a storage client reads from the environment when it is built: credentials, endpoints,
# emulators, CA files and proxies (obstore's own variables, and sources._cloud_config's).
_CLIENT_ENV = (
    "AWS_",
    "GOOGLE_",
    "AZURE_",
    "STORAGE_EMULATOR_HOST",
    "SSL_CERT_",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "ALL_PROXY",
    "NO_PROXY",
)
# Configured prefixes whose clients a standby worker builds ahead (each costs 7-17 ms, and a
# pass whose config arrives meanwhile waits for them).
_PREWARM_MAX = 8


def _matches(url: str, prefix: str) -> bool:
    if not url.startswith(prefix):
        return False
    # "s3://bucket" covers "s3://bucket/key" but not "s3://bucket2/key".
    return len(url) == len(prefix) or prefix[-1] in "/:" or url[len(prefix)] in "/?#"


def options_for(url: str) -> StorageOptions:
    """The options of the longest configured prefix of *url* (defaults when none matches).

    A URL with credentials in it (``http://user:pw@host:port/...``) also matches a prefix
    configured without them (``http://host:port``).
    """
    prefixes = current().prefixes
    for prefix, options in prefixes:
        if _matches(url, prefix):
            return options
    if "@" in url and prefixes:
        bare = _without_userinfo(url)
        if bare != url:
            return options_for(bare)
    return DEFAULT_OPTIONS


def _without_userinfo(url: str) -> str:
    start = url.find("://") + 3
    if start < 3:
        return url
    end = len(url)
    for sep in "/?#":
        at = url.find(sep, start)
        if at != -1:
            end = min(end, at)
    at = url.rfind("@", start, end)
    return url if at == -1 else url[:start] + url[at + 1 :]


def configure(prefix: str, options: StorageOptions | None = None, /, **kwargs: Any) -> None:
    """Set the storage options for every URL under *prefix*; the longest matching prefix wins.

    Options are not inherited between prefixes: a URL gets exactly the options of its longest
    configured prefix (or the defaults). Configuring the same prefix again replaces its options.
    Call this in the main process before iterating a DataLoader; workers receive a copy.

    Args:
        prefix: A URL prefix such as ``"s3://bucket"``, ``"s3://bucket/train/"``,
            ``"https://data.example.com"`` or ``"s3://"`` (every bucket).
        options: A ready [`StorageOptions`][asyncload.StorageOptions]; keyword arguments
            override its fields.
        **kwargs: [`StorageOptions`][asyncload.StorageOptions] fields (``endpoint``,
            ``region``, ``credentials``, ``headers``, ``connect_timeout``, ``read_timeout``,
            ``retry``, ...).

    Examples:
        >>> import asyncload
        >>> asyncload.configure(
        ...     "s3://my-bucket", endpoint="http://127.0.0.1:9000", region="us-east-1",
        ...     retry=asyncload.Retry(attempts=8),
        ... )
    """
    unknown = sorted(set(kwargs) - _OPTION_NAMES)
    if unknown:
        raise TypeError(
            f"unknown storage option(s) {', '.join(unknown)}; "
            f"valid: {', '.join(sorted(_OPTION_NAMES))}"
        )
    if options is None:
        options = StorageOptions(**kwargs)
    elif kwargs:
        options = dataclasses.replace(options, **kwargs)
    if not isinstance(prefix, str) or not prefix:
        raise ValueError(f"configure() needs a non-empty URL prefix, got {prefix!r}")
    # A misspelt backend key (credentials=/extra=) fails here, not at the first read in a worker.
    check = getattr(_base._registry.get(_base.split_scheme(prefix)), "check_options", None)
    if check is not None:
        check(prefix, options)
    prefixes = current().prefixes
    _install([(p, o) for p, o in prefixes if p != prefix] + [(prefix, options)])


def configure_all(storage_options: Mapping[str, StorageOptions | Mapping[str, Any]]) -> None:
    """[`configure`][asyncload.configure] every ``prefix: options`` pair of a mapping.

    The mapping is what datasets take as ``storage_options=``.

    Examples:
        >>> asyncload.configure_all({"s3://bucket": {"region": "eu-west-1"}})  # doctest: +SKIP
    """
    for prefix, options in storage_options.items():
        if isinstance(options, StorageOptions):
            configure(prefix, options)
        else:
            configure(prefix, **dict(options))


def _install(entries: list[tuple[str, StorageOptions]]) -> None:
    wanted = sorted(entries, key=lambda e: len(e[0]), reverse=True)
    prefixes = current().prefixes
    if dict(wanted) == dict(prefixes):
        # The same settings again (a dataset's storage_options, applied at each pass or in
        # each process): keep the clients built for them, their connections and TLS roots.
        return
    prefixes[:] = wanted  # in place: a loop thread's state shares the list
    _clear_clients()


def _clear_clients() -> None:
    # obstore stores bake credentials and endpoints in at construction: rebuild on next use.
    for backend in set(_base._registry.values()):
        clear = getattr(backend, "clear", None)
        if clear is not None:
            clear()


def export_config() -> StorageConfig:
    """A picklable snapshot of this context's storage settings, for worker start-up."""
    state = current()
    return StorageConfig(
        prefixes=tuple(state.prefixes),
        pool_size=state.pool_size,
        pacing=state.hosts.snapshot(),
    )


def import_config(
    snapshot: object, *, pool_size: int | None = None, sharers: int | None = None
) -> None:
    """Install a snapshot from ``export_config`` (in a worker process), replacing any, with
    *pool_size* connections per host (default: the snapshot's), in one of *sharers* processes
    that read the same hosts (a loader's workers; they share the first burst of connections).

    Installing the prefixes and pool size this process has already keeps its clients: those
    a standby worker built for them (``prewarm``) serve the pass.
    """
    if not isinstance(snapshot, StorageConfig):
        raise TypeError(f"expected a StorageConfig from export_config(), got {type(snapshot)!r}")
    pool = snapshot.pool_size if pool_size is None else pool_size
    state = process_state()
    state.hosts.trust(snapshot.pacing)
    if sharers is not None:
        state.hosts.share(sharers)
    if pool != state.pool_size:
        state.pool_size = pool
        _clear_clients()  # their pools were sized for the old one
    _install(list(snapshot.prefixes))


def prewarm(snapshot: StorageConfig, pool_size: int) -> None:
    """Install *snapshot* and build the clients of its prefixes now, ahead of the pass that
    needs them (a standby worker, before its config arrives; see ``_workers._standby``).

    An obstore client takes 7-17 ms to build (its TLS roots are loaded each time), on the
    worker's event loop, in front of every request of a pass's first round trip. It reads
    credentials and endpoints from the environment too: ``forget_stale_clients`` drops what
    was built here if the pass's environment turns out to set them otherwise.
    """
    import_config(snapshot, pool_size=pool_size)
    state = process_state()
    state.built_under = _client_environ()
    for prefix, options in state.prefixes[:_PREWARM_MAX]:
        try:
            warm = getattr(_base.backend_for(prefix), "prewarm", None)
            if warm is not None:
                warm(prefix, options)
        except Exception:  # e.g. "s3://" names no bucket: the pass builds it, or says why
            continue


def forget_stale_clients() -> None:
    """Drop the clients ``prewarm`` built if the variables they read have changed since (in
    the pass's environment, installed when its config came, or by a ``worker_init_fn``):
    they are rebuilt on first use, with what the environment says now."""
    state = process_state()
    if state.built_under is not None and state.built_under != _client_environ():
        _clear_clients()
    state.built_under = None


def _client_environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.upper().startswith(_CLIENT_ENV)}


def pacing_snapshot() -> PacingMemory:
    """What this process learned of its hosts' connections, to send to the main process."""
    return process_state().hosts.snapshot()


def learn_pacing(memory: PacingMemory) -> None:
    """Take what a worker learned of its hosts (its ``pacing_snapshot``), so the next pass's
    workers start with it (see ``backends.pacing_memory``)."""
    process_state().hosts.trust(memory)


@contextlib.contextmanager
def pool_size_here(n: int) -> Iterator[None]:
    """Storage calls of this thread, and of the tasks and loops it starts, build clients with
    pools of *n* connections: a state of their own that shares the process's knowledge (a
    loader's loop thread, ``num_workers=0``). The process's pool size is left as it is."""
    with serving(StorageState(pool_size=n, shared=process_state())):
        yield
