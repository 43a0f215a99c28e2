"""Start-up in the background: the forkserver starts (preloaded) when a loader is built.

Each check runs in a fresh interpreter, where no forkserver has started yet: what the
constructor starts, and which modules the forkserver preloads, is then observable.
"""

from __future__ import annotations

import gc
import importlib.util
import multiprocessing

import pytest

import asyncload

from ..._procs import run_script


@pytest.mark.parametrize("how", ["string", "context"])
def test_an_explicit_forkserver_gets_the_preload(how: str) -> None:
    out = run_script("startup.py", how)
    assert "asyncload._workers.child" in out["preload"]


@pytest.mark.timeout(120)
def test_building_a_loader_starts_the_forkserver_in_the_background() -> None:
    out = run_script("startup.py", "loader")
    assert out["started"] is True
    assert "asyncload._workers.child" in out["preload"]
    assert out["others"] == []  # no worker: those start at iter()
    assert "asyncload._workers.start_method.preload" in out["preload"]
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
    from asyncload._workers.start_method import context as _context

    # Once per process: a second loader does not start another thread.
    asyncload.DataLoader(list(range(8)), num_workers=1)
    assert _context.start_early(multiprocessing.get_context("forkserver")) is False
