"""Ready-made datasets over remote objects."""

from __future__ import annotations

from ._remote_files import RemoteFiles

__all__ = ["RemoteFiles"]
