"""The behaviour matrix every object store passes, against a real emulator on 127.0.0.1.

``test_gcs.py`` and ``test_azure.py`` import these tests and provide two fixtures: ``cloud``
(the emulator for one test, storage settings reset) and ``cloud_session`` (the same, module
scope, for the large listing bucket). Faults (503, 429, 403, a cut body) come from the proxy in
front of the emulator (tests/_cloud_proxy.py); everything else is the emulator's own answer.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

import asyncload
from asyncload._exceptions import (
    InvalidURL,
    NotFound,
    ObjectChanged,
    PermissionDenied,
    ServerError,
)
from asyncload._stats import loader_stats as _stats
from asyncload._storage import api as _storage
from asyncload._storage.backends import s3 as _s3
from asyncload._storage.backends.base import Resume
from asyncload._storage.retry import AttemptFailed

from ..datasets.test_tar import make_tar, shard_members

pytest.importorskip("obstore", reason="obstore (asyncload-torch[s3]) is not installed")

DATA = bytes(range(256)) * 40
DATA_TAIL = len(DATA) - 100
BIG = bytes(range(251)) * 9000  # ~2.2 MB: several chunks, cut midway by the proxy
MANY = 1_100  # more than one page of a GCS listing (1,000 keys)
FAST = asyncload.Retry(attempts=3, backoff=0.01)


def _configure(cloud: Any, bucket: str, *, proxy: bool = False, **kwargs: Any) -> None:
    options = cloud.options(cloud.proxy_endpoint if proxy else None)
    asyncload.configure(bucket, **{**options, **kwargs})


@pytest.fixture(scope="module")
def many_keys(cloud_session: Any) -> str:
    """A public bucket with 1,100 tiny keys, uploaded once for the module."""
    objects = {f"k/{i:05d}": str(i).encode() for i in range(MANY)}
    return str(cloud_session.bucket("asyncload-many", objects, public=True))


@pytest.mark.asyncio
async def test_read_whole_object_and_byte_ranges(cloud: Any) -> None:
    bucket = cloud.bucket("asyncload-get", {"dir/a.bin": DATA})
    _configure(cloud, bucket)
    before = _stats.recorder.bytes
    assert await asyncload.read(f"{bucket}/dir/a.bin") == DATA
    assert _stats.recorder.bytes - before == len(DATA)
    for start, end in ((10, 20), (None, 7), (len(DATA) - 5, None), (3, 3), (5, None)):
        got = await asyncload.read(f"{bucket}/dir/a.bin", start=start, end=end)
        assert got == DATA[start:end], (start, end)


@pytest.mark.asyncio
async def test_a_whole_object_is_one_ranged_get_and_an_empty_one_reads_empty(cloud: Any) -> None:
    # One call from its start to far past its end, which the store clamps (s3.py's module
    # doc); an empty object has no byte to range (416), so a plain GET reads it.
    bucket = cloud.bucket("asyncload-whole", {"w.bin": DATA, "empty.bin": b""})
    _configure(cloud, bucket, proxy=True)
    path = cloud.path(f"{bucket}/w.bin")
    assert await asyncload.read(f"{bucket}/w.bin") == DATA
    assert cloud.proxy.hits[path] == 1
    assert cloud.proxy.requests[-1][3]["Range"].startswith("bytes=0-")
    assert await asyncload.read(f"{bucket}/w.bin", start=DATA_TAIL) == DATA[DATA_TAIL:]
    assert cloud.proxy.hits[path] == 2
    empty = cloud.path(f"{bucket}/empty.bin")
    assert await asyncload.read(f"{bucket}/empty.bin") == b""
    assert cloud.proxy.hits[empty] == 2
    assert "Range" not in cloud.proxy.requests[-1][3]


@pytest.mark.asyncio
async def test_stat(cloud: Any) -> None:
    bucket = cloud.bucket("asyncload-get", {"s.bin": DATA})
    _configure(cloud, bucket)
    info = await asyncload.stat(f"{bucket}/s.bin")
    assert info.size == len(DATA)
    assert info.etag
    assert info.mtime is not None
    assert abs(info.mtime - time.time()) < 3600


@pytest.mark.asyncio
async def test_stream_resumes_a_cut_body_from_the_last_byte(cloud: Any) -> None:
    bucket = cloud.bucket("asyncload-stream", {"big.bin": BIG})
    _configure(cloud, bucket, proxy=True, retry=FAST)
    path = cloud.path(f"{bucket}/big.bin")
    cloud.proxy.fail(path, "cut")
    chunks = [c async for c in asyncload.stream(f"{bucket}/big.bin", chunk_size=64 * 1024)]
    assert b"".join(chunks) == BIG
    assert cloud.proxy.hits[path] == 2
    resumed = cloud.proxy.requests[-1][3]
    first = int(resumed["Range"].removeprefix("bytes=").split("-")[0])
    assert 0 < first < len(BIG)  # the second GET asked for the rest only
    assert resumed.get("If-Match"), "a resumed stream must ask for the version it started with"


@pytest.mark.asyncio
async def test_stream_version_refuses_a_replaced_object(cloud: Any) -> None:
    """What asyncload.stream calls: the first GET records the version, a resume asks for it."""
    bucket = cloud.bucket("asyncload-replaced", {"v.bin": BIG})
    _configure(cloud, bucket, proxy=True)
    url = f"{bucket}/v.bin"
    options = _storage.options_for(url)
    resume = Resume()
    got = bytearray()

    async def drain(start: int) -> None:
        async for chunk in _s3._backend.stream_version(url, start, 1 << 16, options, resume):
            got.extend(chunk)

    cloud.proxy.fail(cloud.path(url), "cut")
    with pytest.raises(AttemptFailed):
        await drain(0)
    assert resume.etag
    assert 0 < len(got) < len(BIG)
    cloud.bucket(bucket.partition("://")[2], {"v.bin": BIG[::-1]})  # same size, new bytes
    with pytest.raises(AttemptFailed) as info:
        await drain(len(got))
    assert info.value.kind is ObjectChanged
    assert not info.value.retryable


@pytest.mark.asyncio
async def test_conditional_resume_never_splices_two_versions(cloud: Any) -> None:
    bucket = cloud.bucket("asyncload-versions", {"v.bin": BIG})
    _configure(cloud, bucket, proxy=True)
    url = f"{bucket}/v.bin"
    path = cloud.path(url)
    options = _storage.options_for(url)
    backend = _s3._backend

    async def drain(start: int, got: bytearray, etag: str) -> None:
        async for chunk in backend.stream(url, start, 1 << 16, options, if_match=etag):
            got += chunk

    async def upto_cut() -> tuple[bytes, str]:
        etag = (await backend.stat(url, options)).etag
        assert etag
        got = bytearray()
        cloud.proxy.fail(path, "cut")
        with pytest.raises(AttemptFailed) as info:
            await drain(0, got, etag)
        assert info.value.retryable
        assert 0 < len(got) < len(BIG)
        return bytes(got), etag

    # Same version: the conditional resume completes the object, and says which it wants.
    head, etag = await upto_cut()
    rest = bytearray()
    await drain(len(head), rest, etag)
    assert head + rest == BIG
    assert cloud.proxy.requests[-1][3].get("If-Match") == etag

    # The object is replaced between the cut and the resume: refused, never spliced.
    head, etag = await upto_cut()
    cloud.bucket(bucket.partition("://")[2], {"v.bin": BIG[::-1]})  # same size, new bytes
    with pytest.raises(AttemptFailed) as info:
        await drain(len(head), bytearray(), etag)
    assert info.value.status == 412
    assert not info.value.retryable
    assert "changed" in info.value.message
    with pytest.raises(AttemptFailed) as info:
        await backend.read(url, 10, 20, options, if_match=etag)
    assert info.value.status == 412
    assert await backend.read(url, 10, 20, options) == BIG[::-1][10:20]

    # Replaced by a shorter object: the resume's range no longer exists; still "changed".
    cloud.bucket(bucket.partition("://")[2], {"v.bin": BIG})
    head, etag = await upto_cut()
    cloud.bucket(bucket.partition("://")[2], {"v.bin": DATA})
    with pytest.raises(AttemptFailed) as info:
        await drain(len(head), bytearray(), etag)
    assert info.value.status == 412


def test_list_files_follows_pagination(cloud: Any, many_keys: str) -> None:
    # Unsigned: the proxy may then change the query (Azure signs it) to ask for small pages.
    _configure(cloud, many_keys, proxy=True, **cloud.unsigned())
    cloud.proxy.page_size = 500  # pages as the real clouds send them, only smaller
    urls = asyncload.list_files(many_keys + "/k/")
    assert len(urls) == MANY
    assert len(set(urls)) == MANY
    assert urls == sorted(urls)
    assert urls[0] == f"{many_keys}/k/00000"
    assert urls[-1] == f"{many_keys}/k/{MANY - 1:05d}"
    assert len(cloud.proxy.requests) == 3, "pagination was not exercised"


@pytest.mark.asyncio
async def test_list_files_async_under_a_prefix(cloud: Any) -> None:
    objects = {"a/1": b"1", "a/2": b"2", "a/sub/3": b"3", "b/4": b"4"}
    bucket = cloud.bucket("asyncload-list", objects)
    _configure(cloud, bucket)
    assert await asyncload.list_files_async(f"{bucket}/a") == [
        f"{bucket}/a/1",
        f"{bucket}/a/2",
        f"{bucket}/a/sub/3",
    ]


@pytest.mark.asyncio
async def test_missing_key_and_missing_bucket_are_not_found(cloud: Any) -> None:
    bucket = cloud.bucket("asyncload-get")
    _configure(cloud, f"{cloud.scheme}://")
    with pytest.raises(NotFound) as info:
        await asyncload.read(f"{bucket}/no/such/key")
    assert isinstance(info.value, FileNotFoundError)
    assert info.value.attempts == 1
    assert f"{bucket}/no/such/key" in str(info.value)
    with pytest.raises(NotFound):
        await asyncload.read(f"{cloud.scheme}://asyncload-no-such-bucket/key")
    with pytest.raises(NotFound):
        await asyncload.stat(f"{bucket}/no/such/key")


@pytest.mark.asyncio
async def test_refused_credentials_are_permission_denied(cloud: Any) -> None:
    bucket = cloud.bucket("asyncload-auth", {"k": DATA})
    denied = cloud.denied_options()
    if denied is None:  # the emulator checks no credentials: the proxy answers as GCS would
        _configure(cloud, bucket, proxy=True)
        cloud.proxy.fail(cloud.path(f"{bucket}/k"), "403")
    else:
        asyncload.configure(bucket, **denied)
    with pytest.raises(PermissionDenied) as info:
        await asyncload.read(f"{bucket}/k")
    assert isinstance(info.value, PermissionError)
    assert info.value.status == 403
    assert info.value.attempts == 1
    hint = {"gs": "GOOGLE_APPLICATION_CREDENTIALS", "az": "AZURE_STORAGE_ACCOUNT_KEY"}
    assert hint[cloud.scheme] in str(info.value)
    for secret in (denied or {}).get("credentials", {}).values():
        assert secret not in str(info.value) or secret == "devstoreaccount1"


@pytest.mark.asyncio
async def test_server_errors_and_throttling_are_retried_by_our_policy_only(cloud: Any) -> None:
    bucket = cloud.bucket("asyncload-faulty", {"k": DATA})
    _configure(cloud, bucket, proxy=True, retry=FAST)
    path = cloud.path(f"{bucket}/k")
    retries = _stats.recorder.retries["503"] + _stats.recorder.retries["429"]
    cloud.proxy.fail(path, "503", "429")
    assert await asyncload.read(f"{bucket}/k") == DATA
    # One request per attempt: obstore's own retries are off, the attempt count is true.
    assert cloud.proxy.hits[path] == 3
    assert _stats.recorder.retries["503"] + _stats.recorder.retries["429"] == retries + 2

    cloud.proxy.fail(path, "503", "429", "503")
    with pytest.raises(ServerError) as info:
        await asyncload.read(f"{bucket}/k")
    assert info.value.attempts == 3
    assert cloud.proxy.hits[path] == 6


@pytest.mark.asyncio
async def test_unknown_option_is_refused_at_configure(cloud: Any) -> None:
    with pytest.raises(TypeError, match="valid: ") as info:
        asyncload.configure(f"{cloud.scheme}://bucket", credentials={"acount_kee": "x"})
    assert repr("acount_kee") in str(info.value)
    with pytest.raises(TypeError, match="valid: "):
        asyncload.configure(f"{cloud.scheme}://bucket", extra={"no_such_key": True})


@pytest.mark.asyncio
async def test_a_typo_next_to_a_private_endpoint_is_refused(cloud: Any) -> None:
    bucket = cloud.bucket("asyncload-private", {"k": DATA})
    _configure(cloud, bucket, proxy=True)
    with pytest.raises(InvalidURL, match="matches no configured prefix") as info:
        await asyncload.read(f"{bucket}x/k")
    assert f"asyncload.configure('{bucket}x')" in str(info.value)
    assert sum(cloud.proxy.hits.values()) == 0
    assert await asyncload.read(f"{bucket}/k") == DATA


# -- a DataLoader epoch over each dataset kind ----------------------------------------------

N = 40


def payload(i: int) -> bytes:
    return f"object {i:04d} ".encode() * (i % 7 + 1)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.usefixtures("no_leaks")
def test_remote_files_epoch_with_two_workers(cloud: Any) -> None:
    bucket = cloud.bucket("asyncload-epoch", {f"rf/{i:04d}": payload(i) for i in range(N)})
    # Settings travel to the workers with the loader, whatever their environment holds.
    _configure(cloud, bucket)
    ds = asyncload.RemoteFiles.from_prefix(f"{bucket}/rf/")
    loader = asyncload.DataLoader(ds, batch_size=8, num_workers=2, collate_fn=list)
    got = [sample for batch in loader for sample in batch]
    assert got == [payload(i) for i in range(N)]  # in order, each exactly once


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.usefixtures("no_leaks")
def test_tar_shards_epoch_with_two_workers(cloud: Any) -> None:
    per_shard = 13
    shards = {
        f"shards/{s:03d}.tar": make_tar(shard_members(s * per_shard, per_shard)) for s in range(5)
    }
    bucket = cloud.bucket("asyncload-shards", shards)
    _configure(cloud, bucket)
    urls = [f"{bucket}/{key}" for key in sorted(shards)]
    ds = asyncload.TarShards(urls, decoders={"cls": int}, shards_in_flight=2)
    loader = asyncload.DataLoader(ds, batch_size=8, num_workers=2)
    seen: dict[str, bytes] = {}
    for batch in loader:
        for key, text in zip(batch["__key__"], batch["txt"], strict=True):
            assert key not in seen, f"{key} delivered twice"
            seen[key] = text
    want = dict(shard_members(0, 5 * per_shard))
    assert sorted(seen) == [f"s/{i:05d}" for i in range(5 * per_shard)]
    assert all(seen[k] == want[f"{k}.txt"] for k in seen)
