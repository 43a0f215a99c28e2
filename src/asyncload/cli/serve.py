"""``asyncload serve DIR``: the demo's object store, serving a folder over loopback HTTP.

For trying ``asyncload bench``, the examples or a dataset without cloud credentials: every file
under DIR is served at ``/<relative path>`` after ``--latency`` milliseconds, and
``/manifest.txt`` lists them (generated unless DIR has its own), since plain HTTP cannot list a
prefix. The set of files is taken once at start; files are read when requested. The listen
backlog is large (2,048), unlike ``python -m http.server``'s 5, so a burst of connections from
many workers is not dropped.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

from . import loopback
from .console import UsageError
from .demo_server import MANIFEST

__all__ = ["FolderObjects", "serve_folder"]


class FolderObjects(Mapping[str, bytes]):
    """Relative path → file contents of every file under a folder, read on access."""

    def __init__(self, root: Path) -> None:
        if not root.is_dir():
            raise UsageError(f"{root}: not a directory")
        self.root = root
        self.files = {
            p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*")) if p.is_file()
        }
        listed = [name for name in self.files if name != MANIFEST]
        if not listed:
            raise UsageError(f"nothing to serve under {root}: it has no files")
        self.count = len(listed)
        self.manifest = None if MANIFEST in self.files else "".join(f"{n}\n" for n in listed)

    def __getitem__(self, name: str) -> bytes:
        if name == MANIFEST and self.manifest is not None:
            return self.manifest.encode()
        path = self.files[name]  # only names found at start: no way out of the folder
        try:
            return path.read_bytes()
        except OSError:
            raise KeyError(name) from None

    def __iter__(self) -> Iterator[str]:
        yield from self.files
        if self.manifest is not None:
            yield MANIFEST

    def __len__(self) -> int:
        return len(self.files) + (self.manifest is not None)


async def serve_folder(objects: FolderObjects, *, latency: float, host: str, port: int) -> None:
    """Serve *objects* until cancelled (Ctrl-C); print the base URL first.

    Raises:
        OSError: *host*:*port* cannot be bound.
    """

    def announce(store: loopback.Store) -> None:
        url = f"{store.url}/"
        print(
            f"asyncload serve: {objects.root} at {url} ({objects.count} files, "
            f"{latency * 1e3:g} ms latency); try: asyncload bench {url}{MANIFEST}",
            flush=True,
        )
        print("(Ctrl-C stops the server)", file=sys.stderr, flush=True)

    # Nobody reads the per-request records of a server that runs until Ctrl-C.
    store = loopback.Store(host=host, port=port, objects=objects, latency=latency, record=False)
    await loopback.serve(store, backlog=2048, announce=announce)
