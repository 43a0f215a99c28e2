"""RemoteFiles: its URL storage, decode paths, and a DataLoader epoch from every backend."""

from __future__ import annotations

import asyncio
import pickle
import threading
from pathlib import Path

import numpy as np
import pytest

import asyncload
from asyncload._storage import api as _storage
from asyncload.datasets import RemoteFiles

from .._http_server import ObjectServer
from .._s3_server import ACCESS_KEY, REGION, SECRET_KEY, S3Server

pytestmark = pytest.mark.usefixtures("clean_storage")

N = 40


def payload(i: int) -> bytes:
    return f"object {i:04d} ".encode() * (i % 7 + 1)


def decode_upper(data: bytes) -> bytes:
    return data.upper()


def test_urls_live_in_numpy_arrays_not_python_strings() -> None:
    urls = [f"s3://bucket/key/{i:07d}.jpg" for i in range(1000)]
    ds = RemoteFiles(urls)
    assert len(ds) == 1000
    assert ds.url(0) == urls[0]
    assert ds.url(-1) == urls[-1]
    arrays = [v for v in vars(ds).values() if isinstance(v, np.ndarray)]
    assert len(arrays) == 2
    assert all(a.dtype != object for a in arrays)
    assert not any(isinstance(v, (list, tuple)) for v in vars(ds).values())
    with pytest.raises(IndexError):
        ds.url(1000)
    back = pickle.loads(pickle.dumps(ds))
    assert back.urls == urls


def test_non_ascii_urls_and_numpy_input() -> None:
    urls = np.array(["file:///data/é/1", "file:///data/日本/2"])
    ds = RemoteFiles(urls)
    assert ds.urls == list(urls)


def test_repr_redacts() -> None:
    ds = RemoteFiles(["https://u:pw@host/a?sig=zz"])
    assert "pw" not in repr(ds)
    assert "zz" not in repr(ds)


def test_a_single_string_is_refused() -> None:
    with pytest.raises(TypeError, match="sequence"):
        RemoteFiles("s3://bucket/key")  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_getitem_reads_and_decodes(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"abc")
    ds = RemoteFiles([str(tmp_path / "a")], decode=decode_upper)
    assert await ds[0] == b"ABC"
    assert await RemoteFiles([str(tmp_path / "a")])[0] == b"abc"


@pytest.mark.asyncio
async def test_decode_in_thread_runs_off_the_loop(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"abc")
    loop_thread = threading.get_ident()
    seen: list[int] = []

    def decode(data: bytes) -> int:
        seen.append(threading.get_ident())
        return len(data)

    ds = RemoteFiles([str(tmp_path / "a")], decode=decode, decode_in_thread=True)
    assert await ds[0] == 3
    assert seen
    assert seen[0] != loop_thread
    ds_inline = RemoteFiles([str(tmp_path / "a")], decode=decode)
    assert await ds_inline[0] == 3
    assert seen[1] == loop_thread
    await asyncio.sleep(0)


def test_from_prefix(tmp_path: Path) -> None:
    for i in range(3):
        (tmp_path / f"{i}.bin").write_bytes(payload(i))
    ds = RemoteFiles.from_prefix(str(tmp_path))
    assert ds.urls == [str(tmp_path / f"{i}.bin") for i in range(3)]


def run_epoch(ds: RemoteFiles) -> list[bytes]:
    loader = asyncload.DataLoader(ds, batch_size=8, num_workers=2, collate_fn=list)
    return [sample for batch in loader for sample in batch]


def check_epoch(got: list[bytes]) -> None:
    assert len(got) == N
    assert sorted(got) == sorted(payload(i) for i in range(N))
    assert got == [payload(i) for i in range(N)]  # in order, each exactly once


@pytest.mark.slow
@pytest.mark.usefixtures("no_leaks")
def test_epoch_over_http(http_server: ObjectServer) -> None:
    urls = [http_server.put(f"rf/{i:04d}", payload(i)) for i in range(N)]
    http_server.latency = 0.01
    check_epoch(run_epoch(RemoteFiles(urls)))
    assert sum(http_server.hits.values()) == N


@pytest.mark.slow
@pytest.mark.usefixtures("no_leaks")
def test_epoch_over_local_files(tmp_path: Path) -> None:
    for i in range(N):
        (tmp_path / f"{i:04d}.bin").write_bytes(payload(i))
    check_epoch(run_epoch(RemoteFiles.from_prefix("file://" + str(tmp_path))))


@pytest.mark.slow
@pytest.mark.usefixtures("no_leaks")
def test_epoch_over_s3(s3_server: S3Server) -> None:
    bucket = s3_server.bucket("asyncload-epoch", {f"rf/{i:04d}": payload(i) for i in range(N)})
    # Settings travel to the workers with the loader, whatever their environment holds.
    _storage.configure(
        bucket,
        endpoint=s3_server.endpoint,
        region=REGION,
        credentials={"access_key_id": ACCESS_KEY, "secret_access_key": SECRET_KEY},
    )
    urls = [f"{bucket}/rf/{i:04d}" for i in range(N)]
    check_epoch(run_epoch(RemoteFiles(urls)))


# ── decode(data, *, url, index): labels from paths ──────────────────────────────────────────


def label_from_folder(data: bytes, *, url: str) -> tuple[bytes, str]:
    return data, url.rsplit("/", 2)[-2]


def with_index(data: bytes, index: int) -> tuple[int, int]:
    return index, len(data)


def with_both(data: bytes, *, index: int, url: str) -> str:
    return f"{index}:{url.rsplit('/', 1)[-1]}:{data.decode()}"


def only_kwargs(data: bytes, **kwargs: object) -> object:
    # A decoder taking **kwargs (json.loads does) must not be handed url=/index=.
    assert not kwargs, kwargs
    return data


@pytest.mark.asyncio
async def test_decode_gets_the_url_and_index_it_names(tmp_path: Path) -> None:
    urls = []
    for i, cls in enumerate(["cat", "dog", "cat"]):
        (tmp_path / cls).mkdir(exist_ok=True)
        (tmp_path / cls / f"{i}.bin").write_bytes(b"x%d" % i)
        urls.append(str(tmp_path / cls / f"{i}.bin"))
    assert await RemoteFiles(urls, decode=label_from_folder)[1] == (b"x1", "dog")
    assert await RemoteFiles(urls, decode=with_index)[2] == (2, 2)
    assert await RemoteFiles(urls, decode=with_both, decode_in_thread=True)[0] == "0:0.bin:x0"
    assert await RemoteFiles(urls, decode=only_kwargs)[0] == b"x0"
    assert await RemoteFiles(urls, decode=bytes.upper)[0] == b"X0"  # decode(bytes) as before
    # A decoder swapped in later, and a dataset that went through pickle, are read afresh.
    ds = RemoteFiles(urls, decode=with_index)
    assert await ds[0] == (0, 2)
    ds.decode = label_from_folder
    assert await ds[0] == (b"x0", "cat")
    assert await pickle.loads(pickle.dumps(ds))[2] == (b"x2", "cat")
    with pytest.raises(TypeError, match="must be callable"):
        RemoteFiles(urls, decode="utf-8")  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.usefixtures("no_leaks")
def test_labels_from_class_folders_over_http(http_server: ObjectServer) -> None:
    urls = [http_server.put(f"train/c{i % 3}/{i:04d}.bin", payload(i)) for i in range(N)]
    loader = asyncload.DataLoader(
        RemoteFiles(urls, decode=label_from_folder), batch_size=8, num_workers=2, collate_fn=list
    )
    got = [sample for batch in loader for sample in batch]
    assert got == [(payload(i), f"c{i % 3}") for i in range(N)]
