"""MkDocs hook: list every page under ``docs/storage/`` in the nav's "Storage backends" section.

The storage pages are written by whoever adds a backend; with this hook a new page shows up in
the nav without anyone editing ``mkdocs.yml`` (and a page that is not there yet is not a broken
nav entry). Pages are ordered by their file name; ``index.md`` comes first.
"""

from __future__ import annotations

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
