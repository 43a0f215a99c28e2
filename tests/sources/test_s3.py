"""s3:// through obstore against moto's S3 server on 127.0.0.1 (and the fault-injecting server)."""

from __future__ import annotations

import asyncio
import pickle
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import asyncload
from asyncload._exceptions import ConnectError, InvalidURL, NotFound, PermissionDenied, ServerError
from asyncload._stats import loader_stats as _stats
from asyncload._storage import api as _storage
from asyncload._storage.backends import s3 as _s3

from .._http_server import ObjectServer, serve_in_thread, stop
from .._s3_server import ACCESS_KEY, REGION, SECRET_KEY, S3Server

pytest.importorskip("obstore", reason="obstore (asyncload-torch[s3]) is not installed")

pytestmark = pytest.mark.usefixtures("clean_storage")

DATA = bytes(range(256)) * 40
MANY = 1_100  # more than one page of ListObjectsV2 (1,000 keys)


@pytest.fixture(scope="module")
def many_keys(_s3_server_session: S3Server) -> Iterator[str]:
    """A bucket with 1,100 tiny keys, uploaded once for the module (concurrently)."""
    import obstore
    from obstore.store import S3Store

    store = S3Store(
        "asyncload-many",
        endpoint=_s3_server_session.endpoint,
        access_key_id=ACCESS_KEY,
        secret_access_key=SECRET_KEY,
        region=REGION,
        client_options={"allow_http": True},
    )
    _s3_server_session.bucket("asyncload-many")

    async def upload() -> None:
        sem = asyncio.Semaphore(32)

        async def put(i: int) -> None:
            async with sem:
                await obstore.put_async(store, f"k/{i:05d}", str(i).encode())

        await asyncio.gather(*(put(i) for i in range(MANY)))

    # A private thread and loop: obstore's runtime must not run in a loop pytest-asyncio owns.
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, upload()).result()
    return "s3://asyncload-many"


@pytest.mark.asyncio
async def test_get_whole_object_with_credentials_from_env(s3_server: S3Server) -> None:
    bucket = s3_server.bucket("asyncload-get", {"dir/a.bin": DATA})
    before = _stats.recorder.bytes
    assert await asyncload.read(f"{bucket}/dir/a.bin") == DATA
    assert _stats.recorder.bytes - before == len(DATA)


@pytest.mark.asyncio
@pytest.mark.parametrize(("start", "end"), [(10, 20), (None, 7), (len(DATA) - 5, None), (3, 3)])
async def test_byte_ranges(s3_server: S3Server, start: int | None, end: int | None) -> None:
    bucket = s3_server.bucket("asyncload-get", {"r.bin": DATA})
    assert await asyncload.read(f"{bucket}/r.bin", start=start, end=end) == DATA[start:end]


@pytest.mark.asyncio
async def test_stat(s3_server: S3Server) -> None:
    bucket = s3_server.bucket("asyncload-get", {"s.bin": DATA})
    info = await asyncload.stat(f"{bucket}/s.bin")
    assert info.size == len(DATA)
    assert info.etag
    assert info.mtime is not None
    assert abs(info.mtime - time.time()) < 3600


@pytest.mark.asyncio
async def test_stream(s3_server: S3Server) -> None:
    bucket = s3_server.bucket("asyncload-get", {"big.bin": DATA * 50})
    chunks = [c async for c in asyncload.stream(f"{bucket}/big.bin", chunk_size=64 * 1024)]
    assert b"".join(chunks) == DATA * 50


def test_list_files_follows_pagination(s3_server: S3Server, many_keys: str) -> None:
    urls = asyncload.list_files(many_keys + "/k/")
    assert len(urls) == MANY
    assert urls == sorted(urls)
    assert urls[0] == f"{many_keys}/k/00000"
    assert len(set(urls)) == MANY


@pytest.mark.asyncio
async def test_list_files_async_under_a_prefix(s3_server: S3Server) -> None:
    bucket = s3_server.bucket(
        "asyncload-list", {"a/1": b"1", "a/2": b"2", "a/sub/3": b"3", "b/4": b"4"}
    )
    assert await asyncload.list_files_async(f"{bucket}/a") == [
        f"{bucket}/a/1",
        f"{bucket}/a/2",
        f"{bucket}/a/sub/3",
    ]


@pytest.mark.asyncio
async def test_missing_key_and_missing_bucket_are_not_found(s3_server: S3Server) -> None:
    bucket = s3_server.bucket("asyncload-get")
    with pytest.raises(NotFound) as info:
        await asyncload.read(f"{bucket}/no/such/key")
    assert isinstance(info.value, FileNotFoundError)
    assert info.value.attempts == 1
    assert f"{bucket}/no/such/key" in str(info.value)
    with pytest.raises(NotFound):
        await asyncload.read("s3://asyncload-no-such-bucket/key")


@pytest.mark.asyncio
async def test_unknown_credentials_are_permission_denied(s3_server: S3Server) -> None:
    bucket = s3_server.bucket("asyncload-auth", {"k": DATA})
    s3_server.enforce_auth(True)  # moto now rejects keys it has never issued: a real 403
    with pytest.raises(PermissionDenied) as info:
        await asyncload.read(f"{bucket}/k")
    assert isinstance(info.value, PermissionError)
    assert info.value.status == 403
    assert info.value.attempts == 1
    assert "AWS_ACCESS_KEY_ID" in str(info.value)
    assert SECRET_KEY not in str(info.value)


@pytest.mark.asyncio
async def test_endpoint_and_credentials_from_configure(
    s3_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket = s3_server.bucket("asyncload-conf", {"k": b"configured"})
    for name in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    asyncload.configure(
        bucket,
        endpoint=s3_server.endpoint,
        region=REGION,
        credentials={"access_key_id": ACCESS_KEY, "secret_access_key": SECRET_KEY},
    )
    assert await asyncload.read(f"{bucket}/k") == b"configured"


@pytest.mark.asyncio
async def test_a_store_built_ahead_serves_the_pass_that_installs_the_same_settings(
    s3_server: S3Server,
) -> None:
    # A standby worker builds the stores of the prefixes configured when it started
    # (_storage.prewarm); the config that arrives later keeps them if nothing changed.
    bucket = s3_server.bucket("asyncload-warm", {"k": b"warm"})
    asyncload.configure(bucket, endpoint=s3_server.endpoint, region=REGION)
    snapshot = _storage.export_config()
    backend = _storage.backend_for(bucket)
    assert isinstance(backend, _s3.ObjectStoreBackend)
    _storage.reset()  # a new process: nothing configured, no store
    _storage.prewarm(snapshot, 16)
    [(key, (_, store))] = backend._stores.items()
    # The pass's config: the same settings, pickled to reach the worker.
    _storage.import_config(pickle.loads(pickle.dumps(snapshot)), pool_size=16)
    assert await asyncload.read(f"{bucket}/k") == b"warm"
    assert len(backend._stores) == 1
    assert backend._stores[key][1] is store  # no store built on the pass's loop
    # Other settings (here the pool size) are new stores.
    _storage.import_config(snapshot, pool_size=32)
    assert backend._stores == {}
    assert await asyncload.read(f"{bucket}/k") == b"warm"
    assert [s for _, s in backend._stores.values()] != [store]


@pytest.mark.asyncio
async def test_configuring_the_same_settings_again_keeps_the_store(s3_server: S3Server) -> None:
    # A dataset's storage_options are applied at each pass (TarShards) or in each process
    # (RemoteFiles): the same settings again must not throw away the clients built for them.
    bucket = s3_server.bucket("asyncload-again", {"k": b"again"})
    settings = {bucket: {"endpoint": s3_server.endpoint, "region": REGION}}
    asyncload.configure_all(settings)
    assert await asyncload.read(f"{bucket}/k") == b"again"
    backend = _storage.backend_for(bucket)
    assert isinstance(backend, _s3.ObjectStoreBackend)
    [store] = [s for _, s in backend._stores.values()]
    asyncload.configure_all({bucket: dict(settings[bucket])})  # equal, not the same object
    assert await asyncload.read(f"{bucket}/k") == b"again"
    [kept] = [s for _, s in backend._stores.values()]
    assert kept is store  # (obstore's stores compare equal by their settings)
    # Settings that differ are a new store.
    asyncload.configure(bucket, endpoint=s3_server.endpoint, region=REGION, read_timeout=7)
    assert await asyncload.read(f"{bucket}/k") == b"again"
    [built] = [s for _, s in backend._stores.values()]
    assert built is not store


@pytest.mark.asyncio
async def test_refused_endpoint_fails_fast(s3_server: S3Server) -> None:
    _storage.configure("s3://asyncload-refused", endpoint="http://127.0.0.1:9")
    t0 = time.monotonic()
    with pytest.raises(ConnectError) as info:
        await asyncload.read("s3://asyncload-refused/k")
    assert info.value.attempts == 1
    assert time.monotonic() - t0 < 2


@pytest.mark.asyncio
async def test_server_errors_are_retried_by_our_policy_only(
    http_server: ObjectServer, s3_server: S3Server
) -> None:
    # The fault-injecting server stands in for S3 (path-style: /bucket/key). Exactly one hit per
    # attempt proves obstore's own retries are off and the attempt count is true.
    http_server.put("asyncload-faulty/k", DATA)
    http_server.fail("asyncload-faulty/k", "503", "500")
    _storage.configure(
        "s3://asyncload-faulty",
        endpoint=http_server.url,
        retry=asyncload.Retry(attempts=3, backoff=0.01),
    )
    retries = _stats.recorder.retries["503"]
    assert await asyncload.read("s3://asyncload-faulty/k") == DATA
    assert http_server.hits["asyncload-faulty/k"] == 3
    assert _stats.recorder.retries["503"] == retries + 1

    http_server.fail("asyncload-faulty/k", "503", "503", "503")
    with pytest.raises(ServerError) as info:
        await asyncload.read("s3://asyncload-faulty/k")
    assert info.value.attempts == 3
    assert http_server.hits["asyncload-faulty/k"] == 6


@pytest.mark.asyncio
async def test_short_body_from_s3_endpoint_is_refetched(
    http_server: ObjectServer, s3_server: S3Server
) -> None:
    http_server.put("asyncload-faulty/cut", DATA)
    http_server.fail("asyncload-faulty/cut", "short")
    _storage.configure(
        "s3://asyncload-faulty",
        endpoint=http_server.url,
        retry=asyncload.Retry(attempts=3, backoff=0.01),
    )
    assert await asyncload.read("s3://asyncload-faulty/cut") == DATA
    assert http_server.hits["asyncload-faulty/cut"] == 2


@pytest.mark.asyncio
async def test_a_whole_object_is_one_ranged_get_and_an_empty_one_reads_empty(
    http_server: ObjectServer, s3_server: S3Server
) -> None:
    # One call from its start to far past its end, which the store clamps (s3.py's module
    # doc); an empty object has no byte to range (416), so a plain GET reads it.
    http_server.put("asyncload-whole/w", DATA)
    http_server.put("asyncload-whole/empty", b"")
    _storage.configure("s3://asyncload-whole", endpoint=http_server.url)
    assert await asyncload.read("s3://asyncload-whole/w") == DATA
    assert http_server.hits["asyncload-whole/w"] == 1
    assert http_server.headers_seen[-1]["Range"].startswith("bytes=0-")
    assert await asyncload.read("s3://asyncload-whole/empty") == b""
    assert http_server.hits["asyncload-whole/empty"] == 2
    assert "Range" not in http_server.headers_seen[-1]


@pytest.mark.asyncio
@pytest.mark.parametrize("answer", ["whole", "no-content-range"])
async def test_an_endpoint_that_does_not_do_ranges_gets_plain_gets(
    http_server: ObjectServer, s3_server: S3Server, answer: str
) -> None:
    # object_store refuses its answer to the ranged GET (a 200: "non-partial response"; a 206
    # without Content-Range): the read asks again plainly, and the bucket's later reads go
    # plainly from the start.
    bucket = f"asyncload-unranged-{answer}"
    http_server.put(f"{bucket}/a", DATA)
    http_server.put(f"{bucket}/b", DATA[::-1])
    if answer == "whole":
        http_server.ranges = False
    else:
        http_server.fail(f"{bucket}/a", answer)
    _storage.configure(f"s3://{bucket}", endpoint=http_server.url)
    assert await asyncload.read(f"s3://{bucket}/a") == DATA
    assert http_server.hits[f"{bucket}/a"] == 2
    assert await asyncload.read(f"s3://{bucket}/b") == DATA[::-1]
    assert http_server.hits[f"{bucket}/b"] == 1
    assert "Range" not in http_server.headers_seen[-1]


def test_map_error_slowdown_is_retryable() -> None:
    class FakeGeneric(Exception):
        pass

    failure = _s3.map_error(
        FakeGeneric("Generic S3 error: <Code>SlowDown</Code> status: 503"), "s3"
    )
    assert failure.kind is ServerError
    assert failure.retryable
    assert failure.reason == "SlowDown"


def test_map_error_403_names_the_variables_per_cloud() -> None:
    for scheme, var in (
        ("s3", "AWS_ACCESS_KEY_ID"),
        ("gs", "GOOGLE_APPLICATION_CREDENTIALS"),
        ("az", "AZURE_STORAGE_ACCOUNT_KEY"),
    ):
        failure = _s3.map_error(Exception("non-2xx status code: 403 Forbidden"), scheme)
        assert failure.kind is PermissionDenied
        assert not failure.retryable
        assert var in failure.message


# -- a typo next to a private endpoint (issue 12, item 10) -----------------------------------


@pytest.mark.asyncio
async def test_unmatched_bucket_next_to_a_private_endpoint_is_refused(
    http_server: ObjectServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    http_server.put("bucket-a/k", DATA)
    _storage.configure("s3://bucket-a", endpoint=http_server.url, region=REGION)
    assert await asyncload.read("s3://bucket-a/k") == DATA
    with pytest.raises(InvalidURL, match="matches no configured prefix") as info:
        await asyncload.read("s3://bucket-aa/k")  # would go, signed, to AWS
    message = str(info.value)
    assert "s3://bucket-a " in message
    assert "asyncload.configure('s3://bucket-aa')" in message
    assert info.value.attempts == 1
    assert SECRET_KEY not in message
    # Saying so is enough: a catch-all prefix makes the public endpoint deliberate.
    _storage.configure("s3://", region=REGION, endpoint="http://127.0.0.1:9")
    with pytest.raises(ConnectError):
        await asyncload.read("s3://bucket-aa/k")


@pytest.mark.asyncio
async def test_unmatched_bucket_goes_to_the_environment_endpoint(s3_server: S3Server) -> None:
    # AWS_ENDPOINT_URL (set by the fixture) is a deliberate default: nothing to refuse.
    bucket = s3_server.bucket("asyncload-env-default", {"k": b"env"})
    _storage.configure("s3://asyncload-other", endpoint="http://127.0.0.1:9")
    assert await asyncload.read(f"{bucket}/k") == b"env"


def test_misspelt_credential_key_is_refused_at_configure() -> None:
    with pytest.raises(TypeError) as info:
        asyncload.configure("s3://bucket", credentials={"secret_acess_key": "x"})
    message = str(info.value)
    assert "'secret_acess_key'" in message
    assert "did you mean 'secret_access_key'" in message
    assert "valid: access_key_id," in message
    # obstore's aliases are accepted: upper case, and the variable names.
    asyncload.configure("s3://bucket", credentials={"AWS_SECRET_ACCESS_KEY": "x"})
    asyncload.configure("s3://bucket", extra={"virtual_hosted_style_request": "false"})


@pytest.mark.asyncio
async def test_endpoint_option_works_for_every_scheme() -> None:
    from asyncload._storage.backends.cloud import store_config

    opts = asyncload.StorageOptions(endpoint="http://127.0.0.1:1234")
    assert store_config("s3", opts)[0]["endpoint"] == "http://127.0.0.1:1234"
    assert store_config("gs", opts)[0]["base_url"] == "http://127.0.0.1:1234"
    assert store_config("az", opts)[0]["endpoint"] == "http://127.0.0.1:1234"
    for scheme in ("s3", "gs", "az"):
        assert store_config(scheme, opts)[1]["allow_http"] is True


# -- S3 over HTTPS with a private CA (issue 12, item 12) --------------------------------------


def _private_ca(tmp: Path) -> tuple[str, str, str]:
    """A CA, and a server certificate for 127.0.0.1 it signed: (ca.pem, cert.pem, key.pem).

    rustls (obstore) refuses a self-signed CA certificate used as the server's own.
    """
    pytest.importorskip("cryptography", reason="cryptography makes the test certificates")
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "asyncload test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    paths = (tmp / "ca.pem", tmp / "cert.pem", tmp / "key.pem")
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(paths[0]), str(paths[1]), str(paths[2])


@pytest.fixture
def https_s3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[ObjectServer, str]]:
    """The object server over HTTPS with a certificate from a private CA, as an S3 endpoint."""
    ca, cert, key = _private_ca(tmp_path)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    running = serve_in_thread(ObjectServer(), ssl_context=ctx)
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT", "SSL_CERT_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    try:
        running.store.put("asyncload-tls/k", DATA)
        yield running.store, ca
    finally:
        stop(running)


@pytest.mark.asyncio
async def test_https_endpoint_with_a_private_ca(https_s3: tuple[ObjectServer, str]) -> None:
    server, ca = https_s3
    assert server.url.startswith("https://")
    _storage.configure("s3://asyncload-tls", endpoint=server.url, region=REGION, ca_bundle=ca)
    assert await asyncload.read("s3://asyncload-tls/k") == DATA


@pytest.mark.asyncio
async def test_https_endpoint_trusts_ssl_cert_file(
    https_s3: tuple[ObjectServer, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, ca = https_s3
    monkeypatch.setenv("SSL_CERT_FILE", ca)
    _storage.configure("s3://asyncload-tls", endpoint=server.url, region=REGION)
    assert await asyncload.read("s3://asyncload-tls/k") == DATA


@pytest.mark.asyncio
async def test_tls_verification_failure_is_not_retried(https_s3: tuple[ObjectServer, str]) -> None:
    server, _ = https_s3
    _storage.configure(
        "s3://asyncload-tls",
        endpoint=server.url,
        region=REGION,
        retry=asyncload.Retry(attempts=5, backoff=0.01),
    )
    with pytest.raises(ConnectError, match="TLS verification failed") as info:
        await asyncload.read("s3://asyncload-tls/k")
    assert info.value.attempts == 1
    assert "ca_bundle" in str(info.value)
    assert server.hits["asyncload-tls/k"] == 0  # no request got past the handshake
