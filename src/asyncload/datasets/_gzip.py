"""Gzip-compressed shards (``.tar.gz``, ``.tgz``): decompressed as the chunks stream in.

A ``zlib.decompressobj`` runs over the streamed chunks, so a shard is never held whole, neither
compressed nor decompressed. Each call inflates at most ``chunk_size`` bytes (the rest of the
input waits in ``unconsumed_tail``): a small, highly compressible shard can't balloon into one
huge buffer. The gzip trailer (CRC-32 and length) is checked, so a shard cut short raises instead
of passing for a complete one; members written one after another (``cat a.gz b.gz``, pigz) are
read as one stream, as ``gzip -d`` does::

    compressed chunks ──► decompressobj(gzip) ──► chunks of at most chunk_size ──► tar parser
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import AsyncGenerator, AsyncIterator

from .._exceptions import ArchiveError
from .._redact import redact_url

__all__ = ["GZIP_MAGIC", "is_gzip_name", "maybe_gunzip"]

GZIP_MAGIC = b"\x1f\x8b"
_SUFFIXES = (".gz", ".tgz")
# Inflating this much input or more goes to the thread pool (zlib releases the GIL), so the
# event loop keeps fetching the other shards meanwhile; smaller pieces aren't worth the hop.
_IN_THREAD = 64 << 10


def is_gzip_name(url: str) -> bool:
    """Whether *url*'s path names a gzip file (``.tar.gz``, ``.tgz``, any letter case)."""
    path = url.split("?", 1)[0].split("#", 1)[0]
    return path.lower().endswith(_SUFFIXES)


async def maybe_gunzip(
    chunks: AsyncIterator[bytes], url: str, chunk_size: int
) -> AsyncGenerator[bytes, None]:
    """*chunks* decompressed when *url* names a gzip file or its data starts like one, else as
    they are.

    Raises:
        ArchiveError: The data is not valid gzip, or the stream ends inside a gzip member.
    """
    first = b""
    async for chunk in chunks:
        if chunk:
            first = chunk
            break
    if not first:
        return
    if not (is_gzip_name(url) or first[:2] == GZIP_MAGIC):
        yield first
        async for chunk in chunks:
            yield chunk
        return
    async for out in _gunzip(first, chunks, url, chunk_size):
        yield out


async def _gunzip(
    first: bytes, chunks: AsyncIterator[bytes], url: str, chunk_size: int
) -> AsyncGenerator[bytes, None]:
    loop = asyncio.get_running_loop()
    inflater: zlib._Decompress | None = None  # None between gzip members
    consumed = 0  # compressed bytes fully handed to zlib, for error messages
    data = first
    while True:
        while True:
            if inflater is None:
                if not data.strip(b"\0"):
                    break  # nothing, or zero padding after the last member: ignored
                inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
            try:
                if len(data) >= _IN_THREAD:
                    out = await loop.run_in_executor(None, inflater.decompress, data, chunk_size)
                else:
                    out = inflater.decompress(data, chunk_size)
            except zlib.error as exc:
                raise ArchiveError(
                    f"{redact_url(url)}: not valid gzip data ({exc}) near compressed offset "
                    f"{consumed}"
                ) from None
            if out:
                yield out
            if inflater.eof:
                consumed += len(data) - len(inflater.unused_data)
                data, inflater = inflater.unused_data, None
                continue
            consumed += len(data) - len(inflater.unconsumed_tail)
            data = inflater.unconsumed_tail
            # A full output may leave more inside zlib although the input is used up: ask again.
            if not data and len(out) < chunk_size:
                break
        nxt = await anext(chunks, None)
        if nxt is None:
            break
        data = nxt
    if inflater is not None:
        raise ArchiveError(
            f"{redact_url(url)}: gzip stream truncated after {consumed} compressed bytes "
            "(the shard was cut short)"
        )
