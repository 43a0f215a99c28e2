"""TarShards: the streaming parser, safety, decoding, shard assignment, and whole epochs through
``asyncload.DataLoader`` over the loopback HTTP server."""

from __future__ import annotations

import io
import json
import pickle
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import asyncload
from asyncload import ArchiveError, AsyncloadWarning
from asyncload.datasets import TarShards, write_shards
from asyncload.datasets._tarstream import expand_urls

from .._http_server import ObjectServer


def make_tar(members: list[tuple[str, bytes]], fmt: int = tarfile.PAX_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def tar_with(info: tarfile.TarInfo, before: list[tuple[str, bytes]] = ()) -> bytes:  # type: ignore[assignment]
    """A tar holding *before* (regular files) and then the special member *info*."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in before:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tar.addfile(ti, io.BytesIO(data))
        tar.addfile(info, io.BytesIO(b"x" * info.size) if info.size else None)
    return buf.getvalue()


def shard_members(first: int, n: int) -> list[tuple[str, bytes]]:
    out = []
    for i in range(first, first + n):
        out += [(f"s/{i:05d}.cls", str(i % 10).encode()), (f"s/{i:05d}.txt", b"t%d" % i * 50)]
    return out


def serve_shards(server: ObjectServer, n_shards: int, per_shard: int) -> list[str]:
    return [
        server.put(f"shards/{s:03d}.tar", make_tar(shard_members(s * per_shard, per_shard)))
        for s in range(n_shards)
    ]


async def collect(ds: TarShards) -> list[dict[str, Any]]:
    it: AsyncIterator[dict[str, Any]] = ds.__aiter__()
    return [s async for s in it]


def keys_of(batches: Any) -> list[str]:
    return [k for b in batches for k in b["__key__"]]


# ── the parser ──────────────────────────────────────────────────────────────────────────────


@pytest.mark.asyncio
@pytest.mark.usefixtures("clean_storage")
@pytest.mark.parametrize("chunk_size", [1, 7, 511, 512, 513, 1 << 20])
async def test_members_grouped_by_key_across_chunk_boundaries(
    http_server: ObjectServer, chunk_size: int
) -> None:
    url = http_server.put(
        "one.tar",
        make_tar(
            [
                ("a/x001.jpg", b"J" * 700),
                ("a/x001.cls", b"3"),
                ("a/x001.seg.png", b"P" * 1024),
                ("a/x002.jpg", b""),
                ("a/x002.cls", b"4"),
                ("README", b"no extension: ignored"),
                ("b.y/x003.txt", b"dot in the folder"),
            ]
        ),
    )
    ds = TarShards([url], shuffle_shards=False, chunk_size=chunk_size)
    samples = await collect(ds)
    assert samples == [
        {
            "__key__": "a/x001",
            "__url__": url,
            "jpg": b"J" * 700,
            "cls": b"3",
            "seg.png": b"P" * 1024,
        },
        {"__key__": "a/x002", "__url__": url, "jpg": b"", "cls": b"4"},
        {"__key__": "b.y/x003", "__url__": url, "txt": b"dot in the folder"},
    ]


@pytest.mark.asyncio
@pytest.mark.usefixtures("clean_storage")
@pytest.mark.parametrize(
    "fmt",
    [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT],
    ids=["pax", "gnu", "ustar"],
)
async def test_long_names(http_server: ObjectServer, fmt: int) -> None:
    # ustar can only split a long path at a slash into prefix/name; pax and GNU take anything.
    folder = "/".join(["d" * 40] * 3)
    key = f"{folder}/sample" if fmt == tarfile.USTAR_FORMAT else f"{folder}/é-{'n' * 120}"
    url = http_server.put("long.tar", make_tar([(f"{key}.bin", b"1"), (f"{key}.json", b"{}")], fmt))
    samples = await collect(TarShards([url], chunk_size=100))
    assert [(s["__key__"], s["bin"], s["json"]) for s in samples] == [(key, b"1", b"{}")]


@pytest.mark.asyncio
@pytest.mark.usefixtures("clean_storage")
async def test_large_member_and_no_end_marker(tmp_path: Path) -> None:
    big = bytes(range(256)) * 4000  # ~1 MB, not a multiple of 512
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in [("k.bin", big), ("k.txt", b"x")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        members_end = tar.offset
    (tmp_path / "a.tar").write_bytes(buf.getvalue())
    # Without the end-of-archive blocks: read, like tarfile and GNU tar, but with a warning
    # (a shard cut short at a member boundary looks just like this).
    (tmp_path / "b.tar").write_bytes(buf.getvalue()[:members_end])
    for name in ("a.tar", "b.tar"):
        ds = TarShards([str(tmp_path / name)], chunk_size=4096)
        if name == "a.tar":
            samples = await collect(ds)
        else:
            with pytest.warns(AsyncloadWarning, match="without tar's end-of-archive block"):
                samples = await collect(ds)
        assert [(s["__key__"], s["bin"] == big, s["txt"]) for s in samples] == [("k", True, b"x")]
        assert ds.shard_stats().unterminated == (name == "b.tar")


@pytest.mark.asyncio
@pytest.mark.usefixtures("clean_storage")
async def test_corrupt_header_names_shard_and_offset(http_server: ObjectServer) -> None:
    good = make_tar(shard_members(0, 3))
    corrupt = bytearray(good)
    second_header = 512 + 512  # member 0 is 1 byte: header + one data block
    corrupt[second_header + 10] ^= 0xFF
    url = http_server.put("bad.tar", bytes(corrupt))
    with pytest.raises(ArchiveError, match=rf"{url}: bad tar header checksum .* offset 1024"):
        await collect(TarShards([url]))


@pytest.mark.asyncio
@pytest.mark.usefixtures("clean_storage")
async def test_truncated_shard_raises_or_skips_by_policy(http_server: ObjectServer) -> None:
    good = make_tar(shard_members(0, 3))
    url = http_server.put("cut.tar", good[: 512 * 8 + 100])  # inside the 5th member's header
    other = http_server.put("ok.tar", make_tar(shard_members(10, 2)))
    with pytest.raises(ArchiveError, match="truncated tar header at offset 4096"):
        await collect(TarShards([url]))
    ds = TarShards([url, other], shuffle_shards=False, handler="skip", shards_in_flight=1)
    keys = [s["__key__"] for s in await collect(ds)]
    # Samples known complete before the cut are kept (s/00001 might have had more members
    # after the cut, so it goes too); the rest of the shard is skipped.
    assert keys == ["s/00000", "s/00010", "s/00011"]


@pytest.mark.asyncio
@pytest.mark.usefixtures("clean_storage")
async def test_credentials_redacted_in_errors_and_samples(http_server: ObjectServer) -> None:
    http_server.put("sig.tar", b"\0" * 100 + b"garbage" * 200)
    url = http_server.url_for("sig.tar") + "?X-Amz-Signature=topsecret"
    with pytest.raises(ArchiveError) as info:
        await collect(TarShards([url]))
    assert "topsecret" not in str(info.value)


# ── safety ──────────────────────────────────────────────────────────────────────────────────


def malicious(kind: str, target: Path) -> bytes:
    if kind == "absolute":
        info = tarfile.TarInfo(str(target / "evil.txt"))
        info.size = 4
    elif kind == "dotdot":
        info = tarfile.TarInfo("../../evil.txt")
        info.size = 4
    elif kind == "symlink":
        info = tarfile.TarInfo("evil.txt")
        info.type, info.linkname = tarfile.SYMTYPE, str(target / "evil.txt")
    elif kind == "hardlink":
        info = tarfile.TarInfo("evil.txt")
        info.type, info.linkname = tarfile.LNKTYPE, "/etc/passwd"
    elif kind == "chardev":
        info = tarfile.TarInfo("evil.dev")
        info.type, info.devmajor, info.devminor = tarfile.CHRTYPE, 1, 3
    elif kind == "blockdev":
        info = tarfile.TarInfo("evil.dev")
        info.type, info.devmajor, info.devminor = tarfile.BLKTYPE, 8, 0
    else:
        info = tarfile.TarInfo("evil.fifo")
        info.type = tarfile.FIFOTYPE
    return tar_with(info, before=[("ok/000.txt", b"fine")])


KINDS = ["absolute", "dotdot", "symlink", "hardlink", "chardev", "blockdev", "fifo"]


@pytest.mark.asyncio
@pytest.mark.usefixtures("clean_storage")
@pytest.mark.parametrize("kind", KINDS)
async def test_malicious_members_rejected(
    http_server: ObjectServer, tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    target = tmp_path / "outside"
    target.mkdir()
    url = http_server.put(f"{kind}.tar", malicious(kind, target))
    with pytest.raises(ArchiveError, match=rf"{url}: unsafe .* at offset \d+"):
        await collect(TarShards([url]))
    # "skip" leaves the unsafe member out and keeps the rest of the shard.
    samples = await collect(TarShards([url], handler="skip"))
    assert [s["__key__"] for s in samples] == ["ok/000"]
    with pytest.warns(AsyncloadWarning, match="unsafe"):
        assert len(await collect(TarShards([url], handler="warn"))) == 1
    # Nothing is ever extracted: no file appeared anywhere near us.
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["outside"]  # noqa: ASYNC240
    assert not (tmp_path.parent / "evil.txt").exists()
    assert not (tmp_path.parent.parent / "evil.txt").exists()


class _Payload:
    """Unpickling this writes a sentinel file: what an attacker's ``.pyd`` member would do."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path(self.path).write_text, ("pwned",))


@pytest.mark.asyncio
@pytest.mark.usefixtures("clean_storage")
async def test_pickle_payload_never_unpickled_by_default(
    http_server: ObjectServer, tmp_path: Path
) -> None:
    sentinel = tmp_path / "sentinel"
    payload = pickle.dumps(_Payload(sentinel))
    url = http_server.put("p.tar", make_tar([("x.pyd", payload), ("x.pth", payload)]))
    for ds in (TarShards([url]), TarShards([url], decoders={"json": json.loads})):
        (sample,) = await collect(ds)
        assert sample["pyd"] == payload
        assert sample["pth"] == payload
    assert not sentinel.exists()
    with pytest.raises(ValueError, match="allow_pickle=True"):
        TarShards([url], decoders={"pyd": pickle.loads})
    # Opting in really does unpickle (which is why it's off by default).
    await collect(TarShards([url], allow_pickle=True, handler="skip"))
    assert sentinel.read_text() == "pwned"


# ── decoding and assignment ─────────────────────────────────────────────────────────────────


@pytest.mark.asyncio
@pytest.mark.usefixtures("clean_storage")
async def test_decoders_and_decode_errors(http_server: ObjectServer) -> None:
    url = http_server.put(
        "d.tar",
        make_tar([("a.cls", b"1"), ("a.json", b'{"x": 1}'), ("b.cls", b"oops"), ("b.json", b"{}")]),
    )
    ds = TarShards([url], decoders={"cls": int, "json": json.loads})
    with pytest.raises(ArchiveError, match="decoding sample 'b'"):
        await collect(ds)
    ds = TarShards([url], decoders={"cls": int, "json": json.loads}, handler="skip")
    assert [(s["cls"], s["json"]) for s in await collect(ds)] == [(1, {"x": 1})]
    ds = TarShards([url], decoders=lambda s: {"k": s["__key__"]}, decode_in_thread=True)
    assert await collect(ds) == [{"k": "a"}, {"k": "b"}]


@pytest.mark.asyncio
@pytest.mark.usefixtures("clean_storage")
async def test_duplicate_member_in_a_sample(http_server: ObjectServer) -> None:
    url = http_server.put("dup.tar", make_tar([("a.cls", b"1"), ("a.cls", b"2")]))
    with pytest.raises(ArchiveError, match=r"duplicate member 'a\.cls'"):
        await collect(TarShards([url]))


def test_expand_urls() -> None:
    assert expand_urls("s3://b/{a,b}-{08..10}.tar") == [
        "s3://b/a-08.tar",
        "s3://b/a-09.tar",
        "s3://b/a-10.tar",
        "s3://b/b-08.tar",
        "s3://b/b-09.tar",
        "s3://b/b-10.tar",
    ]
    assert len(TarShards("http://h/x-{0..99}.tar").urls) == 100


@pytest.mark.parametrize(("n", "world", "workers"), [(10, 1, 3), (10, 2, 2), (7, 3, 1), (12, 2, 3)])
def test_shard_assignment_policy(n: int, world: int, workers: int) -> None:
    ds = TarShards([f"/x/{i}.tar" for i in range(n)], seed=3)
    for epoch in range(3):
        ds.set_epoch(epoch)
        got = [ds.shard_indices(r, world, w, workers) for r in range(world) for w in range(workers)]
        flat = [i for g in got for i in g]
        assert len(flat) == len(set(flat)), "a shard went to two readers"
        if world == 1:
            assert sorted(flat) == list(range(n))
        else:  # equal shards per reader; the leftovers wait for another epoch
            assert {len(g) for g in got} == {n // (world * workers)}
    first = ds.shard_indices(0, 2, 0, 1)
    ds.set_epoch(0)
    assert ds.shard_indices(0, 2, 0, 1) != first or n < 4  # epochs reshuffle
    with pytest.raises(ValueError, match="can't be split evenly"):
        TarShards(["/a.tar", "/b.tar", "/c.tar"]).shard_indices(0, 2, 0, 2)


def test_write_shards_from_a_folder(tmp_path: Path) -> None:
    src = tmp_path / "files"
    for i in range(25):
        (src / f"c{i % 3}").mkdir(parents=True, exist_ok=True)
        (src / f"c{i % 3}/{i:03d}.txt").write_text(f"text {i}")
        (src / f"c{i % 3}/{i:03d}.cls").write_text(str(i % 3))
    paths = write_shards(src, tmp_path / "out", samples_per_shard=10)
    assert [Path(p).name for p in paths] == [
        "shard-000000.tar",
        "shard-000001.tar",
        "shard-000002.tar",
    ]
    with tarfile.open(paths[0]) as tar:
        assert tar.getnames()[:2] == ["c0/000.cls", "c0/000.txt"]
    with pytest.raises(ValueError, match="relative path without"):
        write_shards([{"__key__": "../x", "txt": "a"}], tmp_path / "bad")


# ── whole epochs through the DataLoader ─────────────────────────────────────────────────────


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.usefixtures("no_leaks")
@pytest.mark.parametrize("num_workers", [0, 1, 2, 3])
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_every_sample_once_through_the_loader(http_server: ObjectServer, num_workers: int) -> None:
    urls = serve_shards(http_server, n_shards=7, per_shard=13)
    ds = TarShards(urls, shuffle_buffer=20, decoders={"cls": int}, shards_in_flight=2)
    loader = asyncload.DataLoader(ds, batch_size=8, num_workers=num_workers)
    batches = list(loader)
    keys = keys_of(batches)
    assert sorted(keys) == [f"s/{i:05d}" for i in range(7 * 13)]
    assert all(b["cls"].dtype.is_floating_point is False for b in batches)


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.usefixtures("no_leaks")
def test_same_order_whatever_the_timing_and_new_order_per_epoch(http_server: ObjectServer) -> None:
    urls = serve_shards(http_server, n_shards=8, per_shard=12)
    http_server.jitter = 0.03  # every request 0–30 ms: shards complete in a random order

    def epoch_keys(epoch: int, persistent_loader: Any = None) -> list[str]:
        ds = TarShards(urls, shuffle_buffer=16, seed=7, shards_in_flight=3, chunk_size=600)
        loader = persistent_loader
        if loader is None:
            loader = asyncload.DataLoader(ds, batch_size=5, num_workers=2)
        loader.set_epoch(epoch)
        return keys_of(loader)

    first = epoch_keys(0)
    assert sorted(first) == [f"s/{i:05d}" for i in range(96)]
    assert epoch_keys(0) == first
    second = epoch_keys(1)
    assert second != first
    assert sorted(second) == sorted(first)
    # Persistent workers receive the new epoch too.
    ds = TarShards(urls, shuffle_buffer=16, seed=7, shards_in_flight=3, chunk_size=600)
    loader = asyncload.DataLoader(ds, batch_size=5, num_workers=2, persistent_workers=True)
    assert epoch_keys(0, loader) == first
    assert epoch_keys(1, loader) == second
    del loader


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.usefixtures("no_leaks")
def test_samples_per_rank_gives_equal_batches(
    http_server: ObjectServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Uneven shards (5 × 10 samples and one of 3) over 2 ranks simulated with RANK/WORLD_SIZE.
    urls = serve_shards(http_server, n_shards=5, per_shard=10)
    urls.append(http_server.put("shards/tail.tar", make_tar(shard_members(900, 3))))
    seen: list[list[str]] = []
    for rank in range(2):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        ds = TarShards(urls, samples_per_rank=25, seed=1)
        loader = asyncload.DataLoader(ds, batch_size=4, num_workers=2)
        batches = list(loader)
        assert len(batches) == 7  # 13 + 12 samples from its two workers: 4 + 3 batches
        seen.append(keys_of(batches))
    assert [len(k) for k in seen] == [25, 25]
    assert not set(seen[0]) & set(seen[1])
