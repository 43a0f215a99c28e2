"""Read from S3 — here moto's S3 server on 127.0.0.1 — and run a DataLoader epoch over it.

Needs ``pip install 'asyncload-torch[s3]' 'moto[server]'``. Against real S3, drop the server and the
``configure`` call: credentials and region come from the usual AWS environment variables.

    python examples/read_s3.py
"""

from __future__ import annotations

import asyncio
import logging

import boto3
from moto.server import ThreadedMotoServer

import asyncload

BUCKET = "asyncload-example"


def main() -> None:
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    creds = {"access_key_id": "example", "secret_access_key": "example"}
    try:
        s3 = boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id="example",
            aws_secret_access_key="example",
        )
        s3.create_bucket(Bucket=BUCKET)
        for i in range(24):
            s3.put_object(Bucket=BUCKET, Key=f"train/{i:03d}.txt", Body=f"sample {i}".encode())

        # Settings given once in the main process reach every worker.
        asyncload.configure(
            f"s3://{BUCKET}", endpoint=endpoint, region="us-east-1", credentials=creds
        )

        async def peek() -> None:
            info = await asyncload.stat(f"s3://{BUCKET}/train/000.txt")
            first = await asyncload.read(f"s3://{BUCKET}/train/000.txt", end=6)
            print(f"stat: {info.size} bytes, etag {info.etag}; first bytes {first!r}")

        asyncio.run(peek())
        dataset = asyncload.RemoteFiles.from_prefix(f"s3://{BUCKET}/train/")
        loader = asyncload.DataLoader(dataset, batch_size=8, num_workers=2, collate_fn=list)
        samples = [s for batch in loader for s in batch]
        assert samples == [f"sample {i}".encode() for i in range(24)]
        print(f"DataLoader epoch over s3://{BUCKET}/train/: {len(samples)} objects")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
