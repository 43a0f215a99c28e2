"""http(s):// against the real loopback aiohttp server, with faults injected per path."""

from __future__ import annotations

import asyncio
import datetime
import logging
import socket
import time
from pathlib import Path

import pytest

import asyncload
from asyncload import _stats, _storage
from asyncload._exceptions import (
    ConnectError,
    NotFound,
    PermissionDenied,
    RedirectError,
    RequestTimeout,
    ServerError,
    StorageError,
)

from .._http_server import ObjectServer, serve_in_thread, stop

pytestmark = [pytest.mark.asyncio, pytest.mark.usefixtures("clean_storage")]

DATA = bytes(range(256)) * 64  # 16 KiB


def fast_retries(server: ObjectServer, **options: object) -> None:
    """Retries without the production backoff, so fault tests take milliseconds."""
    retry = options.pop("retry", asyncload.Retry(attempts=4, backoff=0.01))
    _storage.configure(server.url, retry=retry, **options)  # type: ignore[arg-type]


async def test_read_whole_object_and_count_bytes(http_server: ObjectServer) -> None:
    url = http_server.put("a/b.bin", DATA)
    before = _stats.recorder.bytes
    assert await asyncload.read(url) == DATA
    assert _stats.recorder.bytes - before == len(DATA)


@pytest.mark.parametrize(
    ("start", "end"),
    [(10, 20), (0, 1), (100, None), (None, 50), (len(DATA) - 3, None), (5, len(DATA) + 100)],
)
async def test_byte_ranges(http_server: ObjectServer, start: int | None, end: int | None) -> None:
    url = http_server.put("r.bin", DATA)
    assert await asyncload.read(url, start=start, end=end) == DATA[start:end]


async def test_empty_and_out_of_bounds_ranges(http_server: ObjectServer) -> None:
    url = http_server.put("r.bin", DATA)
    assert await asyncload.read(url, start=7, end=7) == b""
    assert http_server.hits["r.bin"] == 0  # an empty range needs no request
    with pytest.raises(ValueError, match="non-negative"):
        await asyncload.read(url, start=-1)


async def test_stream_yields_the_object_in_bounded_chunks(http_server: ObjectServer) -> None:
    url = http_server.put("big.bin", DATA * 8)
    chunks = [c async for c in asyncload.stream(url, chunk_size=4096)]
    assert b"".join(chunks) == DATA * 8
    assert len(chunks) >= 2
    assert all(len(c) <= 4096 for c in chunks)


async def test_stream_resumes_after_reset_without_duplicates(http_server: ObjectServer) -> None:
    url = http_server.put("big.bin", DATA * 8)
    http_server.fail("big.bin", "reset")
    fast_retries(http_server)
    chunks = [c async for c in asyncload.stream(url, chunk_size=1024)]
    assert b"".join(chunks) == DATA * 8
    assert http_server.hits["big.bin"] == 2


async def test_stat(http_server: ObjectServer) -> None:
    url = http_server.put("s.bin", DATA)
    info = await asyncload.stat(url)
    assert info.size == len(DATA)
    assert info.url == url
    assert info.etag
    assert info.etag.startswith('"')


async def test_requests_run_concurrently_under_latency(http_server: ObjectServer) -> None:
    urls = [http_server.put(f"lat/{i}", bytes([i]) * 100) for i in range(20)]
    http_server.latency = 0.2
    t0 = time.monotonic()
    got = await asyncio.gather(*(asyncload.read(u) for u in urls))
    elapsed = time.monotonic() - t0
    assert got == [bytes([i]) * 100 for i in range(20)]
    assert elapsed < 20 * 0.2 / 4, f"20 reads at 0.2 s latency took {elapsed:.2f}s: not concurrent"


async def test_503_then_success_is_retried(http_server: ObjectServer) -> None:
    url = http_server.put("flaky", DATA)
    http_server.fail("flaky", "503")
    fast_retries(http_server)
    retries = _stats.recorder.retries["503"]
    assert await asyncload.read(url) == DATA
    assert http_server.hits["flaky"] == 2
    assert _stats.recorder.retries["503"] == retries + 1


@pytest.mark.parametrize("status", ["429", "500", "502", "504"])
async def test_retryable_statuses(http_server: ObjectServer, status: str) -> None:
    url = http_server.put("flaky", DATA)
    http_server.fail("flaky", status, status)
    fast_retries(http_server)
    assert await asyncload.read(url) == DATA
    assert http_server.hits["flaky"] == 3


async def test_retry_after_is_honoured(http_server: ObjectServer) -> None:
    url = http_server.put("busy", DATA)
    http_server.fail("busy", "retry-after:1")
    fast_retries(http_server)
    t0 = time.monotonic()
    assert await asyncload.read(url) == DATA
    assert time.monotonic() - t0 >= 1.0
    assert http_server.hits["busy"] == 2


async def test_retries_exhausted_raise_server_error_with_attempts(
    http_server: ObjectServer,
) -> None:
    url = http_server.put("down", DATA)
    http_server.fail("down", *["500"] * 10)
    fast_retries(http_server, retry=asyncload.Retry(attempts=3, backoff=0.01))
    errors = _stats.recorder.errors["ServerError"]
    with pytest.raises(ServerError) as info:
        await asyncload.read(url)
    assert info.value.attempts == 3
    assert info.value.status == 500
    assert http_server.hits["down"] == 3
    assert url in str(info.value)
    assert "after 3 attempts" in str(info.value)
    assert _stats.recorder.errors["ServerError"] == errors + 1


@pytest.mark.parametrize("fault", ["reset", "short"])
async def test_truncated_body_is_refetched_never_delivered(
    http_server: ObjectServer, fault: str
) -> None:
    url = http_server.put("cut", DATA)
    http_server.fail("cut", fault)
    fast_retries(http_server)
    assert await asyncload.read(url) == DATA
    assert http_server.hits["cut"] == 2


async def test_truncated_body_every_time_raises(http_server: ObjectServer) -> None:
    url = http_server.put("cut", DATA)
    http_server.fail("cut", "short", "short")
    fast_retries(http_server, retry=asyncload.Retry(attempts=2, backoff=0.01))
    with pytest.raises(StorageError) as info:
        await asyncload.read(url)
    assert info.value.attempts == 2


async def test_stalled_body_times_out_and_is_retried(http_server: ObjectServer) -> None:
    url = http_server.put("slow", DATA)
    http_server.fail("slow", "stall:3")
    fast_retries(http_server, read_timeout=0.3)
    t0 = time.monotonic()
    assert await asyncload.read(url) == DATA
    assert time.monotonic() - t0 < 2.5
    assert http_server.hits["slow"] == 2


async def test_permanently_stalled_body_raises_request_timeout(
    http_server: ObjectServer,
) -> None:
    url = http_server.put("stuck", DATA)
    http_server.fail("stuck", "stall:5", "stall:5")
    fast_retries(http_server, read_timeout=0.2, retry=asyncload.Retry(attempts=2, backoff=0.01))
    with pytest.raises(RequestTimeout) as info:
        await asyncload.read(url)
    assert isinstance(info.value, TimeoutError)
    assert url in str(info.value)
    assert info.value.attempts == 2


async def test_404_is_not_found_and_not_retried(http_server: ObjectServer) -> None:
    url = http_server.url_for("missing")
    fast_retries(http_server)
    with pytest.raises(NotFound) as info:
        await asyncload.read(url)
    assert isinstance(info.value, FileNotFoundError)
    assert info.value.status == 404
    assert info.value.attempts == 1
    assert http_server.hits["missing"] == 1
    assert url in str(info.value)


@pytest.mark.parametrize("status", ["401", "403"])
async def test_401_403_are_permission_denied_with_advice(
    http_server: ObjectServer, status: str
) -> None:
    url = http_server.put("secret", DATA)
    http_server.fail("secret", status, status)
    fast_retries(http_server)
    with pytest.raises(PermissionDenied) as info:
        await asyncload.read(url)
    assert isinstance(info.value, PermissionError)
    assert "configure" in str(info.value)
    assert http_server.hits["secret"] == 1


async def test_400_is_not_retried(http_server: ObjectServer) -> None:
    url = http_server.put("bad", DATA)
    http_server.fail("bad", "400")
    fast_retries(http_server)
    with pytest.raises(StorageError) as info:
        await asyncload.read(url)
    assert info.value.status == 400
    assert http_server.hits["bad"] == 1


async def test_refused_port_fails_fast_with_connect_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        url = f"http://127.0.0.1:{port}/x"
        t0 = time.monotonic()
        with pytest.raises(ConnectError) as info:
            await asyncload.read(url)
    assert isinstance(info.value, ConnectionError)
    assert info.value.attempts == 1
    assert time.monotonic() - t0 < 1.0
    assert url in str(info.value)


async def test_same_host_redirect_is_followed(http_server: ObjectServer) -> None:
    http_server.put("new", DATA)
    http_server.fail("old", "redirect:/new")
    assert await asyncload.read(http_server.url_for("old")) == DATA


async def test_redirect_to_another_host_is_not_followed(http_server: ObjectServer) -> None:
    http_server.put("target", DATA)
    elsewhere = f"http://localhost:{http_server.port}/target"
    http_server.fail("hop", "redirect:" + elsewhere)
    with pytest.raises(RedirectError, match="another host"):
        await asyncload.read(http_server.url_for("hop"))
    assert http_server.hits["target"] == 0


async def test_redirect_to_another_host_when_allowed(http_server: ObjectServer) -> None:
    http_server.put("target", DATA)
    http_server.fail("hop", "redirect:" + f"http://localhost:{http_server.port}/target")
    _storage.configure(http_server.url, allow_cross_host_redirects=True)
    assert await asyncload.read(http_server.url_for("hop")) == DATA


async def test_redirect_to_file_is_never_followed(http_server: ObjectServer) -> None:
    http_server.fail("hop", "redirect:file:///etc/passwd")
    _storage.configure(http_server.url, allow_cross_host_redirects=True)
    with pytest.raises(RedirectError, match="non-HTTP"):
        await asyncload.read(http_server.url_for("hop"))


async def test_credentials_are_redacted_in_errors_and_logs(
    http_server: ObjectServer, caplog: pytest.LogCaptureFixture
) -> None:
    http_server.fail("p", "503")  # one retry, so one log line
    base = f"http://alice:hunter2@127.0.0.1:{http_server.port}"
    _storage.configure(base, retry=asyncload.Retry(attempts=2, backoff=0.01))
    url = f"{base}/p?X-Amz-Signature=deadbeefcafe&X-Amz-Credential=AKIAXYZ&part=1"
    with caplog.at_level(logging.DEBUG, logger="asyncload"), pytest.raises(NotFound) as info:
        await asyncload.read(url)
    text = str(info.value) + repr(info.value) + str(info.value.url)
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert caplog.records, "the retry should have been logged"
    for secret in ("hunter2", "deadbeefcafe", "AKIAXYZ"):
        assert secret not in text
        assert secret not in logged
    assert "REDACTED" in text
    assert "part=1" in text


async def test_unknown_scheme_lists_registered_schemes() -> None:
    with pytest.raises(asyncload.InvalidURL) as info:
        await asyncload.read("ftp://example.com/file")
    assert "s3://" in str(info.value)
    assert "https://" in str(info.value)
    assert isinstance(info.value, ValueError)


async def test_listing_http_is_refused_clearly(http_server: ObjectServer) -> None:
    with pytest.raises(asyncload.InvalidURL, match="no way to list"):
        await asyncload.list_files_async(http_server.url + "/")


async def test_aclose_closes_the_session_of_this_loop(http_server: ObjectServer) -> None:
    url = http_server.put("a", b"x")
    await asyncload.read(url)
    await _storage.aclose()
    # A new session is created lazily afterwards.
    assert await asyncload.read(url) == b"x"


# -- TLS ---------------------------------------------------------------------------------


def _self_signed(tmp: Path) -> tuple[str, str]:
    crypto = pytest.importorskip("cryptography", reason="cryptography makes the test certificate")
    del crypto
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "asyncload test CA")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(__import__("ipaddress").ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp / "cert.pem", tmp / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(cert_path), str(key_path)


async def test_tls_with_unknown_ca_fails_unless_ca_bundle_given(tmp_path: Path) -> None:
    import ssl

    cert, key = _self_signed(tmp_path)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    running = serve_in_thread(ObjectServer(), ssl_context=ctx)
    try:
        server = running.state
        url = server.put("tls.bin", DATA)
        assert url.startswith("https://")
        with pytest.raises(ConnectError, match="ca_bundle") as info:
            await asyncload.read(url)
        assert info.value.attempts == 1  # verification failures are not retried
        _storage.configure(server.url, ca_bundle=cert)
        assert await asyncload.read(url) == DATA
    finally:
        await _storage.aclose()
        stop(running)
