"""What the command line shares: user errors, a progress bar, tables, and finding the objects.

Nothing here is public API; ``asyncload.cli`` is the entry point.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Sequence
from typing import TextIO
from urllib.parse import unquote, urljoin, urlsplit

from .._exceptions import InvalidURL, LoadError, NotFound
from .._redact import redact_url
from .._storage import api as _storage
from .._storage import sync as _sync

__all__ = [
    "MANIFEST",
    "Progress",
    "UsageError",
    "find_objects",
    "read_sync",
    "render_table",
]

MANIFEST = "manifest.txt"


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit status 2, no traceback."""


# ── progress ───────────────────────────────────────────────────────────────────────────────


class Progress:
    """One ``\\r``-redrawn line on stderr: a bar, a count and whatever the caller adds.

    Draws only when *stream* is a terminal, unless ``enabled=True`` forces it (``False``
    silences it). Redraws at most 10 times a second so that drawing costs nothing measurable.

    Args:
        label: Shown before the bar.
        total: The count that fills the bar.
        enabled: ``None`` for "when stderr is a terminal".
        stream: Where to draw (stderr by default).
    """

    _INTERVAL = 0.1

    def __init__(
        self, label: str, total: int, *, enabled: bool | None = None, stream: TextIO | None = None
    ) -> None:
        self.label = label
        self.total = max(total, 1)
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self._tty = bool(isatty and isatty())
        self.enabled = enabled if enabled is not None else self._tty
        self._last = 0.0
        self._drawn = False

    def update(self, done: int, text: str = "", *, force: bool = False) -> None:
        """Show *done* out of ``total``, followed by *text*."""
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < self._INTERVAL:
            return
        self._last = now
        frac = min(done / self.total, 1.0)
        bar_width = 20
        filled = int(frac * bar_width)
        bar = "█" * filled + "·" * (bar_width - filled)
        line = f"{self.label} {bar} {done}/{self.total} {text}".rstrip()
        if self._tty:
            # Longer than the terminal is wide, the line would wrap and "\r" redraw only its end.
            width = max(shutil.get_terminal_size((100, 24)).columns - 1, 20)
            line = line[:width].ljust(width)
        self.stream.write("\r" + line)
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        """End the line so that what follows starts on a fresh one."""
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False


# ── tables ─────────────────────────────────────────────────────────────────────────────────


def render_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns separated by two spaces: the first left-aligned, the others right-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = [c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True)]
        return "  ".join([first, *rest]).rstrip()

    rule = "  ".join("─" * w for w in widths)
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


# ── finding the objects ────────────────────────────────────────────────────────────────────


def _scheme(url: str) -> str:
    return urlsplit(url).scheme.lower() if "://" in url else ""


def find_objects(url: str) -> list[str]:
    """Every object URL that *url* names, sorted; ``UsageError`` when there are none.

    * ``http://`` / ``https://``: HTTP can't list, so *url* is a manifest (a URL ending in
      ``.txt``) or a prefix with a ``manifest.txt`` in it. A manifest holds one object per line,
      relative to the manifest or absolute; blank lines and ``#`` comments are skipped.
    * anything else (``s3://``, ``gs://``, ``az://``, ``file://``, a path): every object under
      the prefix, as ``asyncload.list_files`` lists them, minus any ``manifest.txt``.
    """
    if not url:
        raise UsageError("the URL is empty")
    scheme = _scheme(url)
    shown = redact_url(url)
    try:
        if scheme in ("http", "https"):
            manifest = url if url.endswith(".txt") else url.rstrip("/") + "/" + MANIFEST
            text = read_sync(manifest).decode("utf-8", errors="replace")
            urls = [
                urljoin(manifest, line.strip())
                for line in text.splitlines()
                if line.strip() and not line.lstrip().startswith("#")
            ]
        else:
            if scheme in ("", "file") and not os.path.exists(_storage_path(url)):
                raise UsageError(f"{shown}: no such file or directory")
            urls = [u for u in _storage.list_files(url) if not u.endswith("/" + MANIFEST)]
    except NotFound as exc:
        if scheme in ("http", "https"):
            raise UsageError(
                f"{redact_url(str(exc.url or url))}: not found. HTTP can't list objects, so "
                f"point at a prefix holding a {MANIFEST} (one object per line) or at the "
                "manifest itself"
            ) from None
        raise UsageError(f"{shown}: not found") from None
    except InvalidURL as exc:
        raise UsageError(f"bad URL {shown}: {exc}") from None
    except LoadError as exc:
        raise UsageError(f"can't list {shown}: {exc}") from None
    if not urls:
        raise UsageError(f"nothing under {shown}")
    return urls


def _storage_path(url: str) -> str:
    if url.lower().startswith("file://"):
        return unquote(urlsplit(url).path)
    return url


async def _read_and_close(url: str) -> bytes:
    try:
        return await _storage.read(url)
    finally:
        await _storage.aclose()


def read_sync(url: str) -> bytes:
    """Read one object from synchronous code in the main process (a private loop, closed:
    nothing is left running when the demo's workers start)."""
    return _sync.run_detached(lambda: _read_and_close(url))
