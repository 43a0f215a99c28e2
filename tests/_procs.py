"""Processes of tests: which ones a test left behind (workers count, the shared forkserver
and tracker don't), and scripts of ``tests/_scripts`` run in a fresh interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil

import asyncload
from asyncload._workers.start_method.forkserver import server_pid

SCRIPTS = Path(__file__).resolve().parent / "_scripts"
_SRC = str(Path(asyncload.__file__).resolve().parent.parent)


def script_env() -> dict[str, str]:
    """This environment, with the package under test importable by a script."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([_SRC, os.environ.get("PYTHONPATH", "")])}


def run_script(
    name: str,
    *args: str,
    timeout: float = 90,
    relative: bool = False,
    stderr_clean: bool = False,
) -> dict[str, Any]:
    """Run ``tests/_scripts/<name>`` with *args* in a fresh interpreter (named ``./<name>``
    from its folder when *relative*); the JSON object its last line of output prints. With
    *stderr_clean*, no traceback (its own or a child's) may appear on its stderr."""
    try:
        done = subprocess.run(
            [sys.executable, f"./{name}" if relative else str(SCRIPTS / name), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=script_env(),
            cwd=SCRIPTS if relative else None,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:  # what it printed: a hang's stacks, if it dumps them
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr
        raise AssertionError(f"{name} ran over {timeout} s; its stderr:\n{err}") from None
    assert done.returncode == 0, done.stderr
    if stderr_clean:
        assert "Traceback" not in done.stderr, done.stderr
        assert "Exception ignored" not in done.stderr, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _is_helper(p: psutil.Process, me: int) -> bool:
    """multiprocessing's forkserver and resource tracker live for the whole test session (the
    forkserver may be forked from this process: then only its pid tells it from a worker)."""
    try:
        if p.ppid() != me:
            return False
        cmd = " ".join(p.cmdline())
        return p.pid == server_pid() or "forkserver" in cmd or "resource_tracker" in cmd
    except psutil.Error:
        return True


def worker_processes() -> list[psutil.Process]:
    """Live descendants of this process other than the forkserver and resource tracker.

    Workers started by the forkserver are its children, so they are found through it.
    """
    me = os.getpid()
    found = []
    for p in psutil.Process(me).children(recursive=True):
        try:
            if _is_helper(p, me) or p.status() == psutil.STATUS_ZOMBIE:
                continue
        except psutil.Error:
            continue
        found.append(p)
    return found
