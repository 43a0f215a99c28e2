"""How a shard ended: the warnings and counts for shards that look incomplete.

A shard cut short exactly at a member boundary parses cleanly (tar has no length field for the
whole archive), and an empty object is a valid empty stream: without a word here both would
just yield fewer samples. Two signs are left, and each gives an ``AsyncloadWarning`` and
a count: no sample at all, and no end-of-archive block (every tar writer writes one). A shard
cut inside a member or a header raises ``ArchiveError`` in the parser instead, and a
gzip-compressed one is checked against its gzip trailer. Shards whose server sends a
``Content-Length`` are checked against it by the storage layer too.
"""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass

from .._exceptions import AsyncloadWarning
from .._stats.recorder import note_count
from ._tarstream import Ending

__all__ = ["ShardStats", "note_ending"]


@dataclass(frozen=True, slots=True)
class ShardStats:
    """What the shards streamed in this process looked like (see ``TarShards.shard_stats``).

    Examples:
        >>> ShardStats(shards=8, empty=0, unterminated=1).suspect
        1
    """

    shards: int = 0
    """Shards read to their end."""
    empty: int = 0
    """Shards that held no sample (an [`AsyncloadWarning`][asyncload.AsyncloadWarning] each)."""
    unterminated: int = 0
    """Shards with samples that ended without tar's end-of-archive block, as a shard cut short
    at a member boundary does (an [`AsyncloadWarning`][asyncload.AsyncloadWarning] each)."""

    @property
    def suspect(self) -> int:
        """Shards that were warned about."""
        return self.empty + self.unterminated


def note_ending(counts: Counter[str], shown: str, samples: int, ending: Ending) -> None:
    """Count a shard read to its end in *counts*; warn if it looks incomplete.

    *shown* is the shard's redacted URL, *samples* how many samples it gave.
    """

    counts["shards"] += 1
    if samples == 0:
        counts["empty"] += 1
        note_count("shards_empty")  # this pass's loader.stats()
        if ending.size == 0:
            what = "is empty (0 bytes)"
        elif ending.marker:
            what = "holds no sample, only tar's end-of-archive block"
        else:
            what = f"holds no sample in its {ending.size} bytes"
        warnings.warn(
            f"TarShards: shard {shown} {what}; is the URL right and the upload complete?",
            AsyncloadWarning,
            stacklevel=2,
        )
    elif not ending.marker:
        counts["unterminated"] += 1
        note_count("shards_unterminated")
        warnings.warn(
            f"TarShards: shard {shown} ended after {ending.size} bytes without tar's "
            f"end-of-archive block: it was probably cut short, and the samples after its "
            f"{samples} were lost; re-upload it (or write it with a tar writer)",
            AsyncloadWarning,
            stacklevel=2,
        )
