"""``asyncload.DataLoader``: torch's DataLoader, with an event loop in every worker.

The loader holds torch's arguments, counts epochs, saves and loads checkpoints (``state``),
and starts passes: it resolves its settings into a frozen ``spec.PassSpec`` (``settings``) and
hands that, with the resume point, to a ``pass_iterator.Pass``, which does the rest. With
persistent workers it keeps that pass and restarts it every epoch; the workers belong to the
pass, so a temporary loader (``for b in DataLoader(...)``) is fine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import inspect
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, Generic, Literal, TypeVar

import torch
import torch.utils.data

from .._checkpoint.shape import LoaderShape
from .._control import LimitState
from .._dataset import sample_errors as _budget
from .._dataset import sharding as _sharding
from .._engine.options import WorkerOptions
from .._engine.slots import most_in_flight
from .._stats import loader_stats as _stats
from .._workers import StandbySlot
from .._workers.reaper import reaper
from .._workers.start_method.context import early_context, start_early
from . import state as _checkpoint
from .lookahead import DEFAULT_PREFETCH_BYTES, BatchSizes
from .pass_iterator import Pass, State
from .settings import always_out_per_worker, outstanding_per_worker, pass_spec

__all__ = ["DataLoader"]

T_co = TypeVar("T_co", covariant=True)

_HAS_IN_ORDER = "in_order" in inspect.signature(torch.utils.data.DataLoader.__init__).parameters


class DataLoader(torch.utils.data.DataLoader[T_co], Generic[T_co]):
    """torch's DataLoader, fetching many samples at once in every worker, across batches.

    Every argument shared with ``torch.utils.data.DataLoader`` has torch's meaning. Each
    worker process runs one event loop (uvloop where installed) for its whole life; an
    ``async def __getitem__`` is awaited there, a plain one runs in the worker's thread pool.
    With ``num_workers=0`` the same loop runs in a background thread of this process.

    Args:
        max_concurrency: Samples in flight per worker (keyword-only). ``None`` or ``"auto"``
            (default):
            each worker finds its own limit while it reads, up to 512 (and 1,024 for all the
            workers together, 64 each at least): it grows while samples
            come back as fast, shrinks when their latency rises without more coming back (the
            store queues them, or the worker's CPU is the bottleneck), and is cut at once when
            the store says "too many" (``503 SlowDown``, ``429``, ``Retry-After``), whose
            requests are then retried within the cut limit. ``stats().concurrency`` shows where
            it is, ``stats().throttled`` how often the store pushed back. An int is a fixed
            limit, as before: at 50 ms per request 128 reads about 2,500 samples/s per worker.
        cpu_threads: Threads of each worker's CPU lane (keyword-only), where
            [`asyncload.cpu`][asyncload.cpu] calls and ``decode_in_thread`` decoders run, the
            head batch's first. ``None`` (default): the worker's share of the cores this
            process may use (``os.sched_getaffinity``), at least one.
        prefetch_bytes: How far the workers may run ahead of the training loop, in bytes held by
            batches fetched but not yet yielded (keyword-only, default 1 GiB per pass; 0 keeps
            a fixed window). While the next batch waits on one slow request, the workers keep
            fetching later batches up to this bound, so request slots never idle behind a
            straggler; ``in_order=True`` still yields in sampler order. Without
            ``prefetch_factor``, up to ``ceil(max_concurrency / batch_size) + 1`` batches per
            worker (512 for ``None``) are out while their bytes fit, and always 2, torch's
            default, whatever their size (the loader's first pass sends the whole window before
            it knows how large its batches are). With ``prefetch_factor``, that many per worker
            are always out, as in torch.
        auto_shard: Under ``torchrun`` (``WORLD_SIZE > 1``), give a map-style dataset without
            its own sampler a ``DistributedSampler``, so each rank reads its share (keyword-only,
            default ``True``; torch's DataLoader never does this). The partition is logged once;
            a share padded with repeated samples warns. ``False`` reads the whole dataset on
            this rank, as torch does (e.g. a rank-0-only evaluation loader).
        sample_errors: What a sample whose fetch or decode fails does (keyword-only):
            ``"raise"`` (default, torch's behaviour) fails its batch; ``"skip"`` leaves it out
            of its batch, which is then smaller (never refilled; a batch whose every sample
            failed is not yielded at all), and counts it in ``stats().skipped``; ``"warn"``
            does the same and emits one ``AsyncloadWarning`` per skipped sample. The same
            words as ``TarShards(handler=...)``. A dataset with ``__getitems__`` fails as a
            whole batch, so all its samples are skipped. Resume stays exact: a skipped sample
            is not fetched again after ``load_state_dict``.
        max_sample_errors: With ``"skip"``/``"warn"``, how many samples a pass may skip
            before it fails with ``SampleErrorBudgetExceeded`` listing the first failures:
            an int (a count), a float in (0, 1) (a fraction of the samples seen so far in
            the pass; at least one is always tolerated), or ``None`` (no limit, default).

    Examples:
        >>> import asyncload
        >>> class Blobs(asyncload.Dataset):
        ...     def __init__(self, urls):
        ...         self.urls = urls
        ...     def __len__(self):
        ...         return len(self.urls)
        ...     async def __getitem__(self, i):
        ...         return await asyncload.read(self.urls[i])
        >>> loader = asyncload.DataLoader(Blobs(urls), batch_size=32, num_workers=2,
        ...                               collate_fn=list)  # doctest: +SKIP
        >>> for batch in loader:  # or: async for batch in loader  # doctest: +SKIP
        ...     train_step(batch)
    """

    def __init__(
        self,
        dataset: torch.utils.data.Dataset[T_co],
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: torch.utils.data.Sampler[Any] | Iterable[Any] | None = None,
        batch_sampler: torch.utils.data.Sampler[list[Any]] | Iterable[list[Any]] | None = None,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        max_concurrency: int | Literal["auto"] | None = None,
        cpu_threads: int | None = None,
        prefetch_bytes: int = DEFAULT_PREFETCH_BYTES,
        auto_shard: bool = True,
        sample_errors: Literal["raise", "skip", "warn"] = "raise",
        max_sample_errors: int | float | None = None,
    ) -> None:
        self._sample_errors = _budget.policy(sample_errors, max_sample_errors)
        # What every worker reads as given (a new such argument: _engine/options.py).
        self._worker_options = WorkerOptions(
            max_concurrency=None if max_concurrency == "auto" else max_concurrency,
            cpu_threads=cpu_threads,
            skip_sample_errors=self._sample_errors.skips,
        )
        max_concurrency = self._worker_options.max_concurrency
        if not isinstance(prefetch_bytes, int) or prefetch_bytes < 0:
            raise ValueError(
                f"prefetch_bytes must be a non-negative integer (bytes), got {prefetch_bytes!r}"
            )
        extra = {"in_order": in_order} if _HAS_IN_ORDER else {}
        rank, world = _sharding.rank_and_world_size()
        is_iterable = isinstance(dataset, torch.utils.data.IterableDataset)
        # Under torchrun each rank must see its own share: DistributedSampler's split (padding
        # by repetition, or dropping the tail with drop_last=True). Without set_epoch() calls
        # the loader advances its epoch every pass, so shuffle=True reshuffles as torch's
        # RandomSampler would.
        auto_epoch: int | None = None
        # The sampler is the loader's own (DistributedSampler under torchrun, else torch's
        # default): a checkpoint may then resume with another world size
        # (_checkpoint/elastic_map.py).
        self._elastic_ok = (
            auto_shard and not is_iterable and sampler is None and batch_sampler is None
        )
        self._rank, self._world = rank, world
        if (
            auto_shard
            and world > 1
            and not is_iterable
            and sampler is None
            and batch_sampler is None
        ):
            auto_epoch = 0
            sampler = _sharding.rank_sampler(
                dataset,
                rank=rank,
                world_size=world,
                shuffle=bool(shuffle),
                seed=int(generator.initial_seed()) if generator is not None else 0,
                drop_last=drop_last,
            )
            shuffle = None
        super().__init__(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            sampler=sampler,
            batch_sampler=batch_sampler,
            num_workers=num_workers,
            collate_fn=collate_fn,
            pin_memory=pin_memory,
            drop_last=drop_last,
            timeout=timeout,
            worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context,
            generator=generator,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
            **extra,
        )
        self.in_order = in_order
        self.prefetch_bytes = prefetch_bytes
        per_batch = self.batch_size if self._auto_collation and self.batch_size else 1
        self._outstanding_per_worker = outstanding_per_worker(
            prefetch_factor, max_concurrency, self.num_workers, per_batch
        )
        self._always_out_per_worker = always_out_per_worker(
            prefetch_factor, self._outstanding_per_worker
        )
        self._batch_sizes = BatchSizes()  # what its passes' look-ahead learned (_lookahead)
        self._tally: _stats.Tally | None = None
        # Where the last pass's workers' adaptive limits got to (the next pass starts there).
        self._learned: dict[int, LimitState] = {}
        self._persistent_pass: Pass | None = None
        self._live_pass: weakref.ref[Pass] | None = None
        # Epochs and a loaded checkpoint's resume, as one value replaced whole (_loader/state).
        self._state = _checkpoint.LoaderState(auto_epoch=auto_epoch)
        self._standby: StandbySlot | None = None
        if self.num_workers > 0:
            # Processes started ahead of the pass that takes them (_workers/standby.py): the
            # first pass's from here, in the background, overlapping the caller's set-up (with
            # the forkserver's one-time imports); without persistent workers, each pass starts
            # the next one's once it has sent its last task.
            reaper.ensure_started()  # an ordinary call: finalizers only hand it their jobs
            self._standby = StandbySlot()
            weakref.finalize(self, self._standby.close)  # never blocks (NOTE [ Who stops workers ])
            early = early_context(self.multiprocessing_context)
            if early is not None:
                start_early(early, fork=self.multiprocessing_context is None)
                self._standby.prepare(
                    early,
                    self.num_workers,
                    max_concurrency=most_in_flight(self.max_concurrency, self.num_workers),
                )

    @property
    def max_concurrency(self) -> int | None:
        """Samples in flight per worker at most; ``None``: a limit each worker finds itself."""
        return self._worker_options.max_concurrency

    @property
    def cpu_threads(self) -> int | None:
        """Threads of each worker's CPU lane; ``None``: its share of the cores."""
        return self._worker_options.cpu_threads

    def _get_iterator(self) -> Pass:  # type: ignore[override]
        resume = self._state.resume
        self._state = self._state.next_pass()  # the pass takes the one-shot parts
        spec = pass_spec(self)
        if self._state.pass_deal is not None:  # an elastic resume: this pass reads the re-deal
            deal = self._state.pass_deal
            index_sampler: Any = deal
            if self._auto_collation:
                index_sampler = torch.utils.data.BatchSampler(
                    deal, self.batch_size or 1, self.drop_last
                )
            spec = dataclasses.replace(spec, index_sampler=index_sampler, persistent=False)
        if self._state.pass_iter_deal is not None:  # this pass reads what is left, re-dealt
            plans = self._state.pass_iter_deal.plans
            spec = dataclasses.replace(spec, reader_plans=plans, persistent=False)
        it = Pass(spec, resume=resume, len_reported=self._IterableDataset_len_called)
        self._tally = it.tally
        self._learned = it.learned
        self._live_pass = weakref.ref(it)
        return it

    def set_epoch(self, epoch: int) -> None:
        """Tell the sampler and the dataset which epoch starts next.

        Calls ``set_epoch(epoch)`` on the sampler, the batch sampler and the dataset where they
        have it (``DistributedSampler`` reshuffles by epoch, and so does ``TarShards``).
        Persistent workers receive the new epoch before the next pass.
        """
        # The caller keeps count from now on.
        self._state = dataclasses.replace(self._state, epoch=epoch, auto_epoch=None)
        seen: set[int] = set()
        batch_sampler_sampler = getattr(self.batch_sampler, "sampler", None)
        for obj in (self.sampler, self.batch_sampler, batch_sampler_sampler, self.dataset):
            fn = getattr(obj, "set_epoch", None)
            if callable(fn) and id(obj) not in seen:
                seen.add(id(obj))
                fn(epoch)

    def state_dict(self) -> dict[str, Any]:
        """Where the current pass stands, to continue it later with ``load_state_dict``.

        Only batches already handed to the training loop count as consumed; batches fetched but
        not yet yielded are fetched again after a restore. Saved once a pass is over, it
        restores to the next epoch, shuffled as this loader would shuffle it. The dict can be
        saved with ``torch.save``.

        Examples:
            >>> torch.save(loader.state_dict(), "loader.pt")  # doctest: +SKIP
            >>> loader = asyncload.DataLoader(dataset, batch_size=32)  # doctest: +SKIP
            >>> loader.load_state_dict(torch.load("loader.pt"))  # doctest: +SKIP
            >>> for batch in loader:  # the rest of the interrupted epoch  # doctest: +SKIP
            ...     ...
        """
        live = self._live_pass() if self._live_pass is not None else None
        return _checkpoint.save(self._shape(), self._state, live)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the pass recorded by ``state_dict`` at the next ``iter(loader)``.

        Build the loader with the same dataset, sampler arguments and generator seed. For an
        iterable dataset also the same ``num_workers`` and world size, unless it can be
        re-dealt (``TarShards``, any ``asyncload.ElasticIterable``): then what is left of the
        epoch is dealt over the new readers (with another world size, load
        ``asyncload.merge_state_dicts`` of every rank's checkpoint).

        Raises:
            ValueError: The checkpoint was saved from a loader with another ``batch_size``,
                ``drop_last``, dataset length, sampler (kind, length, shuffle) or seed; the
                message names each difference with both values.
        """
        loaded = _checkpoint.load(self._shape(), self._state, state)
        if self._persistent_pass is not None:  # its workers are mid-pass: start afresh
            self._persistent_pass.close()
            self._persistent_pass = None
        self._state = loaded.state
        if loaded.set_epoch is not None:
            self.set_epoch(loaded.set_epoch)
        # Mid-epoch, the rest must come in the order of the epoch that was saved: a forgotten
        # sampler.set_epoch before iterating would silently shuffle another.
        holder = _checkpoint.epoch_holder(self._shape())
        if holder is not None and loaded.sampler_epoch not in (None, holder.epoch):
            holder.set_epoch(loaded.sampler_epoch)
        self._live_pass = None  # state_dict() now reports what was loaded, not an old pass

    def _shape(self) -> LoaderShape:
        """This loader's arguments that its checkpoints depend on, as a value."""
        return LoaderShape(
            dataset=self.dataset,
            sampler=self.sampler,
            batch_sampler=self.batch_sampler,
            generator=self.generator,
            batch_size=self.batch_size,
            auto_collation=self._auto_collation,
            drop_last=self.drop_last,
            num_workers=self.num_workers,
            rank=self._rank,
            world_size=self._world,
            elastic=self._elastic_ok,
        )

    def __iter__(self) -> Pass:  # type: ignore[override]
        auto_epoch = self._state.auto_epoch
        if auto_epoch is not None:
            self.sampler.set_epoch(auto_epoch)  # type: ignore[attr-defined]
            self._state = dataclasses.replace(
                self._state, epoch_of_pass=auto_epoch, auto_epoch=auto_epoch + 1
            )
        else:
            self._state = dataclasses.replace(self._state, epoch_of_pass=self._state.epoch)
        redealt = self._state.redealt
        if not (self.persistent_workers and self.num_workers > 0) or redealt:
            return self._get_iterator()  # a re-dealt pass is never kept for the next epoch
        persistent = self._persistent_pass
        # A pass that ended in an error closed its workers: start new ones. So does a child
        # made by os.fork(): the workers it inherited the pass of serve its parent.
        if persistent is None or persistent.state is State.CLOSED or not persistent.owned_here():
            persistent = self._persistent_pass = self._get_iterator()
        else:
            persistent.restart(self._state.epoch, self._IterableDataset_len_called)
            self._tally = persistent.tally
            self._learned = persistent.learned
        return persistent

    def __aiter__(self) -> AsyncIterator[Any]:
        """Iterate without blocking the running event loop: waits happen in a helper thread."""
        return _aiter(self)

    def stats(self) -> _stats.LoaderStats:
        """A snapshot of throughput, latency, retries, errors and data-wait time.

        Covers the current (or last) iterator; all zeros before iteration starts.
        """
        if self._tally is None:
            return _stats.merge([], started=time.monotonic(), batches=0, wait_s=0.0)
        return self._tally.stats()


async def _aiter(loader: DataLoader[Any]) -> AsyncIterator[Any]:
    loop = asyncio.get_running_loop()
    # One thread for this iteration: the iterator is only ever touched from it.
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="asyncload-aiter")
    it: Pass | None = None
    try:
        it = await loop.run_in_executor(pool, iter, loader)
        end = object()
        while True:
            batch = await loop.run_in_executor(pool, next, it, end)
            if batch is end:
                return
            yield batch
    finally:
        if it is not None and not loader.persistent_workers:
            await loop.run_in_executor(pool, it.close)
        pool.shutdown(wait=False)
