"""Ready-made datasets over remote objects."""

from __future__ import annotations

from ._mix import Mix
from ._remote_files import RemoteFiles
from ._shardcheck import ShardStats
from ._shardwriter import ShardSummary, write_shards
from ._tar import TarShards

__all__ = ["Mix", "RemoteFiles", "ShardStats", "ShardSummary", "TarShards", "write_shards"]
