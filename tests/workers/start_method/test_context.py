"""Start methods: forkserver by default, fork in interactive sessions (said once), and init."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import asyncload
from asyncload._workers.start_method.context import resolve_context

from ..._datasets import FrozenCount, InitMark, init_marks_worker

pytestmark = pytest.mark.usefixtures("no_leaks")

ROOT = Path(__file__).resolve().parents[3]


def test_forkserver_is_the_default_and_fork_on_request() -> None:
    assert resolve_context(None).get_start_method() == "forkserver"
    assert resolve_context("fork").get_start_method() == "fork"
    loader = asyncload.DataLoader(
        InitMark(), batch_size=2, num_workers=1, multiprocessing_context="fork"
    )
    assert list(loader) == [["missing", "missing"]] * 2


def test_worker_init_fn_runs_in_each_worker_before_fetching() -> None:
    loader = asyncload.DataLoader(
        InitMark(), batch_size=1, num_workers=2, worker_init_fn=init_marks_worker, collate_fn=list
    )
    assert sorted(b[0] for b in loader) == ["initialised 0"] * 2 + ["initialised 1"] * 2


def test_interactive_session_falls_back_to_fork_and_says_so_once() -> None:
    # `python -c` has a __main__ without a file, like a notebook or the REPL.
    code = (
        f"import sys, warnings; sys.path.insert(0, {str(ROOT)!r})\n"
        "warnings.simplefilter('always')\n"
        "import asyncload\n"
        "from tests._datasets import SyncNumbers\n"
        "for _ in range(2):\n"
        "    loader = asyncload.DataLoader(SyncNumbers(6), batch_size=3, num_workers=1)\n"
        "    print([b.tolist() for b in loader])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.splitlines() == ["[[0, 1, 2], [3, 4, 5]]"] * 2
    assert out.stderr.count("instead of 'forkserver'") == 1, out.stderr


def test_workers_see_the_environment_of_the_main_process_now(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Start the forkserver first, then change the environment: workers must see the change
    # (credentials exported after the first loader ran, say), as they would with fork or spawn.
    list(asyncload.DataLoader(InitMark(), batch_size=4, num_workers=1))
    monkeypatch.setenv("ASYNCLOAD_TEST_INIT", "set later")
    loader = asyncload.DataLoader(InitMark(), batch_size=4, num_workers=1)
    assert list(loader) == [["set later"] * 4]


def test_workers_freeze_their_start_up_objects_out_of_the_collector() -> None:
    loader = asyncload.DataLoader(FrozenCount(), batch_size=2, num_workers=1, collate_fn=list)
    (counts,) = list(loader)
    assert min(counts) > 10_000  # torch and friends, imported before the loop started
