"""``write_shards``: pack a folder of files, or an iterable of samples, into tar shards.

Writing happens once, offline, from trusted data, so the standard library's ``tarfile`` is
the right tool here (reading is another matter: see ``_tarstream``). Shards are reproducible:
members are written in key order with a fixed mtime, owner and mode, in POSIX pax format (long
names are fine). Each shard is written to a temporary file and then renamed into place (a local
folder) or uploaded (``s3://``, ``gs://``, ``az://``, see ``_upload``), so a shard appears whole
or not at all.
"""

from __future__ import annotations

import fnmatch
import io
import json
import os
import tarfile
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

from ._tarstream import split_name
from ._upload import OBJECT_STORE_SCHEMES, is_object_store, put_file

__all__ = ["DEFAULT_EXCLUDE", "ShardSummary", "write_shards"]

DEFAULT_EXCLUDE = ("manifest.txt",)
"""What ``write_shards`` leaves out of a folder unless told otherwise: the listing that
``asyncload serve`` and object-store tools put next to the data is not a sample."""

Patterns = str | Iterable[str] | None


@dataclass(frozen=True)
class ShardSummary(Sequence[str]):
    """What ``write_shards`` wrote; it is also the sequence of the shards' paths or URLs.

    Examples:
        >>> s = ShardSummary(("/out/shard-000000.tar",), samples=3, files=6, bytes=10240)
        >>> len(s), s[0]
        (1, '/out/shard-000000.tar')
        >>> print(s)
        wrote 1 shard to /out (3 samples, 6 files, 10.2 kB)
    """

    paths: tuple[str, ...]
    """Shard paths (a local folder) or URLs (an object store), in order."""
    samples: int = 0
    """Samples written."""
    files: int = 0
    """Tar members written (one per field of each sample)."""
    bytes: int = 0
    """Total size of the shards."""
    left_out: tuple[tuple[str, str], ...] = ()
    """``(relative path, reason)`` for each file of the folder that was not packed: excluded by
    a pattern, not matched by ``include``, or without an extension to name its field after."""

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[str]: ...
    def __getitem__(self, i: int | slice) -> str | Sequence[str]:
        return self.paths[i]

    def __len__(self) -> int:
        return len(self.paths)

    def __iter__(self) -> Iterator[str]:
        return iter(self.paths)

    def __str__(self) -> str:
        n = len(self.paths)
        where = os.path.dirname(self.paths[0]) if self.paths else "nowhere"
        text = (
            f"wrote {n} shard{'s' * (n != 1)} to {where} ({self.samples} samples, "
            f"{self.files} files, {_size(self.bytes)})"
        )
        if self.left_out:
            shown = ", ".join(f"{p} ({why})" for p, why in self.left_out[:5])
            more = f" and {len(self.left_out) - 5} more" if len(self.left_out) > 5 else ""
            k = len(self.left_out)
            text += f"; left out {k} file{'s' * (k != 1)}: {shown}{more}"
        return text


def _size(n: int) -> str:
    if n < 1000:
        return f"{n} B"
    value = float(n)
    for unit in ("kB", "MB", "GB"):
        value /= 1000
        if value < 1000 or unit == "GB":
            break
    return f"{value:.1f} {unit}"


def _patterns(value: Patterns) -> tuple[str, ...] | None:
    if value is None:
        return None
    return (value,) if isinstance(value, str) else tuple(value)


def _matches(rel: str, patterns: tuple[str, ...]) -> bool:
    # A pattern with a slash is matched against the relative path, one without against the file
    # name (so "*.jpg" and "manifest.txt" hold at any depth); letter case is ignored throughout.
    name = rel.rsplit("/", 1)[-1].lower()
    low = rel.lower()
    return any(fnmatch.fnmatchcase(low if "/" in p else name, p.lower()) for p in patterns)


def _samples_from_folder(
    root: Path,
    include: tuple[str, ...] | None,
    exclude: tuple[str, ...],
    left_out: list[tuple[str, str]],
) -> Iterator[dict[str, Any]]:
    # Files sharing a key (the relative path up to the first dot of the basename) form a sample.
    files = sorted(p for p in root.rglob("*") if p.is_file())
    sample: dict[str, Any] | None = None
    for path in files:
        rel = path.relative_to(root).as_posix()
        if include is not None and not _matches(rel, include):
            left_out.append((rel, "not included"))
            continue
        if _matches(rel, exclude):
            left_out.append((rel, "excluded"))
            continue
        parts = split_name(rel)
        if parts is None:
            left_out.append((rel, "no extension"))
            continue
        key, ext = parts
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
    include: Patterns = None,
    exclude: Patterns = DEFAULT_EXCLUDE,
) -> ShardSummary:
    """Write WebDataset-style tar shards that [`TarShards`][asyncload.TarShards] reads.

    Args:
        samples: A folder (its files are grouped by key: ``a/x.jpg`` and ``a/x.cls`` make sample
            ``a/x``), or an iterable of dicts with a ``"__key__"`` and one value per extension
            (bytes, str, numbers, or dicts/lists written as JSON).
        out_dir: Where to write ``{prefix}000000.tar``, ``{prefix}000001.tar``, ...: a local
            folder (created), or an ``s3://``, ``gs://`` or ``az://`` prefix, uploaded with the
            settings [`configure`][asyncload.configure] gives that prefix (obstore needed).
        samples_per_shard: Samples per shard; the last shard may hold fewer.
        prefix: File name prefix of the shards.
        include: For a folder: glob pattern(s) a file must match to be packed (all files when
            ``None``). A pattern with a ``/`` is matched against the path relative to the
            folder, one without against the file name; letter case is ignored.
        exclude: For a folder: glob pattern(s) of files to leave out, matched the same way.
            The default leaves out ``manifest.txt`` files; a value of your own replaces it.

    Returns:
        ShardSummary: The shards' paths (or URLs) in order, as a sequence, and how many
            samples, files and bytes were written and which files were left out and why
            (``print(summary)`` shows it in one line).

    Raises:
        ValueError: A bad key, ``samples_per_shard < 1``, ``include``/``exclude`` given for
            samples that are not a folder, or an ``out_dir`` URL that is not an object store.

    Examples:
        >>> from asyncload.datasets import write_shards
        >>> summary = write_shards("/data/images", "s3://bucket/shards", exclude="*.tmp")
        ... # doctest: +SKIP
        >>> print(summary)  # doctest: +SKIP
        wrote 3 shards to s3://bucket/shards (2500 samples, 5000 files, 91.3 MB); ...
    """
    if samples_per_shard < 1:
        raise ValueError(f"samples_per_shard must be >= 1, got {samples_per_shard}")
    left_out: list[tuple[str, str]] = []
    if isinstance(samples, (str, os.PathLike)):
        root = Path(samples)
        if not root.is_dir():
            raise NotADirectoryError(f"write_shards: {root} is not a folder")
        samples = _samples_from_folder(root, _patterns(include), _patterns(exclude) or (), left_out)
    elif include is not None or exclude != DEFAULT_EXCLUDE:
        raise ValueError(
            "write_shards: include= and exclude= select files of a folder; filter an iterable "
            "of samples yourself"
        )
    dest = os.fspath(out_dir)
    remote = is_object_store(dest)
    if "://" in dest and not remote and not dest.startswith("file://"):
        schemes = ", ".join(f"{s}://" for s in OBJECT_STORE_SCHEMES)
        raise ValueError(
            f"write_shards writes to a local folder or to {schemes}; got {dest.split('://')[0]}://"
        )
    if remote:
        with tempfile.TemporaryDirectory(prefix="asyncload-shards-") as tmp:
            return _write(samples, Path(tmp), dest.rstrip("/"), samples_per_shard, prefix, left_out)
    out = Path(dest.removeprefix("file://"))
    out.mkdir(parents=True, exist_ok=True)
    return _write(samples, out, None, samples_per_shard, prefix, left_out)


def _write(
    samples: Iterable[Mapping[str, Any]],
    out: Path,
    upload_to: str | None,
    samples_per_shard: int,
    prefix: str,
    left_out: list[tuple[str, str]],
) -> ShardSummary:
    paths: list[str] = []
    tar: tarfile.TarFile | None = None
    count = total = files = size = 0
    tmp = out / ".writing.tar"

    def finish(tar: tarfile.TarFile) -> None:
        nonlocal size
        tar.close()
        name = f"{prefix}{len(paths):06d}.tar"
        size += tmp.stat().st_size
        if upload_to is None:
            tmp.replace(out / name)  # a shard appears whole or not at all
            paths.append(str(out / name))
        else:
            put_file(tmp, f"{upload_to}/{name}")
            paths.append(f"{upload_to}/{name}")

    try:
        for sample in samples:
            if tar is None or count == samples_per_shard:
                if tar is not None:
                    finish(tar)
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
                files += 1
            count += 1
            total += 1
        if tar is not None:
            finish(tar)
            tar = None
    finally:
        if tar is not None:
            tar.close()
        tmp.unlink(missing_ok=True)
    return ShardSummary(tuple(paths), total, files, size, tuple(left_out))
