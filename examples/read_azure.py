"""Read from Azure Blob Storage — here Azurite on 127.0.0.1 — and run a DataLoader epoch.

Needs ``pip install 'asyncload-torch[s3]'`` and Azurite (``make test`` installs it into
``.azurite/``; or ``npm install --prefix .azurite azurite``). Against real Azure, drop the
server and the ``endpoint``: set ``AZURE_STORAGE_ACCOUNT_NAME`` and a key, SAS or identity.

    python examples/read_azure.py
"""

from __future__ import annotations

import asyncio
import base64
import email.utils
import hashlib
import hmac
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import asyncload

AZURITE = (
    Path(__file__).resolve().parents[1] / ".azurite" / "node_modules" / ".bin" / "azurite-blob"
)
# Azurite's well-known development account, documented by Microsoft.
ACCOUNT = "devstoreaccount1"
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
CONTAINER = "asyncload-example"


def start_emulator(workdir: str) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [str(AZURITE), "--blobHost", "127.0.0.1", "--blobPort", str(port)]
    argv += ["--inMemoryPersistence", "--silent", "--skipApiVersionCheck", "--disableTelemetry"]
    proc = subprocess.Popen(argv, cwd=workdir, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            urllib.request.urlopen(f"{url}/{ACCOUNT}?comp=list", timeout=1).close()
        except urllib.error.HTTPError:
            return proc, url  # it answers (an anonymous listing is refused)
        except OSError:
            time.sleep(0.1)
        else:
            return proc, url
    proc.kill()
    raise RuntimeError("Azurite did not start")


def create_container(url: str, name: str) -> None:
    """One Shared Key-signed REST call: obstore reads and writes blobs, not containers."""
    headers = {"x-ms-date": email.utils.formatdate(usegmt=True), "x-ms-version": "2021-08-06"}
    signed = "".join(f"{k}:{v}\n" for k, v in sorted(headers.items()))
    to_sign = "PUT" + "\n" * 12 + signed + f"/{ACCOUNT}/{ACCOUNT}/{name}\nrestype:container"
    mac = hmac.new(base64.b64decode(KEY), to_sign.encode(), hashlib.sha256).digest()
    headers["Authorization"] = f"SharedKey {ACCOUNT}:{base64.b64encode(mac).decode()}"
    req = urllib.request.Request(
        f"{url}/{ACCOUNT}/{name}?restype=container", headers=headers, method="PUT"
    )
    urllib.request.urlopen(req, timeout=10).close()


def main() -> None:
    with tempfile.TemporaryDirectory() as workdir:
        proc, url = start_emulator(workdir)
        try:
            create_container(url, CONTAINER)
            # Settings given once in the main process reach every worker.
            asyncload.configure(
                f"az://{CONTAINER}",
                endpoint=f"{url}/{ACCOUNT}",
                credentials={"account_name": ACCOUNT, "account_key": KEY},
            )
            import obstore
            from obstore.store import AzureStore

            store = AzureStore(
                CONTAINER,
                account_name=ACCOUNT,
                account_key=KEY,
                endpoint=f"{url}/{ACCOUNT}",
                client_options={"allow_http": True},
            )
            for i in range(24):
                obstore.put(store, f"train/{i:03d}.txt", b"sample %d" % i)

            async def peek() -> None:
                info = await asyncload.stat(f"az://{CONTAINER}/train/000.txt")
                first = await asyncload.read(f"az://{CONTAINER}/train/000.txt", end=6)
                chunks = [c async for c in asyncload.stream(f"az://{CONTAINER}/train/001.txt")]
                print(f"stat: {info.size} bytes, etag {info.etag}; first bytes {first!r}")
                print(f"streamed {b''.join(chunks)!r}")

            asyncio.run(peek())
            dataset = asyncload.RemoteFiles.from_prefix(f"az://{CONTAINER}/train/")
            loader = asyncload.DataLoader(dataset, batch_size=8, num_workers=2, collate_fn=list)
            samples = [s for batch in loader for s in batch]
            assert samples == [b"sample %d" % i for i in range(24)]
            print(f"DataLoader epoch over az://{CONTAINER}/train/: {len(samples)} objects")
        finally:
            proc.terminate()
            proc.wait(10)


if __name__ == "__main__":
    main()
