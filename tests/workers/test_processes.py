"""A pass's worker processes (``_workers/processes.py``): started from a daemonic process too."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "_scripts" / "in_pool.py"


def _run(script: Path, *args: str) -> str:
    """Run *script* with *args* in a fresh interpreter; its stdout, once it exited with 0."""
    out = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    return out.stdout


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            continue
    return alive


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_a_loader_runs_inside_a_multiprocessing_pool_worker(method: str) -> None:
    # multiprocessing refuses children to a daemonic process ("daemonic processes are not
    # allowed to have children"), which torch's DataLoader raises there as it is.
    got = json.loads(_run(SCRIPT, method, "pass"))
    assert got == [[[0, 1, 2, 3], [4, 5, 6, 7]]] * 2


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_a_pool_worker_terminated_mid_pass_leaves_no_process(method: str, tmp_path: Path) -> None:
    # A daemonic process is killed at its parent's exit (Pool.terminate: SIGTERM), with no
    # finalizer run: its loader's workers and fork server go by themselves.
    pids = json.loads(_run(SCRIPT, method, "terminate", str(tmp_path / "pids.json")))
    assert len(pids) >= 3  # the pool worker and its loader's 2 workers, at least
    deadline = time.monotonic() + 10
    while (alive := _alive(pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive, [" ".join(psutil.Process(p).cmdline())[-200:] for p in _alive(alive)]


FORK_SCRIPT = SCRIPT.with_name("in_fork_child.py")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["plain", "persistent"])
def test_a_child_made_by_fork_starts_its_own_workers_and_leaves_the_parents(mode: str) -> None:
    # The child inherits the loader, its live pass, its standby set and the forkserver: all the
    # parent's. It must neither read from nor stop them, and must start its own.
    got = json.loads(_run(FORK_SCRIPT, mode))
    batches = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert got["before"] == got["child"] == got["live"] == got["after"] == batches
    assert "was started in process" in got["stolen"]
    assert got["exitcode"] == 0
