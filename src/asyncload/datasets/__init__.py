"""Ready-made datasets over remote objects."""

from __future__ import annotations

from ._mix import Mix
from ._remote_files import RemoteFiles
from ._shardwriter import write_shards
from ._tar import TarShards

__all__ = ["Mix", "RemoteFiles", "TarShards", "write_shards"]
