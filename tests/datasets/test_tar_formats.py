"""TarShards and shards as people have them: gzip-compressed, named by brace patterns, with
extensions in any letter case, and incomplete ones (empty, cut short) reported, not hidden."""

from __future__ import annotations

import asyncio
import gzip
import io
import pickle
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import asyncload
from asyncload import ArchiveError, AsyncloadWarning
from asyncload.datasets import TarShards
from asyncload.datasets._gzip import maybe_gunzip
from asyncload.datasets._tarstream import expand_urls

from .._http_server import ObjectServer
from .test_tar import collect, keys_of, make_tar, shard_members


def as_tuples(samples: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [tuple(sorted((k, v) for k, v in s.items() if k != "__url__")) for s in samples]


# ── .tar.gz / .tgz ──────────────────────────────────────────────────────────────────────────


@pytest.mark.asyncio
@pytest.mark.usefixtures("clean_storage")
@pytest.mark.parametrize("chunk_size", [7, 512, 4099, 1 << 20])
@pytest.mark.parametrize("suffix", [".tar.gz", ".tgz", ".TAR.GZ"])
async def test_gzip_shards_give_the_same_samples_as_tar(
    http_server: ObjectServer, chunk_size: int, suffix: str
) -> None:
    plain, packed = [], []
    for s in range(3):
        data = make_tar(shard_members(s * 20, 20))
        plain.append(http_server.put(f"gz/{s}.tar", data))
        packed.append(http_server.put(f"gz/{s}{suffix}", gzip.compress(data, compresslevel=6)))
    kw: dict[str, Any] = {"shuffle_shards": False, "chunk_size": chunk_size}
    want = await collect(TarShards(plain, **kw))
    got = await collect(TarShards(packed, **kw))
    assert len(want) == 60
    assert as_tuples(got) == as_tuples(want)
    assert got[0]["__url__"].endswith(suffix)


@pytest.mark.asyncio
@pytest.mark.usefixtures("clean_storage")
async def test_gzip_recognised_by_its_bytes_and_concatenated_members(
    http_server: ObjectServer,
) -> None:
    data = make_tar(shard_members(0, 10))
    half = len(data) // 2
    # `cat a.gz b.gz` of one tar split in two: gzip -d reads it as one stream, and so do we.
    two = gzip.compress(data[:half]) + gzip.compress(data[half:])
    url = http_server.put("gz/misnamed.tar", two)
    got = await collect(TarShards([url], chunk_size=100))
    assert [s["__key__"] for s in got] == [f"s/{i:05d}" for i in range(10)]


@pytest.mark.asyncio
@pytest.mark.usefixtures("clean_storage")
async def test_truncated_or_corrupt_gzip_shard_raises_or_is_skipped(
    http_server: ObjectServer,
) -> None:
    packed = gzip.compress(make_tar(shard_members(0, 30)))
    cut = http_server.put("gz/cut.tar.gz", packed[: len(packed) - 40])
    with pytest.raises(ArchiveError, match=r"cut\.tar\.gz: gzip stream truncated"):
        await collect(TarShards([cut]))
    bad = http_server.put("gz/bad.tgz", b"this is not gzip at all" * 10)
    with pytest.raises(ArchiveError, match=r"bad\.tgz: not valid gzip data"):
        await collect(TarShards([bad]))
    good = http_server.put("gz/good.tar.gz", gzip.compress(make_tar(shard_members(100, 5))))
    got = await collect(TarShards([cut, good], handler="skip", shuffle_shards=False))
    # The truncated shard gives what came before the cut; the good one gives everything.
    keys = [s["__key__"] for s in got]
    assert [f"s/{i:05d}" for i in range(100, 105)] == [k for k in keys if k >= "s/00100"]


@pytest.mark.asyncio
async def test_decompressed_chunks_stay_bounded() -> None:
    # 8 MB of zeros compress to a few KB: one chunk in must not become one 8 MB buffer.
    raw = bytes(8 << 20)
    packed = gzip.compress(raw)

    async def chunks() -> AsyncIterator[bytes]:
        yield packed

    sizes = [len(c) async for c in maybe_gunzip(chunks(), "x.tar.gz", 64 << 10)]
    assert sum(sizes) == len(raw)
    assert max(sizes) <= 64 << 10


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.usefixtures("no_leaks")
def test_mixed_tar_and_gzip_shards_through_the_loader(http_server: ObjectServer) -> None:
    urls = []
    for s in range(6):
        data = make_tar(shard_members(s * 11, 11))
        name, body = (f"mix/{s}.tgz", gzip.compress(data)) if s % 2 else (f"mix/{s}.tar", data)
        urls.append(http_server.put(name, body))
    ds = TarShards(urls, shuffle_buffer=10, decoders={"cls": int}, chunk_size=1000)
    keys = keys_of(asyncload.DataLoader(ds, batch_size=8, num_workers=2))
    assert sorted(keys) == [f"s/{i:05d}" for i in range(66)]


# ── brace patterns ──────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize(
    ("pattern", "want"),
    [
        ("/d/{000..002}.tar", ["/d/000.tar", "/d/001.tar", "/d/002.tar"]),  # padding kept
        ("/d/{0..10..5}.tar", ["/d/0.tar", "/d/5.tar", "/d/10.tar"]),  # steps
        ("/d/{a..c}.tar", ["/d/a.tar", "/d/b.tar", "/d/c.tar"]),  # letters
        ("/d/{train-{0..1},val}.tar", ["/d/train-0.tar", "/d/train-1.tar", "/d/val.tar"]),
        ("/a/{0..1}.tar::/b/{x,y}.tar", ["/a/0.tar", "/a/1.tar", "/b/x.tar", "/b/y.tar"]),
        ("s3://b/{08..10}.tar", ["s3://b/08.tar", "s3://b/09.tar", "s3://b/10.tar"]),
        ("http://[::1]:8000/{0..1}.tar", ["http://[::1]:8000/0.tar", "http://[::1]:8000/1.tar"]),
        ("/d/plain.tar", ["/d/plain.tar"]),
    ],
)
def test_brace_patterns_as_webdataset_reads_them(pattern: str, want: list[str]) -> None:
    assert expand_urls(pattern) == want
    assert TarShards(pattern).urls == want


def test_brace_pattern_errors_name_the_pattern() -> None:
    with pytest.raises(ValueError, match=r"shard pattern '/d/\{0\.\.3\.tar'"):
        TarShards("/d/{0..3.tar")


# ── extensions in any letter case ───────────────────────────────────────────────────────────


class _Sentinel:
    """Unpickling it writes a file: proof that a pickle ran."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path(self.path).write_text, ("pwned",))


@pytest.mark.parametrize("ext", ["PKL", "Pickle", "seg.PTH"])
def test_upper_case_pickle_decoder_is_refused(ext: str) -> None:
    with pytest.raises(ValueError, match="need allow_pickle=True"):
        TarShards(["/d/0.tar"], decoders={ext: pickle.loads})


@pytest.mark.asyncio
async def test_upper_case_pickle_member_stays_bytes_unless_allowed(tmp_path: Path) -> None:
    sentinel = tmp_path / "ran"
    payload = pickle.dumps(_Sentinel(str(sentinel)))
    shard = tmp_path / "p.tar"
    shard.write_bytes(make_tar([("k.PKL", payload), ("k.CLS", b"3")]))
    [sample] = await collect(TarShards([str(shard)], decoders={"cls": int}))
    assert sample["PKL"] == payload
    assert sample["CLS"] == 3  # the decoder matched in any letter case
    assert not sentinel.exists()
    [sample] = await collect(TarShards([str(shard)], allow_pickle=True))
    assert sentinel.read_text() == "pwned"  # allowed: the upper-case member is unpickled too


# ── incomplete shards: a warning and a count ────────────────────────────────────────────────


@pytest.mark.asyncio
@pytest.mark.usefixtures("clean_storage")
async def test_empty_shards_warn_and_are_counted(http_server: ObjectServer) -> None:
    empty = http_server.put("inc/empty.tar", b"")
    no_samples = http_server.put("inc/none.tar", make_tar([]))  # just the end-of-archive blocks
    good = http_server.put("inc/good.tar", make_tar(shard_members(0, 4)))
    ds = TarShards([empty, no_samples, good], shuffle_shards=False)
    with pytest.warns(AsyncloadWarning) as caught:
        got = await collect(ds)
    assert len(got) == 4
    messages = sorted(str(w.message) for w in caught)
    assert len(messages) == 2, messages
    assert any(f"shard {empty} is empty (0 bytes)" in m for m in messages)
    assert any(f"shard {no_samples} holds no sample, only tar's end" in m for m in messages)
    stats = ds.shard_stats()
    assert (stats.shards, stats.empty, stats.unterminated, stats.suspect) == (3, 2, 0, 2)


@pytest.mark.asyncio
@pytest.mark.usefixtures("clean_storage")
async def test_shard_cut_at_a_member_boundary_warns(http_server: ObjectServer) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for i, (name, data) in enumerate(shard_members(0, 6)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
            if i == 5:  # after sample 2's last member: the cut falls on a boundary
                boundary = tar.offset
    url = http_server.put("inc/cut.tar", buf.getvalue()[:boundary])
    ds = TarShards([url])
    with pytest.warns(AsyncloadWarning, match=r"cut\.tar ended after \d+ bytes without tar's"):
        got = await collect(ds)
    assert [s["__key__"] for s in got] == ["s/00000", "s/00001", "s/00002"]
    assert ds.shard_stats().unterminated == 1


@pytest.mark.asyncio
@pytest.mark.usefixtures("clean_storage")
async def test_incomplete_shard_fails_when_warnings_are_errors(http_server: ObjectServer) -> None:
    # pytest runs with filterwarnings=error: the warning must surface, not hang the reader.
    url = http_server.put("inc/empty2.tar", b"")
    with pytest.raises(AsyncloadWarning, match="is empty"):
        await asyncio.wait_for(collect(TarShards([url])), 20)


@pytest.mark.usefixtures("clean_storage")
@pytest.mark.filterwarnings("ignore:TarShards. shard:asyncload.AsyncloadWarning")
def test_counts_observable_after_a_pass_in_the_loaders_process(http_server: ObjectServer) -> None:
    # num_workers=0 reads in this process, so the dataset's own counts are the pass's counts.
    urls = [
        http_server.put("inc3/empty.tar", b""),
        http_server.put("inc3/good.tar", make_tar(shard_members(0, 5))),
    ]
    ds = TarShards(urls)
    keys = keys_of(asyncload.DataLoader(ds, batch_size=2, num_workers=0))
    assert sorted(keys) == [f"s/{i:05d}" for i in range(5)]
    assert ds.shard_stats() == asyncload.ShardStats(shards=2, empty=1, unterminated=0)
