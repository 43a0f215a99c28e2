"""Which local cache a read goes through, and this process's cache hits and misses.

The cache itself (one directory, read and written through: ``Cache``) is ``cache_reads``'s, its
files ``cache_dir``'s. Here is what is per process: one ``Cache`` per directory, found from a
prefix's ``cache_dir`` or ``ASYNCLOAD_CACHE_DIR``, and the counts summed over them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .cache_reads import Cache
from .state import current

if TYPE_CHECKING:
    from .backends.base import StorageOptions

__all__ = ["ENV_VAR", "CacheCounts", "cache_for", "counts", "reset"]

ENV_VAR = "ASYNCLOAD_CACHE_DIR"


@dataclass(frozen=True, slots=True)
class CacheCounts:
    """Cache hits and misses of this process since it started.

    Returned by [`asyncload.cache_counts`][asyncload.cache_counts].
    """

    hits: int
    """Reads served from the local cache directory."""
    misses: int
    """Reads of a cached prefix that went to the store because the object was not cached."""


# Per process: cache_counts() reports every read of the process, whoever made it (the sum over
# its Cache objects); workers count their own, and a loader sums theirs through its stats.
def counts() -> CacheCounts:
    """Hits and misses of every cache (``cache_dir``) this process has used since it started.

    For reads made in this process; worker processes count their own, and a loader's pass
    reports the sum over its workers as ``loader.stats().cache_hits`` and ``.cache_misses``.

    Examples:
        >>> import asyncload
        >>> c = asyncload.cache_counts()
        >>> c.hits + c.misses >= 0
        True
    """
    caches = current().caches.values()
    return CacheCounts(hits=sum(c.hits for c in caches), misses=sum(c.misses for c in caches))


def cache_for(url: str, options: StorageOptions) -> Cache | None:
    """The cache *url* is read through, or ``None`` (no cache configured, local file, off)."""
    root = options.cache_dir or os.environ.get(ENV_VAR)
    if not root or "://" not in url or url.startswith(("file:", "FILE:")):
        return None
    # One Cache per directory in the context's storage state, so concurrent misses of an object
    # share one fetch (``_inflight``), and a directory that fails is turned off with one warning.
    caches: dict[tuple[str, int | None], Cache] = current().caches
    key = (root, options.cache_max_bytes)
    cache = caches.get(key)
    if cache is None:
        cache = caches[key] = Cache(root, options.cache_max_bytes)
    return None if cache.off else cache


def reset() -> None:
    """Forget every cache object and zero the counters (tests)."""
    current().caches.clear()
