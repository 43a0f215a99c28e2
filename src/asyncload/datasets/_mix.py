"""``Mix``: weighted sampling from several datasets, deterministic, sharded and resumable.

Every reader (worker ``w`` of rank ``r``) runs the same small state machine::

    seeded choice (seed, epoch, reader) ──► next item of the chosen source ──► yield
              ▲                                   │ exhausted
              └──── drop it ("all") / restart it (samples=N) / stop ("first")

The choice sequence depends only on ``(seed, epoch, reader, readers)`` and on when sources run
out, never on network timing, so a pass can be replayed exactly. Resuming after ``skip`` samples
replays the choices without fetching: map-style sources only advance an index, iterable sources
resume through their own ``aiter_from`` where the mode allows it (see ``Mix.aiter_from``).

Elastic resume (``_checkpoint.elastic_iter``): a ``Mix`` is read in *units*, each tagged with its
source
in the high bits (``source * _SOURCE + unit``): for an iterable source, that source's own units
(``TarShards``' shards); for a map-style one, a reader's slice ``perm[reader::readers]`` of the
epoch's permutation, self-describing (``_SLICE | readers << 24 | reader``), so a later pass with
other readers still knows which indices a unit holds. A re-dealt reader mixes what its plan
holds of each source with the same weights, under choices seeded apart from the ordinary ones.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, Literal

import numpy as np
import torch.utils.data

from .._checkpoint.elastic_iter import Tag, UnitPlan, supports
from .._dataset.base import IterableDataset, aclose_quietly, aiter_for, fetcher_for
from .._dataset.sharding import shard_position
from .._stats.recorder import note_count

__all__ = ["Mix"]

Stop = Literal["first", "all"]
_END = object()
_SOURCE = 1 << 48  # unit = source * _SOURCE + the source's own unit
_SLICE = 1 << 47  # a map-style unit: _SLICE | readers << 24 | reader
_READER_BITS = 24


def _is_map_style(ds: Any) -> bool:
    return not isinstance(ds, torch.utils.data.IterableDataset) and hasattr(ds, "__getitem__")


def _slice_unit(reader: int, readers: int) -> int:
    return _SLICE | readers << _READER_BITS | reader


def _slice(perm: np.ndarray[Any, Any], unit: int) -> np.ndarray[Any, Any]:
    """The indices a map-style slice unit holds: ``perm[reader::readers]``."""
    reader, readers = unit & ((1 << _READER_BITS) - 1), (unit & ~_SLICE) >> _READER_BITS
    return perm[reader::readers]


class _MapSource:
    """A map-style source: slices of a seeded permutation, one cycle at a time.

    *slices* are ``(unit, watermark, extras)`` plans of slice units; an ordinary pass has one,
    the reader's own, with nothing left out.
    """

    def __init__(self, ds: Any, key: tuple[int, ...], base: int, slices: Sequence[UnitPlan]):
        self._ds, self._key, self._base, self._slices = ds, key, base, list(slices)
        self._fetch = fetcher_for(ds)
        self._cycle = -1
        self._items: Iterator[tuple[int, int, int, int]] = iter(())
        self.restart()

    def restart(self) -> bool:
        self._cycle += 1
        perm = np.random.default_rng((*self._key, self._cycle)).permutation(len(self._ds))
        self._items = self._walk(perm)
        return any(len(_slice(perm, unit)) > watermark for unit, watermark, _ in self._slices)

    def _walk(self, perm: np.ndarray[Any, Any]) -> Iterator[tuple[int, int, int, int]]:
        """``(unit, offset, slice size, index)`` of every sample left in the slices."""
        for unit, watermark, extras in self._slices:
            order, delivered = _slice(perm, unit), set(extras)
            for offset in range(watermark, len(order)):
                if offset in delivered:
                    continue
                yield self._base + unit, offset, len(order), int(order[offset])

    async def take(self, *, fetch: bool) -> Any:
        step = next(self._items, None)
        if step is None:
            return _END
        unit, offset, size, index = step
        tag: Tag = (unit, offset, ((unit, size),) if offset == size - 1 else ())
        # An awaitable: the worker fetches many of these concurrently and keeps their order.
        return tag, (self._fetch(index) if fetch else None)

    async def aclose(self) -> None:
        return None


class _IterSource:
    """An iterable source; it shards itself (``asyncload.shard``, ``TarShards``).

    *tagged*: read through ``elastic_iter`` (its ordinary share, or *plan*) and move its tags'
    units to this source's range.
    """

    def __init__(self, ds: Any, base: int, *, tagged: bool, plan: Sequence[UnitPlan] | None):
        self._ds, self._base, self._tagged, self._plan = ds, base, tagged, plan
        self._it: AsyncIterator[Any] | None = None
        self._deferred = 0

    def _open(self) -> AsyncIterator[Any]:
        skip, self._deferred = self._deferred, 0
        if self._tagged:
            return self._ds.elastic_iter(self._plan, skip)  # type: ignore[no-any-return]
        aiter_from = getattr(self._ds, "aiter_from", None)
        if skip and callable(aiter_from):
            return aiter_from(skip)  # type: ignore[no-any-return]
        self._deferred = skip  # no cheaper way: skipped by discarding in take()
        return aiter_for(self._ds)

    def defer(self) -> None:
        """Count one skipped sample, taken when the source is first read."""
        self._deferred += 1

    def restart(self) -> bool:
        self._it = None
        return True

    async def take(self, *, fetch: bool) -> Any:
        if self._it is None:
            self._it = self._open()
        while True:
            try:
                item = await anext(self._it)
            except StopAsyncIteration:
                return _END
            tag: Tag | None = None
            if self._tagged:
                (unit, offset, ended), item = item
                b = self._base
                tag = (b + unit, offset, tuple((b + u, size) for u, size in ended))
            if fetch and not self._deferred:
                return tag, item
            if self._deferred:
                self._deferred -= 1
            if inspect.iscoroutine(item):
                item.close()  # skipped: never fetched
            if not fetch:
                return tag, None

    async def aclose(self) -> None:
        await aclose_quietly(self._it)


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
    When every dataset inside is map-style or elastic (``TarShards``) and ``samples`` is not
    set, it also resumes with another ``num_workers`` or world size: what is left of each
    dataset is re-dealt to the new readers ([Mixing datasets](guides/mixing.md) says what that
    keeps).

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

    def aiter_from(self, skip: int) -> AsyncIterator[Any]:
        """Iterate this reader's share from its sample *skip* on (the loader's resume hook).

        The first *skip* choices are replayed without fetching. An iterable dataset inside is
        then resumed through its own ``aiter_from`` when it has one (``TarShards`` does) and the
        mode is ``stop="first"``; otherwise its skipped samples are read and dropped (never
        awaited), since whether it ran out during them changes the choices that follow.
        """
        return self._run(None, skip, tagged=False)

    # ── elastic resume (asyncload.ElasticIterable; see _elastic_iter) ──────────────────────

    def elastic_key(self) -> str | None:
        """The mix and each dataset's own key; ``None`` with ``samples`` (a dataset that runs
        out starts again, which can't be re-dealt) or a dataset that is not elastic."""
        if self.samples is not None:
            return None
        keys = []
        for ds in self.datasets:
            if _is_map_style(ds):
                keys.append(f"{type(ds).__name__} of {len(ds)}")
            elif supports(ds):
                keys.append(str(ds.elastic_key()))
            else:
                return None
        weights = ", ".join(f"{w:.12g}" for w in self.weights)
        mix = f"Mix(stop={self.stop}, seed={self.seed}, weights=[{weights}])"
        return f"{mix} of [{'; '.join(keys)}]"

    def elastic_units(self, rank: int, world_size: int, worker: int, num_workers: int) -> list[int]:
        """Reader ``(rank, worker)``'s units of every dataset, each in its dataset's range."""
        reader, readers = rank * num_workers + worker, world_size * num_workers
        units: list[int] = []
        for i, ds in enumerate(self.datasets):
            if self.weights[i] == 0:
                continue  # never drawn
            if _is_map_style(ds):
                units.append(i * _SOURCE + _slice_unit(reader, readers))
            else:
                own = ds.elastic_units(rank, world_size, worker, num_workers)
                units += [i * _SOURCE + int(u) for u in own]
        return units

    def elastic_iter(
        self, plan: Sequence[UnitPlan] | None, skip: int
    ) -> AsyncIterator[tuple[Tag, Any]]:
        """This reader's ``(tag, sample)`` pairs: its ordinary share without its first *skip*
        samples, or what *plan* holds of each dataset, mixed with the same weights."""
        return self._run(plan, skip, tagged=True)

    def _sources(
        self, plan: Sequence[UnitPlan] | None, reader: int, readers: int, *, tagged: bool
    ) -> list[_MapSource | _IterSource | None]:
        """One source per dataset; ``None`` where a re-dealt *plan* holds none of it."""
        sources: list[_MapSource | _IterSource | None] = []
        for i, ds in enumerate(self.datasets):
            base = i * _SOURCE
            mine = None
            if plan is not None:
                mine = [(u - base, wm, ex) for u, wm, ex in plan if base <= u < base + _SOURCE]
            if mine is not None and not mine:
                sources.append(None)
            elif _is_map_style(ds):
                slices = mine if mine is not None else [(_slice_unit(reader, readers), 0, ())]
                sources.append(_MapSource(ds, (self.seed, self.epoch, i), base, slices))
            else:
                sources.append(_IterSource(ds, base, tagged=tagged, plan=mine))
        return sources

    async def _run(
        self, plan: Sequence[UnitPlan] | None, skip: int, *, tagged: bool
    ) -> AsyncIterator[Any]:
        reader, readers = shard_position()
        quota: int | None = None
        if self.samples is not None:
            per, extra = divmod(self.samples, readers)
            quota = per + (reader < extra)
        defer = self.stop == "first" and self.samples is None
        sources = self._sources(plan, reader, readers, tagged=tagged)
        active = [i for i, w in enumerate(self.weights) if w > 0 and sources[i] is not None]
        # A re-dealt reader's choices are seeded apart from every ordinary reader's.
        rng = np.random.default_rng(
            (self.seed, self.epoch, reader, readers) + (() if plan is None else (1,))
        )
        drawn = 0
        try:
            while active and (quota is None or drawn < quota):
                p = self.weights[active]
                i = active[int(rng.choice(len(active), p=p / p.sum()))]
                src = sources[i]
                assert src is not None
                replaying = drawn < skip
                if replaying and defer and isinstance(src, _IterSource):
                    src.defer()
                    drawn += 1
                    continue
                got = await src.take(fetch=not replaying)
                if got is _END:
                    if self.samples is not None:
                        if src.restart():
                            got = await src.take(fetch=not replaying)
                        if got is _END:
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
                    tag, item = got
                    yield (tag, item) if tagged else item
        finally:
            for s in sources:
                if s is not None:
                    await s.aclose()
