"""MkDocs hooks: the "Storage backends" nav section, and checks of each rendered page.

The storage pages are written by whoever adds a backend; with ``on_config`` a new page under
``docs/storage/`` shows up in the nav without anyone editing ``mkdocs.yml`` (and a page that is
not there yet is not a broken nav entry). The pages we know come in reading order (``ORDER``),
any other page after them by file name.

``on_post_page`` warns (an error under ``strict``) about what a reader should never see in a
rendered page: a literal Sphinx role or a reST ``::`` that a docstring left in the text, an
``Example:`` docstring section (Google style wants ``Examples:``; ``Example:`` renders as a
quoted run-on paragraph), and repository paths (``src/...``, ``tests/...``, a private
``_module.py``, a ``NOTE [...]`` block) that a user who installed the package does not have.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

SECTION = "Storage backends"
FOLDER = "storage"
# Reading order: the overview, then each backend, then what sits on top of them all.
ORDER = ("index", "http", "s3", "gcs", "azure", "local", "cache")


def _rank(page: Path) -> tuple[int, str]:
    return (ORDER.index(page.stem) if page.stem in ORDER else len(ORDER), page.name)


def on_config(config: Any) -> Any:
    folder = Path(config["docs_dir"]) / FOLDER
    pages = sorted(folder.glob("*.md"), key=_rank)
    entries = [f"{FOLDER}/{p.name}" for p in pages]
    nav = config["nav"] or []
    for i, item in enumerate(nav):
        if isinstance(item, dict) and SECTION in item:
            if entries:
                nav[i] = {SECTION: entries}
            else:
                del nav[i]  # an empty section would be a nav entry without pages
            break
    return config


# A Sphinx role left in a docstring (":class:`X`") renders as literal text; mkdocstrings wants
# [`X`][asyncload.X] or plain ``X``. Code (blocks and inline) may show roles: it is skipped.
_ROLE = re.compile(r":(?:class|func|meth|mod|attr|exc|data|obj|ref):")
# reST's literal-block marker ("needs no subclass::") renders as a literal "::" in Markdown.
_REST_LITERAL = re.compile(r"\w::(?=\s|$)")
# Repository paths, checked in prose and inline code alike (not in code blocks): a user who
# installed the package has no src/ or tests/, and private modules (asyncload._cache) are not
# theirs to read or call.
_REPO_PATH = re.compile(
    r"(?<![\w./-])(?:src/asyncload\b|tests/[\w/]+|_[a-z][a-z0-9_]*\.py\b)"
    r"|\bNOTE \[ |\basyncload\.(?:[a-z]\w*\.)*_[a-z]\w*"
)
# griffe renders an "Example:" section as an admonition, its doctest as nested quotes.
_EXAMPLE_SECTION = re.compile(r"<summary>Example</summary>|<p class=\"admonition-title\">Example<")
_PRE = re.compile(r"<pre\b.*?</pre>", re.S)
_CODE = re.compile(r"<pre\b.*?</pre>|<code\b[^>]*>.*?</code>", re.S)
_TAG = re.compile(r"<[^>]+>")
log = logging.getLogger("mkdocs.hooks.asyncload")


def _context(text: str, match: re.Match[str]) -> str:
    return " ".join(text[max(match.start() - 50, 0) : match.end() + 30].split())


def problems(html: str) -> list[str]:
    """What a reader should not see in the rendered page *html*, one line each."""
    found: list[str] = []
    prose = _TAG.sub("", _CODE.sub("", html))
    for match in _ROLE.finditer(prose):
        found.append(f"a literal Sphinx role in the page: …{_context(prose, match)}…")
    for match in _REST_LITERAL.finditer(prose):
        found.append(
            f"a reST '::' left in the page (write a fenced code block): …{_context(prose, match)}…"
        )
    text = _TAG.sub("", _PRE.sub("", html))
    for match in _REPO_PATH.finditer(text):
        found.append(
            f"a repository path or internal note in the page (link to a page, or name the "
            f"public API): …{_context(text, match)}…"
        )
    if _EXAMPLE_SECTION.search(html):
        found.append("an 'Example:' docstring section (Google style wants 'Examples:')")
    return found


def on_post_page(output: str, page: Any, config: Any) -> str:
    for problem in problems(output):
        # A warning, so `strict: true` fails the build.
        log.warning("%s: %s", page.file.src_uri, problem)
    return output
