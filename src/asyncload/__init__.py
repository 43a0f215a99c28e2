"""asyncload: PyTorch's DataLoader with an event loop in every worker.

Each worker process fetches many samples at once from HTTP, S3/GCS/Azure or files, so I/O-bound
datasets run at the speed of the storage, not of one request at a time.

Examples:
    >>> import asyncload
    >>> class Blobs(asyncload.Dataset):
    ...     def __init__(self, urls):
    ...         self.urls = urls
    ...     def __len__(self):
    ...         return len(self.urls)
    ...     async def __getitem__(self, i):
    ...         return await asyncload.read(self.urls[i])
    >>> loader = asyncload.DataLoader(Blobs(urls), batch_size=32, num_workers=2)  # doctest: +SKIP
"""

from __future__ import annotations

from ._checkpoint.elastic_iter import ElasticIterable, merge_state_dicts
from ._dataset.base import Dataset, IterableDataset
from ._dataset.cpu import cpu
from ._dataset.sharding import WorkerInfo, get_worker_info, shard
from ._exceptions import (
    ArchiveError,
    AsyncloadWarning,
    BatchTimeout,
    BlockedLoopWarning,
    ConnectError,
    IncompleteRead,
    InvalidURL,
    LoadError,
    NotFound,
    NotPicklable,
    ObjectChanged,
    PermissionDenied,
    RedirectError,
    RequestTimeout,
    SampleErrorBudgetExceeded,
    ServerError,
    StorageError,
    StuckSampleWarning,
    Timeout,
    WorkerError,
)
from ._loader.loader import DataLoader
from ._redact import redact_url
from ._stats.loader_stats import LoaderStats
from ._storage.api import (
    ObjectInfo,
    StorageOptions,
    aclose,
    configure,
    configure_all,
    list_files,
    list_files_async,
    read,
    read_sync,
    stat,
    stream,
)
from ._storage.cache import CacheCounts
from ._storage.cache import counts as cache_counts
from ._storage.cache_reads import CacheWarning
from ._storage.hedge import HedgeCounts
from ._storage.hedge import counts as hedge_counts
from ._storage.retry import Hedge, Retry
from .datasets import Mix, RemoteFiles, ShardStats, ShardSummary, TarShards, write_shards

__version__ = "0.1.0"

__all__ = [
    "ArchiveError",
    "AsyncloadWarning",
    "BatchTimeout",
    "BlockedLoopWarning",
    "CacheCounts",
    "CacheWarning",
    "ConnectError",
    "DataLoader",
    "Dataset",
    "ElasticIterable",
    "Hedge",
    "HedgeCounts",
    "IncompleteRead",
    "InvalidURL",
    "IterableDataset",
    "LoadError",
    "LoaderStats",
    "Mix",
    "NotFound",
    "NotPicklable",
    "ObjectChanged",
    "ObjectInfo",
    "PermissionDenied",
    "RedirectError",
    "RemoteFiles",
    "RequestTimeout",
    "Retry",
    "SampleErrorBudgetExceeded",
    "ServerError",
    "ShardStats",
    "ShardSummary",
    "StorageError",
    "StorageOptions",
    "StuckSampleWarning",
    "TarShards",
    "Timeout",
    "WorkerError",
    "WorkerInfo",
    "aclose",
    "cache_counts",
    "configure",
    "configure_all",
    "cpu",
    "get_worker_info",
    "hedge_counts",
    "list_files",
    "list_files_async",
    "merge_state_dicts",
    "read",
    "read_sync",
    "redact_url",
    "shard",
    "stat",
    "stream",
    "write_shards",
]
