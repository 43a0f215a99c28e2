"""What the GCS and Azure emulator fixtures share: start a server process, wait, upload.

An emulator that cannot start makes its tests *fail* with the reason (not skip): a backend
whose tests silently do not run is a backend nobody tested.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(
    name: str, argv: list[str], probe: str, *, timeout: float = 30.0, cwd: str | None = None
) -> subprocess.Popen[bytes]:
    """Start *argv* and wait until *probe* (a URL) answers at all; fail the test if it won't."""
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=cwd)
    except OSError as exc:
        pytest.fail(f"cannot start {name} ({argv[0]}): {exc}. Run `make test` to install it.")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
            pytest.fail(f"{name} exited with code {proc.returncode} at start-up:\n{err[-2000:]}")
        try:
            with urllib.request.urlopen(probe, timeout=2):
                return proc
        except urllib.error.HTTPError:
            return proc  # it answers: an error status is an answer
        except OSError:
            time.sleep(0.1)
    stop(proc)
    pytest.fail(f"{name} did not answer {probe} within {timeout:.0f} s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
    if proc.stderr is not None:
        proc.stderr.close()


def upload(url: str, config: Mapping[str, Any], objects: Mapping[str, bytes]) -> None:
    """Put *objects* (key: bytes) under the store *url* with obstore, 32 at a time."""
    import obstore
    from obstore.store import from_url

    build: Callable[..., Any] = from_url
    store = build(url, config=dict(config), client_options={"allow_http": True})

    async def put_all() -> None:
        sem = asyncio.Semaphore(32)

        async def put(key: str, data: bytes) -> None:
            async with sem:
                await obstore.put_async(store, key, data)

        await asyncio.gather(*(put(k, v) for k, v in objects.items()))

    # A private thread and loop: obstore's runtime must not run in a loop pytest-asyncio owns.
    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, put_all()).result()
