"""``TarShards``: WebDataset-style tar shards streamed by every worker's event loop.

One reader (a worker of a rank) runs this pipeline; every stage is a pure function of
``(urls, seed, epoch, rank, world_size, worker id, num_workers)``, never of network timing, so
an epoch can be replayed exactly and resumed by skipping::

    assign shards ──► stream + parse N shards at once ──► round-robin interleave ──►
        [cap at samples_per_rank] ──► [seeded shuffle buffer] ──► [skip] ──► decode ──► yield

Shards are fetched with ``asyncload.stream``; each open shard's parser fills a small
byte-bounded buffer of samples while the interleaver takes one sample from each open shard in
turn, waiting for a slow one rather than taking whichever arrives first. The stages themselves
live in ``_tar_pipeline``; this module holds the options, the shard assignment and decoding.
"""

from __future__ import annotations

import hashlib
import warnings
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Mapping, Sequence
from contextlib import aclosing
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from .._checkpoint.elastic_iter import Tag, UnitPlan
from .._dataset import cpu as _cpu
from .._dataset.base import IterableDataset
from .._dataset.sharding import get_worker_info, rank_and_world_size
from .._exceptions import ArchiveError, AsyncloadWarning
from .._redact import redact_url
from .._storage import api as _storage
from ..sources import StorageOptions
from ._decoders import PICKLE_EXTENSIONS, check_pickle_guard, decode_fields, table_for
from ._shardcheck import ShardStats
from ._tar_pipeline import (
    OpenShard,
    Sample,
    capped,
    decode_in_pool,
    interleaved,
    open_shard,
    shuffled,
)
from ._tarstream import expand_urls

__all__ = ["PICKLE_EXTENSIONS", "ShardStats", "TarShards"]

Handler = Literal["raise", "warn", "skip"] | Callable[[Exception], bool]
Decoders = Mapping[str, Callable[[bytes], Any]] | Callable[[Sample], Sample] | None


class TarShards(IterableDataset[Sample]):
    """An iterable dataset over WebDataset-style tar shards at any URL asyncload can read.

    Each sample is a ``dict``: the consecutive members sharing a key (``dir/img001.jpg``,
    ``dir/img001.cls`` → key ``dir/img001``) become ``{"__key__": "dir/img001", "__url__": url,
    "jpg": b"...", "cls": b"3"}`` (``__url__`` with credentials redacted). Values are ``bytes``
    unless a decoder applies. Shards are never extracted: a streaming parser reads them in
    memory.

    **Assignment.** Every epoch the shard list is permuted with
    ``np.random.default_rng((seed, epoch))`` (when ``shuffle_shards``); reader
    ``g = rank * num_workers + worker_id`` of ``G = world_size * num_workers`` takes shards
    ``g, g + G, g + 2G, ...``.

    **Uneven shards.** With one rank every shard is read once per epoch. With ``world_size > 1``
    every reader gets the same number of shards, ``len(urls) // G``: the leftover shards (other
    ones every epoch when shuffled) sit this epoch out, so equal-sized shards give every rank the
    same number of batches, as DDP needs. ``samples_per_rank=N`` makes it exact whatever the
    shard sizes: each rank yields exactly ``N`` samples (split evenly over its workers), every
    shard is used, a reader that runs out starts its shards again and one with samples to spare
    stops early.

    **Order.** Each reader streams ``shards_in_flight`` shards at once (and opens as many ahead),
    takes one sample from each in turn, then mixes them in a shuffle buffer of
    ``shuffle_buffer`` samples seeded from ``(seed, epoch, rank, world_size, worker,
    num_workers)``. The same arguments give the same order whatever the network timing.

    **Compression.** A shard whose name ends in ``.tar.gz`` or ``.tgz`` (or whose bytes start
    like gzip) is decompressed as it streams, never held whole.

    **Safety.** Absolute paths, ``..``, links, devices and fifos raise ``ArchiveError``, as
    do corrupt headers (naming the shard and the byte offset). Members ending in one of
    ``PICKLE_EXTENSIONS``, in any letter case, stay ``bytes`` unless ``allow_pickle=True``.
    A shard that holds no sample, or ends without tar's end-of-archive block (cut short at a
    member boundary), gives an [`AsyncloadWarning`][asyncload.AsyncloadWarning] and is counted in
    ``shard_stats``.

    Args:
        urls: Shard URLs (any iterable of ``str`` or a NumPy array), or one pattern as WebDataset
            reads it: brace-expanded (``"s3://bucket/train-{000000..000127}.tar"``, steps
            ``{0..98..2}``, nested braces), several joined with ``::``.
        shuffle_shards: Permute the shard list every epoch.
        shuffle_buffer: Size of the per-reader shuffle buffer; ``0`` keeps the interleaved order.
        seed: Seed of every shuffle.
        decoders: ``{extension: fn(bytes)}`` (the full extension such as ``"seg.png"`` wins over
            its last part ``"png"``; letter case is ignored), or ``fn(sample) -> sample`` for
            the whole sample.
        decode_in_thread: Run decoders on the worker's CPU lane (see
            [`asyncload.cpu`][asyncload.cpu]), several samples at once, so CPU-heavy decoding
            (images, audio) overlaps with streaming (``True``), or inline (``False``). ``None``
            (default): on the lane where the worker has two cores or more to itself, inline
            where it has one.
        shards_in_flight: Shards each reader interleaves at once.
        handler: What a corrupt shard, an unsafe member or a failing decoder does: ``"raise"``
            (default), ``"warn"`` (an [`AsyncloadWarning`][asyncload.AsyncloadWarning], then
            carry on) or ``"skip"`` (carry on silently), or ``fn(exc) -> bool`` returning whether
            to carry on. Carrying on skips the member, the sample or the rest of the shard.
        allow_pickle: Decode pickle members (``pyd``, ``pickle``, ``pkl`` with ``pickle``;
            ``pth``, ``pt`` with ``torch.load``). Only for shards you trust.
        samples_per_rank: Yield exactly this many samples per rank and epoch (see above).
        chunk_size: Bytes per streamed chunk.
        buffer_bytes: Bytes of parsed samples each open shard may hold before it waits.
        storage_options: ``{prefix: options}`` applied with
            [`asyncload.configure_all`][asyncload.configure_all] in each process that reads.

    Examples:
        >>> import asyncload, json
        >>> ds = asyncload.TarShards(
        ...     "s3://bucket/train-{000000..000099}.tar",
        ...     shuffle_buffer=1000, decoders={"cls": int, "json": json.loads},
        ... )
        >>> loader = asyncload.DataLoader(ds, batch_size=64, num_workers=4)  # doctest: +SKIP
        >>> for epoch in range(10):  # doctest: +SKIP
        ...     loader.set_epoch(epoch)
        ...     for batch in loader:
        ...         ...
    """

    def __init__(
        self,
        urls: str | Iterable[str] | npt.NDArray[Any],
        *,
        shuffle_shards: bool = True,
        shuffle_buffer: int = 0,
        seed: int = 0,
        decoders: Decoders = None,
        decode_in_thread: bool | None = None,
        shards_in_flight: int = 4,
        handler: Handler = "raise",
        allow_pickle: bool = False,
        samples_per_rank: int | None = None,
        chunk_size: int = 1 << 20,
        buffer_bytes: int = 16 << 20,
        storage_options: Mapping[str, StorageOptions | Mapping[str, Any]] | None = None,
    ) -> None:
        url_list = expand_urls(urls) if isinstance(urls, str) else [str(u) for u in urls]
        if not url_list:
            raise ValueError("TarShards needs at least one shard URL")
        # One fixed-width array, not a list of str: forked workers don't copy it by touching it.
        self._urls: npt.NDArray[np.str_] = np.asarray(url_list, dtype=np.str_)
        if shuffle_buffer < 0 or shards_in_flight < 1 or chunk_size < 1 or buffer_bytes < 1:
            raise ValueError(
                "shuffle_buffer must be >= 0; shards_in_flight, chunk_size, buffer_bytes >= 1"
            )
        if samples_per_rank is not None and samples_per_rank < 0:
            raise ValueError(f"samples_per_rank must be >= 0, got {samples_per_rank}")
        if isinstance(handler, str) and handler not in ("raise", "warn", "skip"):
            raise ValueError(f"handler must be 'raise', 'warn', 'skip' or a callable: {handler!r}")
        if isinstance(decoders, Mapping):
            check_pickle_guard(decoders, allow_pickle)
        self.shuffle_shards = shuffle_shards
        self.shuffle_buffer = shuffle_buffer
        self.seed = seed
        self.decoders = decoders
        self.decode_in_thread = decode_in_thread
        self.shards_in_flight = shards_in_flight
        self.handler = handler
        self.allow_pickle = allow_pickle
        self.samples_per_rank = samples_per_rank
        self.chunk_size = chunk_size
        self.buffer_bytes = buffer_bytes
        self.storage_options = dict(storage_options) if storage_options else None
        self.epoch = 0
        self._table = table_for(decoders if isinstance(decoders, Mapping) else None, allow_pickle)
        self._counts: Counter[str] = Counter()

    # ── public helpers ─────────────────────────────────────────────────────────────────────

    @property
    def urls(self) -> list[str]:
        """The shard URLs, in the order given."""
        return [str(u) for u in self._urls]

    def shard_stats(self) -> ShardStats:
        """Counts of the shards this process has streamed so far, suspect ones included.

        Each worker process counts its own shards (a copy of the dataset lives in each);
        with ``num_workers=0`` the loader's own process does the reading.

        Examples:
            >>> TarShards(["/data/0.tar"]).shard_stats().suspect
            0
        """
        c = self._counts
        return ShardStats(shards=c["shards"], empty=c["empty"], unterminated=c["unterminated"])

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose shard permutation and shuffle to use (``loader.set_epoch``)."""
        self.epoch = int(epoch)

    def shard_indices(self, rank: int, world_size: int, worker: int, num_workers: int) -> list[int]:
        """Indices into ``urls`` that reader ``(rank, worker)`` streams this epoch, in order.

        Examples:
            >>> ds = TarShards([f"/data/{i}.tar" for i in range(10)], seed=1)
            >>> sorted(ds.shard_indices(0, 2, 0, 1) + ds.shard_indices(1, 2, 0, 1)) != []
            True
        """
        n = len(self._urls)
        readers = world_size * num_workers
        g = rank * num_workers + worker
        if self.shuffle_shards:
            order = np.random.default_rng((self.seed, self.epoch)).permutation(n)
        else:
            order = np.arange(n)
        if world_size > 1 and self.samples_per_rank is None:
            per_reader = n // readers
            if per_reader == 0:
                raise ValueError(
                    f"TarShards: {n} shards can't be split evenly over {readers} readers "
                    f"({world_size} ranks × {num_workers} workers); use more shards, fewer "
                    "workers, or samples_per_rank="
                )
            mine = order[g : per_reader * readers : readers]
        else:
            mine = order[g::readers]
            if len(mine) == 0 and self.samples_per_rank:
                mine = order[[g % n]]  # more readers than shards: this one re-reads one
        return [int(i) for i in mine]

    # ── iteration ──────────────────────────────────────────────────────────────────────────

    def __aiter__(self) -> AsyncIterator[Sample]:
        return self.aiter_from(0)

    def aiter_from(self, skip: int) -> AsyncGenerator[Sample, None]:
        """Iterate this reader's share, leaving out its first *skip* samples.

        Skipped samples are still streamed and parsed (shard sample counts are unknown) but
        never decoded. The loader calls this to resume an epoch.
        """
        return self._read(None, skip, tagged=False)

    # ── elastic resume (asyncload.ElasticIterable; see _elastic_iter) ──────────────────────

    def elastic_key(self) -> str | None:
        """The shard list, as a short digest; ``None`` with ``samples_per_rank`` (whose
        re-reading of shards can't be re-dealt)."""
        if self.samples_per_rank is not None:
            return None
        digest = hashlib.sha256("\n".join(self.urls).encode()).hexdigest()[:16]
        return f"{len(self._urls)} shards, sha256 {digest}"

    def elastic_units(self, rank: int, world_size: int, worker: int, num_workers: int) -> list[int]:
        """The shards reader ``(rank, worker)`` reads this epoch (``shard_indices``)."""
        return self.shard_indices(rank, world_size, worker, num_workers)

    def elastic_iter(
        self, plan: Sequence[UnitPlan] | None, skip: int
    ) -> AsyncGenerator[tuple[Tag, Sample], None]:
        """This reader's ``(tag, sample)`` pairs: its share without its first *skip* samples,
        or the shards of *plan* without the samples it names (read, never decoded)."""
        return self._read(plan, skip, tagged=True)

    async def _read(
        self, plan: Sequence[UnitPlan] | None, skip: int, *, tagged: bool
    ) -> AsyncGenerator[Any, None]:
        if self.storage_options:
            _storage.configure_all(self.storage_options)
        info = get_worker_info()
        if info is None:
            rank, world = rank_and_world_size()
            worker, workers = 0, 1
        else:
            rank, world, worker, workers = info.rank, info.world_size, info.id, info.num_workers
        leave_out = None
        if plan is not None:
            shards = [int(unit) for unit, _, _ in plan]
            leave_out = {int(u): (int(wm), frozenset(extras)) for u, wm, extras in plan}
        else:
            shards = self.shard_indices(rank, world, worker, workers)
        stream: AsyncGenerator[Any, None]
        if self.samples_per_rank is None:
            stream = self._interleaved(shards, tagged, leave_out)
        else:
            per, extra = divmod(self.samples_per_rank, workers)
            stream = capped(
                lambda: self._interleaved(shards, tagged, None),
                per + (worker < extra),
                empty=f"samples_per_rank={self.samples_per_rank}: shards {shards} hold no samples",
            )
        if self.shuffle_buffer > 1:
            rng = np.random.default_rng((self.seed, self.epoch, rank, world, worker, workers))
            stream = shuffled(stream, rng, self.shuffle_buffer)
        decode: Callable[[Any], Any] = self._decode_tagged if tagged else self._decode_or_handle
        async with aclosing(stream) as raw:
            seen = 0
            if _cpu.decode_on_lane(self.decode_in_thread):
                async for sample in decode_in_pool(raw, skip, decode):
                    yield sample
                return
            async for item in raw:
                seen += 1
                if seen <= skip:
                    continue
                decoded = decode(item)
                if decoded is not None:
                    yield decoded

    def _interleaved(
        self,
        shards: list[int],
        tagged: bool,
        leave_out: dict[int, tuple[int, frozenset[int]]] | None,
    ) -> AsyncGenerator[Any, None]:
        return interleaved(
            shards,
            width=self.shards_in_flight,
            open_one=self._open,
            carry_on=self._carry_on,
            tagged=tagged,
            leave_out=leave_out,
        )

    def _open(self, sid: int) -> OpenShard:
        return open_shard(
            str(self._urls[sid]),
            chunk_size=self.chunk_size,
            buffer_bytes=self.buffer_bytes,
            counts=self._counts,
            carry_on=self._carry_on,
        )

    # ── errors and decoding ────────────────────────────────────────────────────────────────

    def _carry_on(self, exc: Exception) -> bool:
        """Apply the error policy: True to skip what failed and go on, False to raise."""
        handler = self.handler
        if handler == "raise":
            return False
        if handler == "warn":
            warnings.warn(f"TarShards skipped: {exc}", AsyncloadWarning, stacklevel=2)
            return True
        if handler == "skip":
            return True
        assert callable(handler)
        return bool(handler(exc))

    def _decode(self, sample: Sample) -> Sample:
        if callable(self.decoders):
            return self.decoders(sample)
        return decode_fields(sample, self._table)

    def _decode_tagged(self, item: tuple[Tag, Sample]) -> tuple[Tag, Sample] | None:
        decoded = self._decode_or_handle(item[1])
        return None if decoded is None else (item[0], decoded)

    def _decode_or_handle(self, sample: Sample) -> Sample | None:
        try:
            return self._decode(sample)
        except Exception as exc:
            err = ArchiveError(f"{sample['__url__']}: decoding sample {sample['__key__']!r}: {exc}")
            if self._carry_on(err):
                return None
            raise err from exc

    def __repr__(self) -> str:
        first = redact_url(str(self._urls[0]))
        return f"TarShards({len(self._urls)} shards, first={first!r}, epoch={self.epoch})"
