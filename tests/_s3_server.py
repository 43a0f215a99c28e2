"""moto's S3 server on 127.0.0.1 for tests: a real HTTP endpoint that speaks the S3 API.

The server runs in a thread of the test process (werkzeug); clients reach it over loopback TCP,
so obstore signs and sends real requests. Credentials are not checked unless
:meth:`S3Server.enforce_auth` turns moto's IAM checks on.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

ACCESS_KEY = "AKIAASYNCLOADTEST"
SECRET_KEY = "asyncload-test-secret"
REGION = "us-east-1"


@dataclass
class S3Server:
    """A running moto server and a boto3 client for setting up buckets and objects."""

    endpoint: str
    server: Any

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name=REGION,
        )

    def bucket(self, name: str, objects: dict[str, bytes] | None = None) -> str:
        """Create bucket *name* (if needed) holding *objects*; returns ``s3://name``."""
        c = self.client()
        existing = {b["Name"] for b in c.list_buckets().get("Buckets", [])}
        if name not in existing:
            c.create_bucket(Bucket=name)
        for key, data in (objects or {}).items():
            c.put_object(Bucket=name, Key=key, Body=data)
        return f"s3://{name}"

    def enforce_auth(self, on: bool) -> None:
        """Turn moto's credential checks on (unknown keys get 403) or off."""
        value = b"0" if on else b"inf"
        req = urllib.request.Request(
            f"{self.endpoint}/moto-api/reset-auth",
            data=value,
            method="POST",
            # Not form-encoded, or Flask swallows the body as a form.
            headers={"Content-Type": "text/plain"},
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            json.loads(resp.read())

    def env(self) -> dict[str, str]:
        """Environment variables that point obstore (or any AWS SDK) at this server."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": REGION,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_ENDPOINT_URL": self.endpoint,
        }


def s3_server_context() -> Iterator[S3Server]:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield S3Server(endpoint=f"http://{host}:{port}", server=server)
    finally:
        server.stop()
