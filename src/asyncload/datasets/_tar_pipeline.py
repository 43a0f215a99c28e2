"""The stages of one ``TarShards`` reader, each an async generator of samples.

``TarShards`` holds the options and wires these together (see ``_tar``'s docstring)::

    open_shard (a producer task per shard) ──► interleaved ──► [capped] ──► [shuffled] ──►
        [decode_in_pool]

Every stage depends on its arguments and the data alone, never on network timing, so an epoch
replays exactly.
"""

from __future__ import annotations

import asyncio
import collections
import os
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from contextlib import aclosing
from typing import Any, cast

import numpy as np

from .._dataset import cpu as _cpu
from .._exceptions import ArchiveError
from .._redact import redact_url
from .._storage import api as _storage
from ._gzip import maybe_gunzip
from ._shardcheck import note_ending
from ._tarstream import Channel, Ending, Failed, iter_members, split_name, unsafe_reason

__all__ = [
    "OpenShard",
    "Sample",
    "capped",
    "decode_in_pool",
    "interleaved",
    "open_shard",
    "shuffled",
]

Sample = dict[str, Any]
# The error policy: True to skip what failed and go on, False to raise.
CarryOn = Callable[[Exception], bool]


class OpenShard:
    """A shard being streamed: its producer task and its channel."""

    __slots__ = ("channel", "task")

    def __init__(self, task: asyncio.Task[None], channel: Channel) -> None:
        self.task, self.channel = task, channel


def open_shard(
    url: str, *, chunk_size: int, buffer_bytes: int, counts: Counter[str], carry_on: CarryOn
) -> OpenShard:
    """Start streaming and parsing *url* into a channel of at most *buffer_bytes* of samples."""
    channel = Channel(buffer_bytes)
    task = asyncio.get_running_loop().create_task(
        _produce(url, channel, chunk_size=chunk_size, counts=counts, carry_on=carry_on)
    )
    return OpenShard(task, channel)


async def _produce(
    url: str, channel: Channel, *, chunk_size: int, counts: Counter[str], carry_on: CarryOn
) -> None:
    shown = redact_url(url)
    try:
        raw = cast(AsyncGenerator[bytes, None], _storage.stream(url, chunk_size=chunk_size))
        ending = Ending()
        samples = 0
        async with (
            aclosing(raw),
            aclosing(maybe_gunzip(raw, url, chunk_size)) as chunks,
            aclosing(iter_members(chunks, url, ending)) as members,
        ):
            sample: Sample | None = None
            size = 0
            async for m in members:
                reason = unsafe_reason(m)
                if reason is not None:
                    exc = ArchiveError(f"{shown}: unsafe {reason} at offset {m.offset}")
                    if not carry_on(exc):
                        channel.fail(exc, handled=True)
                        return
                    continue
                parts = split_name(m.name) if m.kind == "file" else None
                if parts is None:
                    continue
                key, ext = parts
                if sample is None or key != sample["__key__"]:
                    if sample is not None:
                        await channel.put(sample, size)
                        samples += 1
                    sample = {"__key__": key, "__url__": shown}
                    size = 0
                if ext in sample:
                    raise ArchiveError(f"{shown}: duplicate member {m.name!r} at offset {m.offset}")
                sample[ext] = m.data
                size += len(m.data)
            if sample is not None:
                await channel.put(sample, size)
                samples += 1
        # Inside the try: with warnings turned into errors, the warning fails the shard.
        note_ending(counts, shown, samples, ending)
    except Exception as exc:
        channel.fail(exc, handled=False)
        return
    channel.close()


async def interleaved(
    shards: list[int],
    *,
    width: int,
    open_one: Callable[[int], OpenShard],
    carry_on: CarryOn,
    tagged: bool = False,
    leave_out: Mapping[int, tuple[int, frozenset[int]]] | None = None,
) -> AsyncGenerator[Any, None]:
    """One sample from each of *width* open shards in turn, in shard order.

    The next shards are opened ahead so their first bytes are there when a slot frees up;
    a finished shard's slot goes to the next shard, so the order depends on data alone.

    *tagged*: yield ``(tag, sample)``, the tag as ``_checkpoint.elastic_iter`` defines it.
    *leave_out*:
    per shard, ``(watermark, extras)``: offsets below the watermark and in extras are read but
    not yielded (delivered before a checkpoint).
    """
    pending = collections.deque(shards)
    window: list[OpenShard] = []
    ahead: collections.deque[OpenShard] = collections.deque()
    where: dict[int, list[int]] = {}  # id(open shard) -> [shard id, next offset]
    ended: list[tuple[int, int]] = []  # shards finished since the last tagged item

    def opened(sid: int) -> OpenShard:
        shard = open_one(sid)
        where[id(shard)] = [sid, 0]
        return shard

    def refill() -> None:
        while pending and len(window) < width:
            window.append(ahead.popleft() if ahead else opened(pending.popleft()))
        while pending and len(ahead) < width:
            ahead.append(opened(pending.popleft()))

    try:
        refill()
        i = 0
        while window:
            i %= len(window)
            shard = window[i]
            item = await shard.channel.get()
            if isinstance(item, dict):
                pos = where[id(shard)]
                offset = pos[1]
                pos[1] += 1
                if leave_out is not None and pos[0] in leave_out:
                    watermark, extras = leave_out[pos[0]]
                    if offset < watermark or offset in extras:
                        continue  # delivered before the checkpoint; the same shard goes on
                if tagged:
                    yield (pos[0], offset, tuple(ended)), item
                    ended.clear()
                else:
                    yield item
                i += 1
                continue
            if isinstance(item, Failed):
                if item.handled or not carry_on(item.exc):
                    raise item.exc
            sid, size = where.pop(id(shard))
            ended.append((sid, size))
            # This shard is done: its slot goes to the next one, taken right away.
            if ahead:
                window[i] = ahead.popleft()
            else:
                del window[i]
            refill()
    finally:
        tasks = [s.task for s in (*window, *ahead)]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def capped(
    start: Callable[[], AsyncGenerator[Sample, None]], quota: int, *, empty: str
) -> AsyncGenerator[Sample, None]:
    """Exactly *quota* samples, starting *start()* again while it runs out; *empty* if it's dry."""
    given = 0
    while given < quota:
        before = given
        async with aclosing(start()) as it:
            async for sample in it:
                yield sample
                given += 1
                if given >= quota:
                    return
        if given == before:
            raise ArchiveError(empty)


async def shuffled(
    stream: AsyncGenerator[Any, None], rng: np.random.Generator, buffer: int
) -> AsyncGenerator[Any, None]:
    """*stream* mixed in a buffer of *buffer* samples, drawing from *rng*."""
    buf: list[Any] = []
    draws = rng.random(1024)
    d = 0
    async with aclosing(stream) as it:
        async for sample in it:
            buf.append(sample)
            if len(buf) <= buffer:
                continue
            if d == len(draws):
                draws, d = rng.random(1024), 0
            j = int(draws[d] * len(buf))
            d += 1
            buf[j], buf[-1] = buf[-1], buf[j]
            yield buf.pop()
    for j in rng.permutation(len(buf)):
        yield buf[j]


async def decode_in_pool(
    raw: AsyncIterator[Any], skip: int, decode: Callable[[Any], Any]
) -> AsyncGenerator[Any, None]:
    """*raw* after its first *skip* samples, decoded on the worker's CPU lane (outside a worker,
    in the loop's default executor), in order."""
    # Up to this many decodes run on the lane while parsing goes on; results keep their order.
    limit = min(32, (os.cpu_count() or 1) * 2)
    running: collections.deque[asyncio.Future[Any]] = collections.deque()
    seen = 0
    try:
        async for item in raw:
            seen += 1
            if seen <= skip:
                continue
            running.append(_cpu.on_lane(decode, item))
            if len(running) >= limit:
                done = await running.popleft()
                if done is not None:
                    yield done
        while running:
            done = await running.popleft()
            if done is not None:
                yield done
    finally:
        for f in running:
            f.cancel()
