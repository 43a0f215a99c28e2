"""Shared fixtures: real servers on 127.0.0.1 and leak checks for processes and shared memory."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ._azurite import AzuriteServer, azurite_context
from ._gcs_server import GcsServer, gcs_server_context
from ._http_server import ObjectServer, http_server_context
from ._procs import worker_processes
from ._s3_server import S3Server, s3_server_context


@pytest.fixture(scope="session")
def _http_server_session() -> Iterator[ObjectServer]:
    yield from http_server_context()


@pytest.fixture
def http_server(_http_server_session: ObjectServer) -> Iterator[ObjectServer]:
    """The loopback object server, emptied and with no latency or faults for each test."""
    _http_server_session.reset()
    yield _http_server_session
    _http_server_session.reset()


def _shm_entries() -> set[str]:
    shm = Path("/dev/shm")
    return {p.name for p in shm.iterdir()} if shm.exists() else set()


@pytest.fixture
def no_leaks() -> Iterator[None]:
    """Fail the test if it leaves worker processes or /dev/shm entries behind."""
    before = {p.pid for p in worker_processes()}
    before_shm = _shm_entries()
    yield
    deadline = time.monotonic() + 10
    while True:
        # pytest.raises keeps the exception, whose traceback holds the test's frame and thus
        # the loader's iterator: a reference cycle only the collector frees. Real programs drop
        # the exception at the end of `except`, and the iterator with it.
        gc.collect()
        left = [p for p in worker_processes() if p.pid not in before]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not left, f"processes left behind: {[(p.pid, p.cmdline()) for p in left]}"
    new_shm = {n for n in _shm_entries() - before_shm if "torch" in n or "asyncload" in n}
    assert not new_shm, f"shared memory left behind: {sorted(new_shm)}"


# -- S3 (moto) -----------------------------------------------------------------------------


@pytest.fixture(scope="session")
def _s3_server_session() -> Iterator[S3Server]:
    pytest.importorskip("moto.server", reason="moto[server] is not installed")
    yield from s3_server_context()


@pytest.fixture
def s3_server(_s3_server_session: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Server]:
    """moto's S3 server on 127.0.0.1, with AWS_* variables pointing at it for this test only.

    Storage settings and cached stores are reset around the test so the environment is read
    afresh.
    """
    from asyncload import _storage

    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in _s3_server_session.env().items():
        monkeypatch.setenv(name, value)
    _storage.reset()
    yield _s3_server_session
    _s3_server_session.enforce_auth(False)
    _storage.reset()


# -- GCS (fake-gcs-server) and Azure (Azurite): tests/_gcs_server.py, tests/_azurite.py --------

# Variables that would point a test's stores elsewhere than the emulator it means.
_CLOUD_ENV = (
    "STORAGE_EMULATOR_HOST GOOGLE_BASE_URL GOOGLE_SKIP_SIGNATURE GOOGLE_SERVICE_ACCOUNT "
    "GOOGLE_SERVICE_ACCOUNT_PATH GOOGLE_SERVICE_ACCOUNT_KEY GOOGLE_APPLICATION_CREDENTIALS "
    "GOOGLE_BEARER_TOKEN AZURE_STORAGE_CONNECTION_STRING AZURE_STORAGE_USE_EMULATOR "
    "AZURE_STORAGE_ACCOUNT_NAME AZURE_STORAGE_ACCOUNT_KEY AZURE_STORAGE_SAS_KEY "
    "AZURE_STORAGE_ENDPOINT AZURE_ENDPOINT SSL_CERT_FILE"
).split()


@pytest.fixture(scope="session")
def _gcs_session() -> Iterator[GcsServer]:
    yield from gcs_server_context()


@pytest.fixture(scope="session")
def _azurite_session() -> Iterator[AzuriteServer]:
    yield from azurite_context()


@pytest.fixture
def gcs_server(_gcs_session: GcsServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[GcsServer]:
    """fake-gcs-server on 127.0.0.1 (and its fault proxy), no cloud variables set."""
    from asyncload import _storage

    for name in _CLOUD_ENV:
        monkeypatch.delenv(name, raising=False)
    _storage.reset()
    _gcs_session.proxy.reset()
    yield _gcs_session
    _storage.reset()


@pytest.fixture
def azurite(
    _azurite_session: AzuriteServer, monkeypatch: pytest.MonkeyPatch
) -> Iterator[AzuriteServer]:
    """Azurite's blob service on 127.0.0.1 (and its fault proxy), no cloud variables set."""
    from asyncload import _storage

    for name in _CLOUD_ENV:
        monkeypatch.delenv(name, raising=False)
    _storage.reset()
    _azurite_session.proxy.reset()
    yield _azurite_session
    _storage.reset()


# -- storage -------------------------------------------------------------------------------


@pytest.fixture
def clean_storage() -> Iterator[None]:
    """No configured prefixes or cached stores before or after the test.

    aiohttp sessions need no teardown here: each is closed when its event loop shuts down
    (pytest-asyncio's runner calls ``shutdown_asyncgens``), which this also exercises.
    """
    from asyncload import _storage

    _storage.reset()
    yield
    _storage.reset()
