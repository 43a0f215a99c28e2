"""``make docs`` can fail: a broken link or a literal Sphinx role breaks the build; the real
site builds cleanly and renders docstring examples as code."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mkdocs")
pytest.importorskip("mkdocstrings")

ROOT = Path(__file__).resolve().parents[1]


def _make_docs_args() -> list[str]:
    """The mkdocs arguments of the Makefile's ``docs`` recipe, so the test runs what CI runs."""
    recipe = re.search(r"^docs:.*\n\t(.+)$", (ROOT / "Makefile").read_text(), re.M)
    assert recipe, "no docs target in the Makefile"
    words = shlex.split(recipe.group(1))
    return words[[w.endswith("/mkdocs") for w in words].index(True) + 1 :]


def _build(tmp_path: Path, extra_markdown: str = "") -> subprocess.CompletedProcess[str]:
    """Build a copy of the site (docs, config, hooks; src linked) with *extra_markdown* added
    to the first page."""
    for name in ("mkdocs.yml", "mkdocs_hooks.py"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    (tmp_path / "src").symlink_to(ROOT / "src")
    if extra_markdown:
        with (tmp_path / "docs" / "index.md").open("a") as f:
            f.write("\n" + extra_markdown + "\n")
    args = [a if a != ".site" else str(tmp_path / "site") for a in _make_docs_args()]
    assert "--strict" in args
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", *args, "-f", str(tmp_path / "mkdocs.yml")],
        capture_output=True,
        text=True,
        timeout=170,
        cwd=tmp_path,
        env=env,
    )


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_broken_link_or_a_literal_role_fails_the_build(tmp_path: Path) -> None:
    proc = _build(
        tmp_path,
        "See [the example](../examples/nowhere.py).\n\n"
        "Raises :class:`RuntimeError` when a docstring keeps a Sphinx role.",
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log
    assert "nowhere.py" in log
    assert "Sphinx role" in log
    assert ":class:" in log
    assert "Aborted" in log


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_site_builds_cleanly_with_examples_as_code(tmp_path: Path) -> None:
    proc = _build(tmp_path)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    assert "WARNING" not in log
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    # Google-style "Examples:" sections render as highlighted code, never as a run-on paragraph.
    assert api.count("Examples:") >= 10
    assert not re.search(r"<p>\s*&gt;&gt;&gt;", api)
    # Cross-references resolved to links, none left as Markdown source.
    assert 'href="#asyncload.LoadError"' in api
    assert "][asyncload." not in api
    assert 'id="asyncload.read_sync"' in api
