"""Start-up mistakes end in a clear error in the main process, or in a start method that works
(issue 12, items 4 and 5). Each case runs a script in its own interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPTS = Path(__file__).resolve().parents[2] / "_scripts"
ENV_PATH = str(ROOT / "src")


def _loop_line(script: str) -> int:
    """The line of *script* that iterates the loader (where workers start)."""
    lines = (SCRIPTS / script).read_text().splitlines()
    return next(i for i, text in enumerate(lines, 1) if "for b in loader" in text)


def _run(args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    import os

    env = {**os.environ, "PYTHONPATH": ENV_PATH}
    return subprocess.run(
        [sys.executable, *args], input=stdin, capture_output=True, text=True, timeout=90, env=env
    )


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_a_script_without_main_guard_gets_pythons_error_in_the_main_process(method: str) -> None:
    out = _run([str(SCRIPTS / "no_guard.py"), method])
    assert out.returncode == 1
    assert out.stdout.count("body runs") == 1, out.stdout  # not run again in a worker
    assert "RuntimeError: \n        An attempt has been made to start a new process" in out.stderr
    assert "if __name__ == '__main__':" in out.stderr
    assert f"started from line {_loop_line('no_guard.py')} of" in out.stderr
    assert "no_guard.py" in out.stderr
    assert "exit code" not in out.stderr


def test_a_script_without_main_guard_still_works_with_fork() -> None:
    out = _run([str(SCRIPTS / "no_guard.py"), "fork"])
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["body runs", "[[0, 1, 2], [3, 4, 5]]"]


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_a_function_defined_under_the_guard_is_named_in_the_main_process(method: str) -> None:
    out = _run([str(SCRIPTS / "guarded_collate.py"), method, "guarded"])
    assert out.returncode == 1
    assert "asyncload._exceptions.NotPicklable: guarded_collate (used by the collate_fn)" in (
        out.stderr
    )
    assert "only under `if __name__ == '__main__':`" in out.stderr
    assert "exit code" not in out.stderr
    ok = _run([str(SCRIPTS / "guarded_collate.py"), method, "top"])
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == "[[0, 1, 2], [3, 4, 5]]"


def test_a_script_from_stdin_is_run_with_fork_as_in_a_notebook() -> None:
    script = (SCRIPTS / "from_stdin.py").read_text()
    out = _run(["-", str(ROOT)], stdin=script)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[[0, 1, 2], [3, 4, 5]]"
    assert "instead of 'forkserver'" in out.stderr
    # the script's `for` line, not asyncload's:
    assert f"<stdin>:{_loop_line('from_stdin.py')}: AsyncloadWarning" in out.stderr


def test_a_script_from_stdin_with_threads_is_refused_with_the_fix() -> None:
    script = (SCRIPTS / "from_stdin.py").read_text()
    out = _run(["-", str(ROOT), "threads"], stdin=script)
    assert out.returncode == 1
    assert "NotPicklable: asyncload can't start DataLoader workers" in out.stderr
    assert "'user-thread'" in out.stderr
    assert "save the script to a file" in out.stderr


_NOTEBOOK = """\
import sys, threading, warnings
sys.path.insert(0, {root!r})
warnings.simplefilter("always")
import asyncload
from tests._datasets import SyncNumbers
{setup}
loader = asyncload.DataLoader({dataset}, batch_size=3, num_workers=1)
print([list(map(int, b)) for b in loader])
"""

_THREAD = "stop = threading.Event()\nthreading.Thread(target=stop.wait, daemon=True).start()"


def test_a_notebook_with_threads_running_uses_forkserver_instead_of_fork() -> None:
    # `python -c` has no __main__.__file__, like a notebook; a thread of the user's runs.
    code = _NOTEBOOK.format(root=str(ROOT), setup=_THREAD, dataset="SyncNumbers(6)")
    out = _run(["-c", code])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[[0, 1, 2], [3, 4, 5]]"
    assert "other thread(s) run in this process" in out.stderr
    assert "starting them with 'forkserver' instead" in out.stderr
    assert "<string>:9: AsyncloadWarning" in out.stderr  # the `for` line, not asyncload's
    assert "instead of 'forkserver'" not in out.stderr  # never forked


def test_a_notebook_after_obstore_uses_forkserver() -> None:
    pytest.importorskip("obstore")
    setup = "import obstore"
    code = _NOTEBOOK.format(root=str(ROOT), setup=setup, dataset="SyncNumbers(6)")
    out = _run(["-c", code])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[[0, 1, 2], [3, 4, 5]]"
    assert "obstore (s3://, gs://, az://) has been used" in out.stderr


def test_a_notebook_class_with_threads_running_is_refused_with_the_fix() -> None:
    setup = (
        _THREAD + "\nclass Local(torch.utils.data.Dataset):\n"
        "    def __len__(self): return 6\n"
        "    def __getitem__(self, i): return i\n"
        "import torch.utils.data"
    )
    setup = "import torch.utils.data\n" + setup
    code = _NOTEBOOK.format(root=str(ROOT), setup=setup, dataset="Local()")
    out = _run(["-c", code])
    assert out.returncode == 1
    assert "NotPicklable: asyncload can't start DataLoader workers" in out.stderr
    assert "Local (used by the dataset) is defined in __main__" in out.stderr
    assert "Move the dataset and its functions to a module" in out.stderr


@pytest.mark.usefixtures("no_leaks")
@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_a_worker_that_cannot_unpickle_its_arguments_says_so(method: str) -> None:
    import asyncload

    from ..._guard_datasets import FailsToUnpickle

    loader = asyncload.DataLoader(
        FailsToUnpickle(), batch_size=2, num_workers=1, multiprocessing_context=method
    )
    with pytest.raises(asyncload.NotPicklable, match="could not unpickle its arguments") as info:
        list(loader)
    assert "Can't get attribute 'Vanished'" in str(info.value)
    assert "exit code" not in str(info.value)


def test_a_loader_built_outside_the_guard_starts_nothing_from_the_servers_copy() -> None:
    out = _run([str(SCRIPTS / "built_at_top.py"), "forkserver"])
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"batches": [[0, 1, 2], [3, 4, 5]], "servers": 1}
