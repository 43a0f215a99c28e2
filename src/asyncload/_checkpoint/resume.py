"""Mid-epoch checkpoints: which batches reached the training loop, and how to continue.

A pass is a pure function of the sampler's randomness (or, for iterable datasets, of each
worker's seed and position), so a checkpoint only has to record *where* the training loop is:

* map-style: the RNG state the pass's sampler started from, and which batch ordinals were
  yielded: a watermark below which all were, plus the few above it (``in_order=False``);
* iterable: how many batches each worker has yielded; a resumed worker skips that many samples.
  For a dataset that tags its items (``_checkpoint.elastic_iter``), also which samples of which unit
  (shard) were delivered, so that another number of readers can take over the rest.

Batches fetched but not yet yielded are not recorded, so they are fetched again after a restore:
nothing is lost and nothing is repeated.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from .elastic_iter import Delivered, Tag

__all__ = ["NO_PASS", "Progress", "ResumePoint", "capture_rng", "restore_rng"]

NO_PASS = -1
"""The ``base_seed`` of a checkpoint saved with no pass to record (none yet, or a non-persistent
one that ended): the next pass draws its own. Drawn seeds are never negative."""

_VERSION = 1


def capture_rng(generator: torch.Generator | None) -> torch.Tensor:
    """The state a pass's sampler and seeds are drawn from."""
    return generator.get_state() if generator is not None else torch.get_rng_state()


def restore_rng(generator: torch.Generator | None, state: torch.Tensor) -> None:
    if generator is not None:
        generator.set_state(state)
    else:
        torch.set_rng_state(state)


@dataclass
class Progress:
    """What one pass has handed to the training loop so far."""

    num_workers: int
    watermark: int = 0
    """Every batch ordinal below this was yielded (or produced nothing)."""
    extra: set[int] = field(default_factory=set)
    """Ordinals at or above the watermark that were yielded (out of order)."""
    worker_batches: list[int] = field(default_factory=list)
    """Per worker, batches yielded (iterable datasets)."""
    delivered: Delivered = field(default_factory=Delivered)
    """Per unit, the samples yielded (iterable datasets that tag their items)."""

    def __post_init__(self) -> None:
        if not self.worker_batches:
            self.worker_batches = [0] * self.num_workers

    def mark(self, ordinal: int, worker_id: int | None, tags: Iterable[Tag] = ()) -> None:
        self.delivered.note(tags)
        if worker_id is not None:
            self.worker_batches[worker_id] += 1
        if ordinal == self.watermark:
            self.watermark += 1
            while self.watermark in self.extra:
                self.extra.discard(self.watermark)
                self.watermark += 1
        else:
            self.extra.add(ordinal)

    def is_done(self, ordinal: int) -> bool:
        return ordinal < self.watermark or ordinal in self.extra


@dataclass(frozen=True)
class ResumePoint:
    """A validated checkpoint, as returned by ``DataLoader.state_dict()``."""

    iterable: bool
    num_workers: int
    epoch: int | None
    rng: torch.Tensor
    base_seed: int
    progress: Progress
    finished: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "asyncload_version": _VERSION,
            "iterable": self.iterable,
            "num_workers": self.num_workers,
            "epoch": self.epoch,
            "rng": self.rng.clone(),
            "base_seed": self.base_seed,
            "watermark": self.progress.watermark,
            "extra": sorted(self.progress.extra),
            "worker_batches": list(self.progress.worker_batches),
            "delivered": self.progress.delivered.to_plain(),
            "finished": self.finished,
        }

    @classmethod
    def from_dict(
        cls, state: dict[str, Any], *, iterable: bool, num_workers: int, elastic: bool = False
    ) -> ResumePoint:
        """*elastic*: the dataset can be re-dealt (``_checkpoint.elastic_iter``), so another
        ``num_workers`` is fine."""
        if not isinstance(state, dict) or state.get("asyncload_version") != _VERSION:
            raise ValueError(
                "not an asyncload DataLoader state_dict (or from an incompatible version)"
            )
        if state["iterable"] != iterable:
            kind = "an iterable" if state["iterable"] else "a map-style"
            raise ValueError(f"this state_dict was saved from a loader over {kind} dataset")
        if iterable and not elastic and state["num_workers"] != num_workers:
            raise ValueError(
                f"this state_dict was saved with num_workers={state['num_workers']}; this "
                "iterable dataset resumes per worker, each skipping the samples it had "
                "delivered, and cannot be re-dealt to another number of workers, so build the "
                f"loader with the same num_workers (got {num_workers}). TarShards can be "
                "re-dealt (not with samples_per_rank=), and so can a Mix of map-style datasets and "
                "TarShards (not with samples=); a dataset of your own can by implementing "
                "asyncload.ElasticIterable (elastic_key, elastic_units, "
                "elastic_iter)"
            )
        n = max(1, num_workers)
        progress = Progress(
            n,
            watermark=int(state["watermark"]),
            extra={int(i) for i in state["extra"]},
            worker_batches=[int(b) for b in state["worker_batches"]][:n] or [0] * n,
            delivered=Delivered.from_plain(state.get("delivered")),
        )
        return cls(
            iterable=iterable,
            num_workers=num_workers,
            epoch=state["epoch"],
            rng=state["rng"],
            base_seed=int(state["base_seed"]),
            progress=progress,
            finished=bool(state["finished"]),
        )
