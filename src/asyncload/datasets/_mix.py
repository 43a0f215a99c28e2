"""``Mix``: weighted sampling from several datasets, deterministic, sharded and resumable.

Every reader (worker ``w`` of rank ``r``) runs the same small state machine::

    seeded choice (seed, epoch, reader) ──► next item of the chosen source ──► yield
              ▲                                   │ exhausted
              └──── drop it ("all") / restart it (samples=N) / stop ("first")

The choice sequence depends only on ``(seed, epoch, reader, readers)`` and on when sources run
out, never on network timing, so a pass can be replayed exactly. Resuming after ``skip`` samples
replays the choices without fetching: map-style sources only advance an index, iterable sources
resume through their own ``aiter_from`` where the mode allows it (see ``Mix.aiter_from``).
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Sequence
from contextlib import suppress
from typing import Any, Literal

import numpy as np
import torch.utils.data

from .._dataset import IterableDataset, aiter_for, fetcher_for
from .._metrics import note_count
from .._sharding import shard_position

__all__ = ["Mix"]

Stop = Literal["first", "all"]
_END = object()


def _is_map_style(ds: Any) -> bool:
    return not isinstance(ds, torch.utils.data.IterableDataset) and hasattr(ds, "__getitem__")


class _MapSource:
    """A map-style source: this reader's slice of a seeded permutation, one cycle at a time."""

    def __init__(self, ds: Any, key: tuple[int, ...], reader: int, readers: int) -> None:
        self._ds, self._key, self._reader, self._readers = ds, key, reader, readers
        self._fetch = fetcher_for(ds)
        self._cycle = -1
        self._order: np.ndarray[Any, Any] = np.empty(0, dtype=np.int64)
        self._pos = 0
        self.restart()

    def restart(self) -> bool:
        self._cycle += 1
        n = len(self._ds)
        perm = np.random.default_rng((*self._key, self._cycle)).permutation(n)
        self._order, self._pos = perm[self._reader :: self._readers], 0
        return len(self._order) > 0

    async def take(self, *, fetch: bool) -> Any:
        if self._pos >= len(self._order):
            return _END
        index = int(self._order[self._pos])
        self._pos += 1
        # An awaitable: the worker fetches many of these concurrently and keeps their order.
        return self._fetch(index) if fetch else None

    async def aclose(self) -> None:
        return None


class _IterSource:
    """An iterable source; it shards itself (``asyncload.shard``, ``TarShards``)."""

    def __init__(self, ds: Any, deferred_skip: int) -> None:
        self._ds = ds
        self._it: AsyncIterator[Any] | None = None
        self._deferred = deferred_skip
        self._started = False

    def _open(self) -> AsyncIterator[Any]:
        skip, self._deferred = self._deferred, 0
        aiter_from = getattr(self._ds, "aiter_from", None)
        if skip and callable(aiter_from):
            return aiter_from(skip)  # type: ignore[no-any-return]
        self._deferred = skip  # no cheaper way: skipped by discarding in take()
        return aiter_for(self._ds)

    def defer(self) -> None:
        """Count one skipped sample, taken when the source is first read."""
        self._deferred += 1

    def restart(self) -> bool:
        self._it, self._started = None, False
        return True

    async def take(self, *, fetch: bool) -> Any:
        if self._it is None:
            self._it, self._started = self._open(), True
        while True:
            try:
                item = await anext(self._it)
            except StopAsyncIteration:
                return _END
            if fetch and not self._deferred:
                return item
            if self._deferred:
                self._deferred -= 1
            if inspect.iscoroutine(item):
                item.close()  # skipped: never fetched
            if not fetch:
                return None

    async def aclose(self) -> None:
        close = getattr(self._it, "aclose", None)
        if close is not None:
            with suppress(Exception):
                await close()


class Mix(IterableDataset[Any]):
    """Draw from several datasets with given weights, the same way for the same seed and epoch.

    Each sample comes from dataset ``i`` with probability ``weights[i] / sum(weights)`` among the
    datasets still drawing. Map-style datasets are permuted every epoch (seeded) and split across
    every worker of every rank; iterable datasets are read as they are and must shard themselves
    (``asyncload.shard``, ``TarShards`` do), as anywhere else.

    When a dataset runs out:

    * ``stop="first"`` (default): the pass ends (no dataset is over-represented);
    * ``stop="all"``: it stops drawing and the others share its weight, until all are done;
    * ``samples=N``: the pass is exactly ``N`` samples over all ranks and workers, and a dataset
      that runs out starts again (a new permutation for map-style ones), so a small dataset can be
      up-sampled.

    ``loader.state_dict()`` resumes a ``Mix`` exactly: the choices are replayed, not fetched.

    Args:
        datasets: The datasets to mix: ``asyncload`` or torch datasets, map-style or iterable.
        weights: One non-negative weight per dataset (default: equal).
        seed: Seed of the choices and of map-style permutations.
        stop: ``"first"`` or ``"all"``, see above. Ignored with ``samples``.
        samples: Total samples per pass (epoch), over all ranks and workers.

    Examples:
        >>> import asyncload
        >>> web = asyncload.TarShards("s3://bucket/web-{000..099}.tar")  # doctest: +SKIP
        >>> code = asyncload.TarShards("s3://bucket/code-{000..019}.tar")  # doctest: +SKIP
        >>> mix = asyncload.Mix([web, code], [0.8, 0.2], samples=1_000_000)  # doctest: +SKIP
        >>> loader = asyncload.DataLoader(mix, batch_size=64, num_workers=4)  # doctest: +SKIP
    """

    def __init__(
        self,
        datasets: Sequence[Any],
        weights: Sequence[float] | None = None,
        *,
        seed: int = 0,
        stop: Stop = "first",
        samples: int | None = None,
    ) -> None:
        self.datasets = list(datasets)
        if not self.datasets:
            raise ValueError("Mix needs at least one dataset")
        w = np.ones(len(self.datasets)) if weights is None else np.asarray(weights, dtype=float)
        if w.shape != (len(self.datasets),):
            raise ValueError(
                f"Mix got {len(self.datasets)} datasets but {w.size} weights; give one each"
            )
        if not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
            raise ValueError(f"Mix weights must be finite, >= 0 and not all 0: {list(w)}")
        if stop not in ("first", "all"):
            raise ValueError(f"stop must be 'first' or 'all', got {stop!r}")
        if samples is not None and samples < 0:
            raise ValueError(f"samples must be >= 0, got {samples}")
        self.weights = w / w.sum()
        self.seed, self.stop, self.samples = int(seed), stop, samples
        self.epoch = 0

    def __len__(self) -> int:
        if self.samples is None:
            raise TypeError("len() of a Mix is known only with samples=N")
        return self.samples

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's choices and permutations; passed on to the datasets inside."""
        self.epoch = int(epoch)
        for ds in self.datasets:
            fn = getattr(ds, "set_epoch", None)
            if callable(fn):
                fn(epoch)

    def expected_proportions(self) -> list[float]:
        """The weights, normalised: the proportions a long pass approaches."""
        return [float(x) for x in self.weights]

    def __aiter__(self) -> AsyncIterator[Any]:
        return self.aiter_from(0)

    async def aiter_from(self, skip: int) -> AsyncIterator[Any]:
        """Iterate this reader's share from its sample *skip* on (the loader's resume hook).

        The first *skip* choices are replayed without fetching. An iterable dataset inside is
        then resumed through its own ``aiter_from`` when it has one (``TarShards`` does) and the
        mode is ``stop="first"``; otherwise its skipped samples are read and dropped (never
        awaited), since whether it ran out during them changes the choices that follow.
        """
        reader, readers = shard_position()
        quota: int | None = None
        if self.samples is not None:
            per, extra = divmod(self.samples, readers)
            quota = per + (reader < extra)
        defer = self.stop == "first" and self.samples is None
        sources: list[_MapSource | _IterSource] = [
            _MapSource(ds, (self.seed, self.epoch, i), reader, readers)
            if _is_map_style(ds)
            else _IterSource(ds, 0)
            for i, ds in enumerate(self.datasets)
        ]
        active = [i for i, w in enumerate(self.weights) if w > 0]
        rng = np.random.default_rng((self.seed, self.epoch, reader, readers))
        drawn = 0
        try:
            while active and (quota is None or drawn < quota):
                p = self.weights[active]
                i = active[int(rng.choice(len(active), p=p / p.sum()))]
                src = sources[i]
                replaying = drawn < skip
                if replaying and defer and isinstance(src, _IterSource):
                    src.defer()
                    drawn += 1
                    continue
                item = await src.take(fetch=not replaying)
                if item is _END:
                    if self.samples is not None:
                        if src.restart():
                            item = await src.take(fetch=not replaying)
                        if item is _END:
                            raise ValueError(
                                f"Mix: dataset {i} ({type(self.datasets[i]).__name__}) has no "
                                "samples for this reader, so samples= can't draw from it"
                            )
                    elif self.stop == "first":
                        return
                    else:
                        active.remove(i)
                        continue
                drawn += 1
                if not replaying:
                    note_count(f"mix:{i}")  # the realised proportions in loader.stats()
                    yield item
        finally:
            for src in sources:
                await src.aclose()
