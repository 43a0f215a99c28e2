"""Benchmark rows that run in a fresh interpreter each: start-up counts as a user pays it.

A script's row runs as ``python SCRIPT --child ARGS...`` and prints one ``RESULT {json}`` line
(``result``); the parent reads it back (``spawn``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any


def result(**fields: Any) -> None:
    """Print a child row's figures, the line ``spawn`` reads."""
    print("RESULT " + json.dumps(fields), flush=True)


def spawn(script: str, *args: str, what: str, timeout: float = 300) -> dict[str, Any]:
    """Run ``SCRIPT --child ARGS`` in a fresh interpreter; its ``result``. *what* names the row
    in the error that a failed child raises (with its stderr)."""
    # A script file, not ``-c``: the forkserver re-imports __main__ from it.
    out = subprocess.run(
        [sys.executable, script, "--child", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ),
        check=False,
    )
    if out.returncode != 0:
        raise SystemExit(f"{what} failed:\n{out.stderr}")
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))
    got: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    return got
