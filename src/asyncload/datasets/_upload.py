"""Putting a finished shard into object storage (``s3://``, ``gs://``, ``az://``) with obstore.

The store is built exactly as reads build theirs (``asyncload.configure`` options for the URL's
prefix, then the standard environment variables), so a bucket that ``TarShards`` can read with
some settings is written with the same ones. ``obstore.put`` is atomic (a single PUT, or a
multipart upload completed at the end): a shard appears whole or not at all, and a failed
attempt can simply be made again, under the prefix's [`Retry`][asyncload.Retry] policy.
"""

from __future__ import annotations

from pathlib import Path

from .._storage.api import options_for
from .._storage.backends.base import split_scheme
from .._storage.retry import AttemptFailed, Attempts

__all__ = ["OBJECT_STORE_SCHEMES", "is_object_store", "put_file"]

OBJECT_STORE_SCHEMES = ("s3", "gs", "az")


def is_object_store(url: str) -> bool:
    """Whether *url* names a place in an object store that ``put_file`` can write to."""
    return split_scheme(url) in OBJECT_STORE_SCHEMES


def put_file(path: Path, url: str) -> None:
    """Upload the local file *path* to *url* (``s3://bucket/key`` and the like).

    Raises:
        StorageError: The upload failed (after retries where the policy allows them); the
            error names the URL, credentials redacted.
    """
    from .._storage.backends.s3 import _build_store, map_error, split_bucket

    options = options_for(url)
    attempts = Attempts(url, options.retry)  # each retry is counted and logged, as reads' are
    while True:
        try:
            scheme, bucket, key = split_bucket(url)
            store = _build_store(scheme, bucket, options)
            import obstore

            try:
                obstore.put(store, key, path)
            except Exception as exc:
                raise map_error(exc, scheme) from exc
            return
        except AttemptFailed as failure:
            attempts.failed_sync(failure)
