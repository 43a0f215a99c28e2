"""Shared fixtures: real servers on 127.0.0.1 and leak checks for processes and shared memory."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from ._http_server import ObjectServer, http_server_context


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
    """Fail the test if it leaves child processes or /dev/shm entries behind."""
    me = psutil.Process(os.getpid())
    before_children = {p.pid for p in me.children(recursive=True)}
    before_shm = _shm_entries()
    yield
    deadline = time.monotonic() + 10
    while True:
        left = [
            p for p in me.children(recursive=True)
            if p.pid not in before_children and p.is_running() and p.status() != psutil.STATUS_ZOMBIE
            and "forkserver" not in " ".join(p.cmdline())
            and "resource_tracker" not in " ".join(p.cmdline())
        ]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not left, f"processes left behind: {[(p.pid, p.cmdline()) for p in left]}"
    new_shm = {n for n in _shm_entries() - before_shm if "torch" in n or "asyncload" in n}
    assert not new_shm, f"shared memory left behind: {sorted(new_shm)}"
