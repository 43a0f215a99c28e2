"""A streaming tar reader over async byte chunks: headers parsed as bytes arrive, nothing on disk.

``tarfile`` wants a seekable file (or a blocking stream), and extracting is exactly what a data
loader must never do with untrusted shards. This reader understands the subset of tar that shards
use — ustar, GNU (long names ``L``/``K``, base-256 sizes) and POSIX pax (``x``/``g`` records for
long paths and large sizes) — and hands out members as ``Member`` in archive
order. Every other member kind is reported, not acted on, so the caller decides its policy::

    chunks ──► _Buffer ──► 512-byte header ──► pax/GNU extensions ──► Member(name, kind, data)

A corrupt header (bad checksum, bad number) or a stream that ends inside a header or a member
raises ``ArchiveError`` naming the shard (redacted) and the byte offset. A stream
that ends *between* members without tar's end-of-archive blocks is not an error (tarfile and GNU
tar accept it) but is reported through ``Ending``, so the caller can warn: it is what a
shard cut short at a member boundary looks like.

Also here, the small pieces ``TarShards`` builds samples with: ``split_name`` (WebDataset's
key/extension rule), ``expand_urls`` (brace patterns) and ``Channel`` (one shard's
parsed samples on their way to the interleaver).
"""

from __future__ import annotations

import asyncio
import collections
import re
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

from braceexpand import braceexpand

from .._exceptions import ArchiveError
from .._redact import redact_url

__all__ = [
    "BLOCK",
    "END",
    "Channel",
    "Ending",
    "Failed",
    "Member",
    "expand_urls",
    "iter_members",
    "split_name",
    "unsafe_reason",
]

BLOCK = 512

# Member kinds by type flag. Regular files are the only ones that carry sample data.
_KINDS = {
    b"0": "file",
    b"\0": "file",
    b"7": "file",  # contiguous file: a regular file everywhere that matters
    b"1": "hardlink",
    b"2": "symlink",
    b"3": "character device",
    b"4": "block device",
    b"5": "directory",
    b"6": "fifo",
}
_GNU_MAGIC = b"ustar  \0"
# "::" joins patterns, except inside an IPv6 host literal such as http://[::1]:8000/.
_JOIN = re.compile(r"::(?![^\[]*\])")
END = object()
"""The last item of a ``Channel`` whose shard was read to the end."""


@dataclass(frozen=True, slots=True)
class Member:
    """One tar member: its path, its kind (``"file"``, ``"symlink"``, ...), its data and where
    its header starts in the shard."""

    name: str
    kind: str
    data: bytes
    offset: int


@dataclass(slots=True)
class Ending:
    """How a tar stream ended, filled in by ``iter_members`` as it reads.

    ``marker``: tar's end-of-archive block was read (every tar writer writes it, so a shard
    without it was most likely cut short). ``size``: bytes of the archive read.
    """

    marker: bool = False
    size: int = 0


class _Buffer:
    """Bytes from an async chunk iterator, read by exact lengths.

    A read that falls inside the current chunk is one slice (one copy); one that spans chunks
    joins the pieces. Nothing is appended to a growing buffer, so large members cost no
    quadratic copying and small ones no per-read reallocation.
    """

    __slots__ = ("_chunk", "_chunks", "_off", "consumed")

    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self._chunks = chunks
        self._chunk = memoryview(b"")
        self._off = 0
        self.consumed = 0  # bytes handed out so far: the shard offset of the next byte

    async def skip(self, n: int) -> int:
        """Pass over *n* bytes without copying them; returns how many there were."""
        end = self._off + n
        if end <= len(self._chunk):  # the common case: block padding inside the chunk
            self._off = end
            self.consumed += n
            return n
        return len(await self.read(n))

    async def read(self, n: int) -> bytes:
        """Exactly *n* bytes, or fewer only at the end of the stream."""
        end = self._off + n
        if end <= len(self._chunk):
            out = bytes(self._chunk[self._off : end])
            self._off = end
            self.consumed += n
            return out
        parts = [self._chunk[self._off :]]
        have = len(parts[0])
        self._chunk, self._off = memoryview(b""), 0
        while have < n:
            try:
                chunk = memoryview(await anext(self._chunks)).cast("B")
            except StopAsyncIteration:
                break
            need = n - have
            if len(chunk) > need:
                parts.append(chunk[:need])
                self._chunk, self._off = chunk, need
                have = n
            else:
                parts.append(chunk)
                have += len(chunk)
        out = b"".join(parts)
        self.consumed += len(out)
        return out


def _error(url: str, offset: int, what: str) -> ArchiveError:
    return ArchiveError(f"{redact_url(url)}: {what} at offset {offset}")


def _number(field: bytes, url: str, offset: int) -> int:
    if field and field[0] & 0x80:  # GNU base-256: big-endian, high bit of the first byte set
        value = int.from_bytes(field, "big", signed=False) & ~(0x80 << (8 * (len(field) - 1)))
        if field[0] & 0x40:  # negative numbers never describe a size we accept
            raise _error(url, offset, "negative base-256 number in tar header")
        return value
    text = field.partition(b"\0")[0].strip(b" ")
    if not text:
        return 0
    try:
        return int(text, 8)
    except ValueError:
        raise _error(url, offset, f"bad octal number {text!r} in tar header") from None


def _checksum_ok(header: bytes, stored: int) -> bool:
    # The checksum field counts as eight spaces. Old tars summed signed bytes: accept both.
    unsigned = sum(header) - sum(header[148:156]) + 8 * 32
    if unsigned == stored:
        return True
    signed = sum(b - 256 if b > 127 else b for b in header[:148] + header[156:]) + 8 * 32
    return signed == stored


def _text(field: bytes) -> str:
    return field.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def _pax_records(data: bytes, url: str, offset: int) -> dict[str, str]:
    """Parse ``"<len> <key>=<value>\\n"`` records."""
    records: dict[str, str] = {}
    pos = 0
    while pos < len(data) and data[pos : pos + 1] not in (b"", b"\0"):
        space = data.find(b" ", pos)
        try:
            length = int(data[pos:space])
        except ValueError:
            raise _error(url, offset, "bad pax record length") from None
        if space < 0 or length <= 0 or pos + length > len(data):
            raise _error(url, offset, "bad pax record length")
        record = data[space + 1 : pos + length]
        key, eq, value = record.rstrip(b"\n").partition(b"=")
        if not eq:
            raise _error(url, offset, "bad pax record")
        records[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return records


def unsafe_reason(member: Member) -> str | None:
    """Why *member* must not be trusted (a link, a device, an escaping path), else ``None``.

    Nothing is ever extracted, but a shard that holds such members was not written by a shard
    writer, and the names end up in sample keys that users may well join to a directory.
    """
    if member.kind not in ("file", "directory"):
        return f"{member.kind} member {member.name!r}"
    name = member.name
    if not name or "\0" in name:
        return f"empty or NUL-containing member name {name!r}"
    if name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":"):
        return f"absolute member path {name!r}"
    if ".." in name and ".." in name.replace("\\", "/").split("/"):
        return f"member path {name!r} escapes the archive with '..'"
    return None


async def iter_members(
    chunks: AsyncIterator[bytes], url: str, ending: Ending | None = None
) -> AsyncGenerator[Member, None]:
    """Yield every member of the tar stream *chunks* (read from *url*) in archive order.

    Pax and GNU extension headers are folded into the member they describe. Directories,
    links, devices and fifos are yielded with empty data; their policy is the caller's. When
    the stream is done, *ending* (if given) says whether it ended with tar's end-of-archive
    block and how many bytes were read.

    Raises:
        ArchiveError: A header checksum or number is invalid, the stream ends inside a header or
            a member, or the member type is not supported (sparse files, volume headers).
    """
    buf = _Buffer(chunks)
    global_pax: dict[str, str] = {}
    pax: dict[str, str] = {}
    long_name: str | None = None
    while True:
        offset = buf.consumed
        header = await buf.read(BLOCK)
        if ending is not None:
            ending.size = buf.consumed
        if not header:
            return  # no end-of-archive blocks: tolerated, as tarfile and GNU tar do
        if len(header) < BLOCK:
            raise _error(url, offset, "truncated tar header")
        if header[0] == 0 and header.count(0) == BLOCK:  # a real header starts with its name
            if ending is not None:
                ending.marker = True
            return  # end-of-archive marker; whatever padding follows is not read
        if not _checksum_ok(header, _number(header[148:156], url, offset)):
            raise _error(url, offset, "bad tar header checksum (corrupt shard or not a tar)")
        flag = header[156:157]
        size = _number(header[124:136], url, offset)
        if "size" in pax and flag not in (b"x", b"g", b"L", b"K"):
            try:  # pax records the real size of members too large for the octal field
                size = int(pax["size"])
            except ValueError:
                raise _error(url, offset, "bad pax size") from None
            if size < 0:
                raise _error(url, offset, "negative pax size")
        data = await buf.read(size)
        if len(data) < size:
            raise _error(url, offset, f"tar member truncated ({len(data)} of {size} bytes)")
        padding = -size % BLOCK
        if padding and await buf.skip(padding) < padding:
            raise _error(url, offset, "tar member padding truncated")

        if flag in (b"x", b"g"):
            records = _pax_records(data, url, offset)
            (pax if flag == b"x" else global_pax).update(records)
            continue
        if flag == b"L":  # GNU long name: the data is the next member's path
            long_name = data.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            continue
        if flag == b"K":  # GNU long link target: irrelevant, links are refused anyway
            continue
        kind = _KINDS.get(flag)
        if kind is None:
            raise _error(url, offset, f"unsupported tar member type {flag!r}")

        name = _text(header[0:100])
        if header[257:265] != _GNU_MAGIC and header[257:262] == b"ustar":
            prefix = _text(header[345:500])
            if prefix:
                name = f"{prefix}/{name}"
        if long_name is not None:
            name = long_name
        name = pax.get("path", global_pax.get("path", name))
        pax, long_name = {}, None
        yield Member(name, kind, data if kind == "file" else b"", offset)


# ── naming and moving samples ───────────────────────────────────────────────────────────────


def expand_urls(pattern: str) -> list[str]:
    """Expand a shard pattern as WebDataset does: ``::`` separates patterns, each brace-expanded.

    Brace expansion is the ``braceexpand`` package's (bash rules): ``{000..099}`` ranges keep
    their zero padding, ``{0..98..2}`` steps, ``{a..e}`` letters, ``{a,b}`` lists, and braces
    nest (``{train-{0..1},val}``). ``\\{`` and ``\\}`` are literal braces.

    Examples:
        >>> expand_urls("s3://bucket/train-{00..02}.tar")
        ['s3://bucket/train-00.tar', 's3://bucket/train-01.tar', 's3://bucket/train-02.tar']
        >>> expand_urls("/a/{0..4..2}.tar::/b/x.tar")
        ['/a/0.tar', '/a/2.tar', '/a/4.tar', '/b/x.tar']
    """
    urls: list[str] = []
    for part in _JOIN.split(pattern):
        if part:
            try:
                urls.extend(braceexpand(part))
            except Exception as exc:  # UnbalancedBracesError and its kin
                raise ValueError(f"shard pattern {redact_url(part)!r}: {exc}") from None
    return urls


def split_name(name: str) -> tuple[str, str] | None:
    # WebDataset convention: the key runs up to the first dot of the basename, the rest is the
    # field ("a/b/img001.seg.png" → "a/b/img001", "seg.png").
    slash = name.rfind("/") + 1
    dot = name.find(".", slash)
    if dot <= slash:
        return None  # no extension (or a dot-file): no field to put it in
    return name[:dot], name[dot + 1 :]


class Failed:
    """The last item of a ``Channel`` whose producer failed; ``handled``: the error
    policy was already applied."""

    __slots__ = ("exc", "handled")

    def __init__(self, exc: Exception, handled: bool) -> None:
        self.exc, self.handled = exc, handled


class Channel:
    """One shard's parsed samples on their way to the interleaver, bounded in bytes and count.

    One producer, one consumer, both on the worker's loop; the last item is ``END`` or a
    ``Failed``.
    """

    def __init__(self, max_bytes: int, max_items: int = 256) -> None:
        self._items: collections.deque[tuple[object, int]] = collections.deque()
        self._bytes = 0
        self._max_bytes, self._max_items = max_bytes, max_items
        self._ready, self._space = asyncio.Event(), asyncio.Event()

    async def put(self, item: object, nbytes: int) -> None:
        # Always admit one item, however large, so a huge sample can't stall its shard forever.
        while self._items and (
            self._bytes >= self._max_bytes or len(self._items) >= self._max_items
        ):
            self._space.clear()
            await self._space.wait()
        self._push(item, nbytes)

    def _push(self, item: object, nbytes: int) -> None:
        self._items.append((item, nbytes))
        self._bytes += nbytes
        self._ready.set()

    def close(self) -> None:
        self._push(END, 0)

    def fail(self, exc: Exception, *, handled: bool) -> None:
        self._push(Failed(exc, handled), 0)

    async def get(self) -> object:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        item, nbytes = self._items.popleft()
        self._bytes -= nbytes
        self._space.set()
        return item
