"""Peer libraries set up against the loopback object server (``_server.py``), for the rows
that compare with them when they are installed (the ``benchmarks`` extra)."""

from __future__ import annotations

import importlib.util
from typing import Any

BUCKET = "obj"  # the server's path prefix: s3://obj/{size}/{ms}/{i} is GET /obj/{size}/{ms}/{i}
CREDS = {"access_key_id": "bench", "secret_access_key": "bench"}


def installed(module: str) -> bool:
    """Whether *module*'s top-level package can be imported."""
    return importlib.util.find_spec(module.split(".")[0]) is not None


def litdata_dataset(base: str, urls: list[str], size: int, **kw: Any) -> Any:
    """litdata's ``StreamingRawDataset`` over ``s3://`` *urls* (objects of *size* bytes) on the
    server at *base*; *kw* go to the dataset (``cache_dir``, ``cache_files``)."""
    import litdata.streaming.downloader
    from litdata.raw.dataset import StreamingRawDataset
    from litdata.raw.indexer import BaseIndexer, FileMetadata

    class KnownFiles(BaseIndexer):
        """The object list as given: the loopback server has no LIST."""

        def discover_files(self, input_dir: str, storage_options: Any) -> list[FileMetadata]:
            return [FileMetadata(path=url, size=size) for url in urls]

    # litdata's obstore client options have no allow_http: the loopback server is plain HTTP.
    litdata.streaming.downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = True  # type: ignore[index]
    return StreamingRawDataset(
        urls[0].rsplit("/", 1)[0] + "/",
        indexer=KnownFiles(),
        recompute_index=True,
        storage_options={
            "endpoint_url": base,
            "region_name": "us-east-1",
            "aws_access_key_id": CREDS["access_key_id"],
            "aws_secret_access_key": CREDS["secret_access_key"],
        },
        **kw,
    )
