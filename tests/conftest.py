"""Shared fixtures: real servers on 127.0.0.1 and leak checks for processes and shared memory."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
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
    if not shm.exists():
        return set()
    # torch's tensors, asyncload's blocks, and multiprocessing's semaphores (queues, events).
    return {
        p.name for p in shm.iterdir() if any(k in p.name for k in ("torch", "asyncload", "mp-"))
    }


# Threads that live as long as the process by design: the one that stops workers, and the
# loop behind read_sync / list_files from sync code.
_LONG_LIVED = ("asyncload-reaper", "asyncload-sync")


def _threads() -> set[threading.Thread]:
    return {
        t
        for t in threading.enumerate()
        if t.name.startswith("asyncload") and not t.name.startswith(_LONG_LIVED)
    }


def _left(before: tuple[set[int], set[threading.Thread], set[str]]) -> list[str]:
    procs, threads, shm = before
    left = []
    for p in worker_processes():
        if p.pid not in procs:
            try:
                left.append(f"process {p.pid}: {' '.join(p.cmdline())}")
            except psutil.Error:  # exited a moment ago
                continue
    left += [f"thread {t.name}" for t in _threads() - threads if t.is_alive()]
    left += [f"/dev/shm/{n}" for n in sorted(_shm_entries() - shm)]
    return left


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    """Fail the test if it leaves a worker process, an asyncload thread or a /dev/shm entry
    behind (as torch's tests check for leaked workers). Every test, by default."""
    before = ({p.pid for p in worker_processes()}, _threads(), _shm_entries())
    yield
    if not _left(before):
        return
    from asyncload._workers.reaper import reaper

    deadline = time.monotonic() + 15
    while True:
        # pytest.raises keeps the exception, whose traceback holds the test's frame and thus
        # the loader's iterator: a reference cycle only the collector frees. Real programs drop
        # the exception at the end of `except`, and the iterator with it. Stops the reaper was
        # handed meanwhile take a moment (NOTE [ Who stops workers ]).
        gc.collect()
        reaper.drain(5)
        left = _left(before)
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not left, f"left behind by the test: {left}"


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
    from asyncload._storage import api as _storage

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
    from asyncload._storage import api as _storage

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
    from asyncload._storage import api as _storage

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
    from asyncload._storage import api as _storage

    _storage.reset()
    yield
    _storage.reset()
