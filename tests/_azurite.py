"""Azurite, the official Azure Storage emulator, on 127.0.0.1 for tests (blob service only).

``make test`` installs it from the npm registry into ``.azurite/`` (a pinned version; Node is
on every machine). Azurite checks Shared Key signatures, so a wrong account key is a real 403.
Containers are created here with one signed REST call; objects are uploaded with obstore.
"""

from __future__ import annotations

import base64
import email.utils
import hashlib
import hmac
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pytest

from ._cloud_proxy import CloudProxy, proxy_context
from ._emulator import ROOT, free_port, start, stop, upload

# Azurite's well-known development account (public, documented by Microsoft).
ACCOUNT = "devstoreaccount1"
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
WRONG_KEY = base64.b64encode(b"not the account key, 32 bytes!!!").decode()
BINARY = ROOT / ".azurite" / "node_modules" / ".bin" / "azurite-blob"


def _shared_key(method: str, path: str, query: dict[str, str], headers: dict[str, str]) -> str:
    """The ``Authorization`` header of a body-less request, Shared Key scheme."""
    fields = ["", "", "", "", "", "", "", "", "", "", ""]  # Content-Encoding ... Range
    canonical = "".join(f"{k}:{v}\n" for k, v in sorted(headers.items()) if k.startswith("x-ms-"))
    resource = f"/{ACCOUNT}{path}" + "".join(f"\n{k}:{v}" for k, v in sorted(query.items()))
    to_sign = "\n".join([method, *fields]) + "\n" + canonical + resource
    digest = hmac.new(base64.b64decode(KEY), to_sign.encode(), hashlib.sha256).digest()
    return f"SharedKey {ACCOUNT}:{base64.b64encode(digest).decode()}"


@dataclass
class AzuriteServer:
    """A running Azurite blob service and the fault proxy in front of it."""

    url: str
    proxy: CloudProxy
    scheme: str = "az"

    @property
    def endpoint(self) -> str:
        return f"{self.url}/{ACCOUNT}"

    @property
    def proxy_endpoint(self) -> str:
        return f"{self.proxy.url}/{ACCOUNT}"

    def path(self, url: str) -> str:
        """The request path the emulator (and the proxy) sees for object *url*."""
        return f"/{ACCOUNT}/{url.partition('://')[2]}"

    def options(self, endpoint: str | None = None) -> dict[str, Any]:
        """``configure()`` keywords that reach this emulator (directly, or via *endpoint*)."""
        return {
            "endpoint": endpoint or self.endpoint,
            "credentials": {"account_name": ACCOUNT, "account_key": KEY},
        }

    def denied_options(self) -> dict[str, Any] | None:
        """Options Azurite refuses with a real 403 (a wrong account key)."""
        return {
            "endpoint": self.endpoint,
            "credentials": {"account_name": ACCOUNT, "account_key": WRONG_KEY},
        }

    def unsigned(self) -> dict[str, Any]:
        """Extra ``configure()`` keywords for anonymous requests (to a public container)."""
        return {"credentials": {"account_name": ACCOUNT}, "extra": {"skip_signature": True}}

    def connection_string(self) -> str:
        return (
            f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};"
            f"BlobEndpoint={self.endpoint};"
        )

    def bucket(
        self, name: str, objects: Mapping[str, bytes] | None = None, *, public: bool = False
    ) -> str:
        """Create container *name* (if needed) holding *objects*; returns ``az://name``."""
        headers = {"x-ms-date": email.utils.formatdate(usegmt=True), "x-ms-version": "2021-08-06"}
        if public:
            headers["x-ms-blob-public-access"] = "container"
        path = f"/{ACCOUNT}/{name}"
        headers["Authorization"] = _shared_key("PUT", path, {"restype": "container"}, headers)
        req = urllib.request.Request(
            f"{self.url}{path}?restype=container", headers=headers, method="PUT"
        )
        try:
            with urllib.request.urlopen(req, timeout=10):
                pass
        except urllib.error.HTTPError as exc:
            if exc.code != 409:  # 409: it exists already
                raise
        if objects:
            config = {"account_name": ACCOUNT, "account_key": KEY, "endpoint": self.endpoint}
            upload(f"az://{name}", config, objects)
        return f"az://{name}"


def azurite_context() -> Iterator[AzuriteServer]:
    if not BINARY.exists():
        pytest.fail(
            f"Azurite is not installed at {BINARY}: `make test` installs it "
            "(npm install --prefix .azurite azurite@<version in the Makefile>)"
        )
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="asyncload-azurite-") as location:
        argv = [str(BINARY), "--blobHost", "127.0.0.1", "--blobPort", str(port)]
        argv += ["--inMemoryPersistence", "--silent"]
        argv += ["--skipApiVersionCheck", "--loose", "--disableTelemetry"]
        proc = start("Azurite", argv, f"{url}/{ACCOUNT}?comp=list", timeout=60, cwd=location)
        try:
            for proxy in proxy_context(url):
                yield AzuriteServer(url=url, proxy=proxy)
        finally:
            stop(proc)
