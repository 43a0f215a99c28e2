"""Every ``examples/*.py`` runs to completion as a smoke test, in a fresh interpreter.

Examples start their own loopback servers (nothing leaves 127.0.0.1), so each runs as a user
would run it: ``python examples/NAME.py``, from the repository root.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
# Generous next to an example's few seconds: the 2-core CI machine also runs other tests.
TIMEOUT = 150


def test_examples_exist() -> None:
    # A glob that finds nothing would otherwise pass silently, e.g. after a directory rename.
    assert EXAMPLES, f"no examples found in {ROOT / 'examples'}"


def test_every_storage_backend_has_an_example() -> None:
    # Each documented backend is shown working against a loopback server (or an emulator).
    names = {p.name for p in EXAMPLES}
    for name in ("read_local.py", "read_http.py", "read_s3.py", "read_gcs.py", "read_azure.py"):
        assert name in names, f"examples/{name} is missing"


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(path: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        proc = subprocess.run(
            [sys.executable, str(path)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{path.name} did not finish in {TIMEOUT} s; output so far:\n{exc.stdout}")
    assert proc.returncode == 0, f"{path.name} exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert proc.stdout.strip(), f"{path.name} printed nothing; an example should show its result"
