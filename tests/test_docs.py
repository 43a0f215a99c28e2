"""``make docs`` can fail: a broken link, a literal Sphinx role, a reST ``::`` leftover, a
repository path in prose or an ``Example:`` section breaks the build; the real site builds
cleanly, renders docstring examples as code, and its search finds the pages people look for; the
README's first example runs as written."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from types import ModuleType

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
    (tmp_path / "examples").symlink_to(ROOT / "examples")  # pymdownx.snippets includes them
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
    # The site search finds the pages people look for (the search has no stemming: the words
    # themselves must be in the pages).
    index = json.loads((tmp_path / "site" / "search" / "search_index.json").read_text())
    for word, page in [
        ("tensorboard", "guides/logging-stats/"),
        ("migrate", "migrating/"),
        ("tuning", "tuning/"),
        ("faq", "faq/"),
    ]:
        hits = {
            d["location"].split("#")[0]
            for d in index["docs"]
            if word in (d["title"] + " " + d["text"]).lower()
        }
        assert page in hits, (word, sorted(hits))


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_rest_leftover_or_a_repository_path_fails_the_build(tmp_path: Path) -> None:
    # What a docstring or a page must not show a reader: reST's literal-block marker, a path
    # into the repository, an `Example:` section (rendered by griffe as below).
    proc = _build(
        tmp_path,
        "A decoder needs no subclass::\n\n"
        "    def decode(data): ...\n\n"
        "The protocol is described in `src/asyncload/_protocol.py`.\n\n"
        '<details class="example" open><summary>Example</summary><p>x</p></details>',
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log
    assert "reST '::'" in log
    assert "subclass::" in log
    assert "src/asyncload/_protocol.py" in log
    assert "'Example:' docstring section" in log
    assert "Aborted" in log


def _hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mkdocs_hooks", ROOT / "mkdocs_hooks.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("html", "needle"),
    [
        ("<p>Raises :class:`RuntimeError`.</p>", "Sphinx role"),
        ("<p>needs no subclass::</p><pre><code>x</code></pre>", "reST '::'"),
        ("<p>see <code>tests/test_mix.py</code></p>", "repository path"),
        ("<p>(_tuning.py says why)</p>", "repository path"),
        ("<p>as NOTE [ Data flow ] says</p>", "repository path"),
        ("<p><code>asyncload._hedge.counts()</code> gives</p>", "repository path"),
        ('<details class="example" open><summary>Example</summary></details>', "'Example:'"),
    ],
)
def test_the_page_check_names_each_leftover(html: str, needle: str) -> None:
    found = _hooks().problems(html)
    assert len(found) == 1, found
    assert needle in found[0]


@pytest.mark.parametrize(
    "html",
    [
        "<pre><code>asyncload.TarShards('a-{0..9}.tar::b-{0..9}.tar')\nsrc/asyncload</code></pre>",
        "<p><code>a.tar::b.tar</code> joins two patterns; see <code>http://[::1]:8000/x</code></p>",
        "<p>python benchmarks/bench_shards.py and asyncload.read_sync and __init__.py</p>",
    ],
)
def test_the_page_check_leaves_code_and_public_names_alone(html: str) -> None:
    assert _hooks().problems(html) == []


def test_docstrings_use_examples_sections() -> None:
    # Google style: "Examples:". griffe renders "Example:" as a quoted run-on paragraph.
    bad = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in sorted((ROOT / "src").rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if line.strip() == "Example:"
    ]
    assert bad == []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _first_python_block(text: str) -> str:
    match = re.search(r"```python\n(.*?)```", text, re.S)
    assert match, "no python block"
    return match.group(1)


def test_getting_started_shows_the_readme_example() -> None:
    # One first example, the same on both first screens.
    readme = _first_python_block((ROOT / "README.md").read_text())
    assert readme in (ROOT / "docs" / "index.md").read_text()
    assert len(readme.strip().splitlines()) <= 16


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_readme_example_runs_as_written(tmp_path: Path) -> None:
    # The README's first screen: `asyncload serve data --demo-data 1024 --latency 50`, then the
    # script, unchanged but for the port.
    readme = (ROOT / "README.md").read_text()
    first_screen = readme[: readme.index("## ")]
    assert "pip install asyncload-torch" in first_screen
    assert "asyncload demo" in first_screen
    serve = re.search(r"^asyncload (serve .*?)\s+#", first_screen, re.M)
    assert serve, first_screen
    port = _free_port()
    argv = [*shlex.split(serve.group(1)), "--port", str(port)]
    with subprocess.Popen(
        [sys.executable, "-m", "asyncload", *argv],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    ) as server:
        try:
            assert server.stdout is not None
            assert "127.0.0.1" in server.stdout.readline()  # it listens
            script = tmp_path / "quickstart.py"
            code = _first_python_block(first_screen)
            assert "127.0.0.1:8000" in code
            script.write_text(code.replace("127.0.0.1:8000", f"127.0.0.1:{port}"))
            proc = subprocess.run(
                [sys.executable, str(script)],
                cwd=tmp_path,
                capture_output=True,
                text=True,
                timeout=100,
            )
            assert proc.returncode == 0, proc.stderr[-3000:]
            assert re.match(r"1,024 samples at [\d,]+/s", proc.stdout), proc.stdout
        finally:
            server.terminate()
