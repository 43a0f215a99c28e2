"""write_shards: which files of a folder become samples, the summary, and writing straight to an
object store (moto's S3 on loopback)."""

from __future__ import annotations

import asyncio
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import pytest

from asyncload import StorageError
from asyncload._storage import api as _storage
from asyncload.datasets import ShardSummary, TarShards, write_shards

from .._s3_server import ACCESS_KEY, REGION, SECRET_KEY, S3Server
from .test_tar import collect


def make_folder(root: Path) -> Path:
    for i in range(6):
        (root / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        (root / f"c{i % 2}/{i:03d}.txt").write_text(f"text {i}")
        (root / f"c{i % 2}/{i:03d}.cls").write_text(str(i % 2))
        (root / f"c{i % 2}/{i:03d}.TMP").write_text("scratch")
    (root / "manifest.txt").write_text("c0/000.txt\n...")
    (root / "c0/manifest.txt").write_text("nested listing")
    (root / "README").write_text("no extension")
    return root


def members(paths: Any) -> list[str]:
    names: list[str] = []
    for p in paths:
        with tarfile.open(p) as tar:
            names += tar.getnames()
    return names


def test_manifest_is_not_a_sample_and_the_summary_says_what_was_left_out(tmp_path: Path) -> None:
    src = make_folder(tmp_path / "files")
    summary = write_shards(src, tmp_path / "out", samples_per_shard=4, exclude=["*.tmp"])
    assert isinstance(summary, ShardSummary)
    # Still the sequence of shard paths it always returned.
    assert [Path(p).name for p in summary] == ["shard-000000.tar", "shard-000001.tar"]
    assert len(summary) == 2
    assert summary[0] == summary.paths[0]
    names = members(summary)
    assert "manifest.txt" in names  # an exclude of your own replaces the default
    assert not any(n.endswith(".TMP") for n in names)  # "*.tmp" matched in any letter case
    default = write_shards(src, tmp_path / "out2", samples_per_shard=4)
    names = members(default)
    assert not any("manifest" in n for n in names)
    assert (default.samples, default.files) == (6, 18)  # txt, cls and TMP of each sample
    assert dict(default.left_out) == {
        "manifest.txt": "excluded",
        "c0/manifest.txt": "excluded",
        "README": "no extension",
    }
    assert default.bytes == sum(Path(p).stat().st_size for p in default)
    text = str(default)
    assert text.startswith(f"wrote 2 shards to {tmp_path / 'out2'} (6 samples, 18 files, ")
    assert "left out 3 files: " in text
    assert "manifest.txt (excluded)" in text


def test_include_selects_files(tmp_path: Path) -> None:
    src = make_folder(tmp_path / "files")
    summary = write_shards(src, tmp_path / "out", include=["*.txt", "c1/*.cls"])
    names = members(summary)
    assert sorted(names) == sorted(
        [f"c{i % 2}/{i:03d}.txt" for i in range(6)] + [f"c1/{i:03d}.cls" for i in (1, 3, 5)]
    )
    reasons = dict(summary.left_out)
    assert reasons["c0/000.cls"] == "not included"
    assert reasons["manifest.txt"] == "excluded"  # matched by include, left out by exclude


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="select files of a folder"):
        write_shards([{"__key__": "a", "txt": "x"}], tmp_path / "o", include="*.txt")
    with pytest.raises(ValueError, match=r"local folder or to s3://, gs://, az://; got http://"):
        write_shards([{"__key__": "a", "txt": "x"}], "http://127.0.0.1:1/shards")
    empty = write_shards([], tmp_path / "none")
    assert (len(empty), str(empty)) == (0, "wrote 0 shards to nowhere (0 samples, 0 files, 0 B)")


@pytest.mark.usefixtures("clean_storage")
def test_write_straight_to_s3_and_read_back(s3_server: S3Server) -> None:
    bucket = s3_server.bucket("asyncload-write")
    _storage.configure(
        bucket,
        endpoint=s3_server.endpoint,
        region=REGION,
        credentials={"access_key_id": ACCESS_KEY, "secret_access_key": SECRET_KEY},
    )
    summary = write_shards(
        ({"__key__": f"{i:04d}", "txt": f"sample {i}", "cls": i % 3} for i in range(25)),
        f"{bucket}/train/",
        samples_per_shard=10,
    )
    assert list(summary) == [f"{bucket}/train/shard-{i:06d}.tar" for i in range(3)]
    assert str(summary).startswith(f"wrote 3 shards to {bucket}/train (25 samples, 50 files")
    listed = s3_server.client().list_objects_v2(Bucket="asyncload-write", Prefix="train/")
    assert sorted(o["Key"] for o in listed["Contents"]) == [
        f"train/shard-{i:06d}.tar" for i in range(3)
    ]
    assert sum(o["Size"] for o in listed["Contents"]) == summary.bytes
    got = asyncio.run(collect(TarShards(list(summary), decoders={"cls": int})))
    assert sorted((s["__key__"], s["cls"]) for s in got) == [(f"{i:04d}", i % 3) for i in range(25)]
    # The local copies were temporary.
    assert not list(Path(tempfile.gettempdir()).glob("asyncload-shards-*"))


@pytest.mark.usefixtures("clean_storage")
def test_upload_to_a_missing_bucket_names_it(s3_server: S3Server) -> None:
    _storage.configure("s3://", endpoint=s3_server.endpoint, region=REGION)
    with pytest.raises(StorageError, match=r"s3://no-such-bucket-asyncload/x/shard-000000\.tar"):
        write_shards([{"__key__": "a", "txt": "x"}], "s3://no-such-bucket-asyncload/x")
