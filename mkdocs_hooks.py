"""MkDocs hooks: the "Storage backends" nav section, and a check for literal Sphinx roles.

The storage pages are written by whoever adds a backend; with ``on_config`` a new page under
``docs/storage/`` shows up in the nav without anyone editing ``mkdocs.yml`` (and a page that is
not there yet is not a broken nav entry). Pages are ordered by their file name; ``index.md``
comes first. ``on_post_page`` warns (an error under ``strict``) about a Sphinx role that a
docstring left in the rendered text.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

SECTION = "Storage backends"
FOLDER = "storage"


def on_config(config: Any) -> Any:
    folder = Path(config["docs_dir"]) / FOLDER
    pages = sorted(folder.glob("*.md"), key=lambda p: (p.stem != "index", p.name))
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
_CODE = re.compile(r"<pre\b.*?</pre>|<code\b[^>]*>.*?</code>", re.S)
_TAG = re.compile(r"<[^>]+>")
log = logging.getLogger("mkdocs.hooks.asyncload")


def on_post_page(output: str, page: Any, config: Any) -> str:
    prose = _TAG.sub("", _CODE.sub("", output))
    for match in _ROLE.finditer(prose):
        context = " ".join(prose[max(match.start() - 50, 0) : match.end() + 30].split())
        # A warning, so `strict: true` fails the build.
        log.warning("%s: a literal Sphinx role in the page: …%s…", page.file.src_uri, context)
    return output
