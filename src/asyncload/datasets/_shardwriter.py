"""``write_shards``: pack a folder of files, or an iterable of samples, into tar shards.

Writing happens once, offline, from trusted data, so the standard library's ``tarfile`` is
the right tool here (reading is another matter: see ``_tarstream``). Shards are reproducible:
members are written in key order with a fixed mtime, owner and mode, in POSIX pax format (long
names are fine).
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

__all__ = ["write_shards"]


def _samples_from_folder(root: Path) -> Iterator[dict[str, Any]]:
    # Files sharing a key (the relative path up to the first dot of the basename) form a sample.
    files = sorted(p for p in root.rglob("*") if p.is_file())
    sample: dict[str, Any] | None = None
    for path in files:
        rel = path.relative_to(root).as_posix()
        slash = rel.rfind("/") + 1
        dot = rel.find(".", slash)
        if dot <= slash:
            continue  # no extension: nothing to name the field after
        key, ext = rel[:dot], rel[dot + 1 :]
        if sample is None or sample["__key__"] != key:
            if sample is not None:
                yield sample
            sample = {"__key__": key}
        sample[ext] = path.read_bytes()
    if sample is not None:
        yield sample


def _encode(value: Any, where: str) -> bytes:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (int, float)):
        return str(value).encode()
    if isinstance(value, (dict, list)):
        return json.dumps(value).encode()
    raise TypeError(
        f"{where}: can't write a {type(value).__name__}; give bytes, str, a number, or a "
        "dict/list (written as JSON)"
    )


def _check_key(key: object) -> str:
    if not isinstance(key, str) or not key:
        raise ValueError(f"every sample needs a non-empty str '__key__', got {key!r}")
    parts = key.split("/")
    if key.startswith("/") or ".." in parts or "." in parts[-1]:
        raise ValueError(
            f"sample key {key!r} must be a relative path without '..' and without a dot in its "
            "last part (the first dot starts the field name)"
        )
    return key


def write_shards(
    samples: str | os.PathLike[str] | Iterable[Mapping[str, Any]],
    out_dir: str | os.PathLike[str],
    *,
    samples_per_shard: int = 1000,
    prefix: str = "shard-",
) -> list[str]:
    """Write WebDataset-style tar shards that [`asyncload.TarShards`][asyncload.TarShards] reads.

    Args:
        samples: A folder (its files are grouped by key: ``a/x.jpg`` and ``a/x.cls`` make sample
            ``a/x``), or an iterable of dicts with a ``"__key__"`` and one value per extension
            (bytes, str, numbers, or dicts/lists written as JSON).
        out_dir: Where to write ``{prefix}000000.tar``, ``{prefix}000001.tar``, ... (created).
        samples_per_shard: Samples per shard; the last shard may hold fewer.
        prefix: File name prefix of the shards.

    Returns:
        The paths of the shards written, in order.

    Examples:
        >>> from asyncload.datasets import write_shards
        >>> paths = write_shards(  # doctest: +SKIP
        ...     ({"__key__": f"{i:05d}", "txt": f"sample {i}", "cls": i % 10} for i in range(2500)),
        ...     "/data/shards", samples_per_shard=1000,
        ... )
        >>> len(paths)  # doctest: +SKIP
        3
    """
    if samples_per_shard < 1:
        raise ValueError(f"samples_per_shard must be >= 1, got {samples_per_shard}")
    if isinstance(samples, (str, os.PathLike)):
        root = Path(samples)
        if not root.is_dir():
            raise NotADirectoryError(f"write_shards: {root} is not a folder")
        samples = _samples_from_folder(root)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: list[str] = []
    tar: tarfile.TarFile | None = None
    count = 0
    tmp = out / ".writing.tar"
    try:
        for sample in samples:
            if tar is None or count == samples_per_shard:
                if tar is not None:
                    paths.append(_finish(tar, tmp, out, prefix, len(paths)))
                tar = tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT)
                count = 0
            key = _check_key(sample.get("__key__"))
            for ext in sorted(sample):
                if ext.startswith("__"):
                    continue
                data = _encode(sample[ext], f"sample {key!r} field {ext!r}")
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size, info.mtime, info.mode = len(data), 0, 0o644
                info.uname = info.gname = ""
                tar.addfile(info, io.BytesIO(data))
            count += 1
        if tar is not None:
            paths.append(_finish(tar, tmp, out, prefix, len(paths)))
            tar = None
    finally:
        if tar is not None:
            tar.close()
        tmp.unlink(missing_ok=True)
    return paths


def _finish(tar: tarfile.TarFile, tmp: Path, out: Path, prefix: str, index: int) -> str:
    tar.close()
    path = out / f"{prefix}{index:06d}.tar"
    tmp.replace(path)  # a shard appears whole or not at all
    return str(path)
