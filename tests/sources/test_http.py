"""http(s):// against the real loopback aiohttp server, with faults injected per path."""

from __future__ import annotations

import asyncio
import datetime
import logging
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import asyncload
from asyncload._exceptions import (
    ConnectError,
    NotFound,
    PermissionDenied,
    RedirectError,
    RequestTimeout,
    ServerError,
    StorageError,
)
from asyncload._stats import loader_stats as _stats
from asyncload._storage import api as _storage
from asyncload._storage.backends import base as _base
from asyncload._storage.backends.base import AttemptFailed, encode_url

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
        server = running.store
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


# -- URLs that cannot be sent as given (issue 12, items 6 and 7) ----------------------------


@pytest.mark.parametrize(
    ("name", "wire"),
    [
        ("a b.bin", "/a%20b.bin"),
        ("tab\there.bin", "/tab%09here.bin"),
        ("ünï.bin", "/%C3%BCn%C3%AF.bin"),
        ("100%.bin", "/100%25.bin"),
    ],
)
async def test_odd_characters_are_percent_encoded_and_fetch_that_object(
    http_server: ObjectServer, name: str, wire: str
) -> None:
    http_server.put(name, DATA)
    # What the old code fetched: the name with the TAB dropped or the space cut at.
    for decoy in {name.replace("\t", ""), name.split(" ")[0]} - {name}:
        http_server.put(decoy, b"a different object")
    url = f"{http_server.url}/{name}"
    assert await asyncload.read(url) == DATA
    assert http_server.raw_paths == [wire]


async def test_existing_escapes_are_sent_unchanged(http_server: ObjectServer) -> None:
    http_server.put("a b.bin", DATA)
    assert await asyncload.read(http_server.url + "/a%20b.bin?X-Amz-Signature=ab%2Fcd") == DATA
    assert http_server.raw_paths == ["/a%20b.bin?X-Amz-Signature=ab%2Fcd"]


async def test_lone_surrogate_is_invalid_url_and_nothing_is_fetched(
    http_server: ObjectServer,
) -> None:
    http_server.put("x.bin", DATA)
    url = f"{http_server.url}/x\udcff.bin?token=s3cret"
    with pytest.raises(asyncload.InvalidURL, match="lone surrogate") as info:
        await asyncload.read(url)
    assert http_server.raw_paths == []
    message = str(info.value)
    message.encode("utf-8")  # printable: the surrogate is shown escaped
    assert "\\udcff" in message
    assert "s3cret" not in message


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:99999/x?sig=s3cret",
        "http://127.0.0.1:port/x?sig=s3cret",
        "http://[::1/x?sig=s3cret",
        "http://[::1]x/y?sig=s3cret",
        "http://[::g]/x?sig=s3cret",
        "http://u:s3cret@[::1/x",
    ],
)
async def test_bad_port_or_ipv6_is_invalid_url_naming_the_redacted_url(url: str) -> None:
    with pytest.raises(asyncload.InvalidURL) as info:
        await asyncload.read(url)
    assert isinstance(info.value, asyncload.LoadError)
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    assert "s3cret" not in message
    assert info.value.url is not None
    assert info.value.url in message
    assert url.split("/")[2].split("@")[-1] in message  # the host part is named
    with pytest.raises(asyncload.InvalidURL):
        await asyncload.stat(url)


@pytest.mark.timeout(10)
async def test_a_host_part_once_sound_is_remembered_and_a_bad_one_never() -> None:
    # encode_url keeps the host parts urlsplit accepted (a hot path): only those.
    assert encode_url("http://127.0.0.1:8/a") == "http://127.0.0.1:8/a"
    assert "127.0.0.1:8" in _base._SOUND_NETLOCS
    for _ in range(2):
        with pytest.raises(AttemptFailed, match="Port out of range"):
            encode_url("http://127.0.0.1:99999/a")
    assert "127.0.0.1:99999" not in _base._SOUND_NETLOCS


# -- secrets (item 8) ------------------------------------------------------------------------


async def test_query_values_under_unlisted_keys_are_redacted(
    http_server: ObjectServer, caplog: pytest.LogCaptureFixture
) -> None:
    http_server.fail("p", "503", "404")
    fast_retries(http_server, retry=asyncload.Retry(attempts=2, backoff=0.01))
    url = http_server.url_for("p") + "?access_key=AK-77&auth=tok-88&X-Amz-Expires=60&part=3"
    with caplog.at_level(logging.DEBUG, logger="asyncload"), pytest.raises(StorageError) as info:
        await asyncload.read(url)
    text = str(info.value) + "\n".join(r.getMessage() for r in caplog.records)
    assert "AK-77" not in text
    assert "tok-88" not in text
    assert "X-Amz-Expires=60" in text
    assert "part=3" in text


async def test_s3_error_body_reaches_the_message_without_its_secrets(
    http_server: ObjectServer,
) -> None:
    http_server.put("signed", DATA)
    http_server.fail("signed", "s3-403")
    url = http_server.url_for("signed") + "?X-Amz-Signature=f00d&X-Amz-Credential=AKIAXYZ"
    with pytest.raises(PermissionDenied) as info:
        await asyncload.read(url)
    message = str(info.value)
    assert "SignatureDoesNotMatch" in message  # the useful part of the body is kept
    for secret in ("AKIAFAKEACCESSKEY01", "fake-string-to-sign-77", "fakesignatureprovided99"):
        assert secret not in message
    assert "f00d" not in message
    assert "AKIAXYZ" not in message


# -- configure() prefixes and credentials in URLs (item 9) ---------------------------------


async def test_prefix_settings_apply_to_urls_with_userinfo(http_server: ObjectServer) -> None:
    http_server.put("auth.bin", DATA)
    _storage.configure(http_server.url, headers={"X-Test": "configured"}, read_timeout=7.0)
    url = f"http://alice:pw@127.0.0.1:{http_server.port}/auth.bin"
    assert _storage.options_for(url).read_timeout == 7.0
    assert await asyncload.read(url) == DATA
    assert http_server.headers_seen[-1].get("X-Test") == "configured"
    # A prefix configured with the credentials still wins for URLs that carry them.
    _storage.configure(f"http://alice:pw@127.0.0.1:{http_server.port}", read_timeout=9.0)
    assert _storage.options_for(url).read_timeout == 9.0
    assert _storage.options_for(http_server.url_for("auth.bin")).read_timeout == 7.0
    # `@` in the path or query is not userinfo.
    assert _storage.options_for(f"http://other:1/a@{http_server.url}").read_timeout == 30.0


# -- resuming a stream of an object replaced meanwhile (item 11) ---------------------------


@pytest.mark.parametrize("conditionals", [True, False])
async def test_stream_never_splices_two_versions(
    http_server: ObjectServer, conditionals: bool
) -> None:
    old, new = DATA * 8, bytes(reversed(DATA)) * 8
    url = http_server.put("v.bin", old)
    http_server.replacements["v.bin"] = new
    http_server.fail("v.bin", "short-replace")
    http_server.conditionals = conditionals  # False: the server ignores If-Match/If-Range
    fast_retries(http_server)
    got = bytearray()

    async def drain() -> None:
        async for chunk in asyncload.stream(url, chunk_size=1024):
            got.extend(chunk)

    with pytest.raises(asyncload.ObjectChanged, match="read it again") as info:
        await drain()
    assert 0 < len(got) < len(old)
    assert bytes(got) == old[: len(got)]  # nothing of the new version was delivered
    assert info.value.status == 412
    assert info.value.attempts == 2  # the cut one and the refused resume: not retried
    assert http_server.hits["v.bin"] == 2
    first, second = http_server.headers_seen
    assert second["Range"] == f"bytes={len(got)}-"
    assert second["If-Match"] == second["If-Range"] == f'"{hash(old) & 0xFFFFFFFF:x}"'
    assert "If-Match" not in first
    # Streaming it again from the start gives the new version whole.
    assert b"".join([c async for c in asyncload.stream(url)]) == new


async def test_stream_resume_of_an_unchanged_object_is_conditional(
    http_server: ObjectServer,
) -> None:
    url = http_server.put("same.bin", DATA * 8)
    http_server.fail("same.bin", "short")
    fast_retries(http_server)
    assert b"".join([c async for c in asyncload.stream(url, chunk_size=1024)]) == DATA * 8
    assert http_server.headers_seen[1]["If-Match"] == f'"{hash(DATA * 8) & 0xFFFFFFFF:x}"'


# -- https:// against a plain-HTTP port (item 13) ------------------------------------------


async def test_https_against_plain_http_asks_whether_the_server_is_plain_http(
    http_server: ObjectServer,
) -> None:
    http_server.put("x", DATA)
    url = f"https://127.0.0.1:{http_server.port}/x"
    with pytest.raises(ConnectError, match="is this server plain HTTP") as info:
        await asyncload.read(url)
    assert "verification" not in str(info.value)
    assert info.value.attempts == 1


# -- pacing new connections (issue 14, item 4) ---------------------------------------------


N_FILES = 200


@pytest.fixture
def python_http_server(tmp_path: Path) -> Iterator[int]:
    """`python -m http.server` over N_FILES small files; yields its port."""
    for i in range(N_FILES):
        (tmp_path / f"{i}.bin").write_bytes(bytes([i % 256]) * 1000)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "http.server did not start"
                time.sleep(0.05)
        yield port
    finally:
        server.kill()
        server.wait(10)


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_small_listen_backlog_sees_no_syn_retry_stalls(python_http_server: int) -> None:
    # `python -m http.server`: a listen backlog of 5 and a new connection per request
    # (HTTP/1.0). A burst of 64 connections overflows it; the dropped ones wait for the
    # kernel's SYN retry at 1 s (then 3 s). Paced, none does: a burst of 8 still overflows it
    # when the server is slow to accept (a busy machine), and those connects are raced by fresh
    # ones (test_pacing.py: test_a_connect_whose_syn_was_dropped_is_raced_by_a_fresh_one).
    port = python_http_server
    _storage.set_pool_size(64)

    async def timed(i: int) -> float:
        t0 = time.monotonic()
        data = await asyncload.read(f"http://127.0.0.1:{port}/{i}.bin")
        assert data == bytes([i % 256]) * 1000
        return time.monotonic() - t0

    try:
        latencies = await asyncio.gather(*(timed(i) for i in range(N_FILES)))
    finally:
        await _storage.aclose()
    stalled = sorted(t for t in latencies if t >= 1.0)
    assert not stalled, f"{len(stalled)} of {N_FILES} requests hit a SYN-retry stall: {stalled[:5]}"
