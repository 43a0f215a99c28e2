"""Start-up in the background: the forkserver starts (preloaded) when a loader is built.

Each check runs in a fresh interpreter, where no forkserver has started yet: what the
constructor starts, and which modules the forkserver preloads, is then observable.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest

import asyncload

SRC = str(Path(asyncload.__file__).resolve().parent.parent)

SCRIPT = Path(__file__).resolve().parent / "_scripts" / "startup.py"


def _run(tmp_path: Path, how: str) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), how],
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize("how", ["string", "context"])
def test_an_explicit_forkserver_gets_the_preload(tmp_path: Path, how: str) -> None:
    out = _run(tmp_path, how)
    assert "asyncload._worker" in out["preload"]  # type: ignore[operator]


@pytest.mark.timeout(120)
def test_building_a_loader_starts_the_forkserver_in_the_background(tmp_path: Path) -> None:
    out = _run(tmp_path, "loader")
    assert out["started"] is True
    assert "asyncload._worker" in out["preload"]  # type: ignore[operator]
    assert out["others"] == []  # no worker: those start at iter()
    assert "asyncload._preload" in out["preload"]  # type: ignore[operator]
    # The server imported what every worker would import, and the main process did not.
    expected = ["uvloop"] + (["obstore"] if importlib.util.find_spec("obstore") else [])
    assert out["server_has"] == expected
    assert out["main_has_obstore"] is False


@pytest.mark.usefixtures("no_leaks")
def test_a_loader_dropped_before_iterating_leaves_nothing_behind() -> None:
    for ctx in (None, "forkserver", "spawn"):
        loader = asyncload.DataLoader(list(range(8)), num_workers=2, multiprocessing_context=ctx)
        del loader
    gc.collect()


def test_the_early_start_happens_once_per_process() -> None:
    from asyncload import _context

    # Once per process: a second loader does not start another thread.
    asyncload.DataLoader(list(range(8)), num_workers=1)
    assert _context.start_early(multiprocessing.get_context("forkserver")) is False
