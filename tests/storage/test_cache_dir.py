"""The cache directory's hit path (``CacheDir.read``): checks, LRU touches, long ETags."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from asyncload._storage import cache_dir as _cache_dir
from asyncload._storage.cache_dir import CacheDir


def make(tmp_path: Path, max_bytes: int | None = None) -> CacheDir:
    d = CacheDir(str(tmp_path / "c"), max_bytes)
    d.setup()
    return d


def test_read_returns_the_body_a_range_or_the_size_when_too_large(tmp_path: Path) -> None:
    d = make(tmp_path)
    data = bytes(range(256)) * 40
    assert d.store("k" * 64, data, None) is None
    assert d.read("k" * 64, None, None, 1 << 20) == data
    assert d.read("k" * 64, 10, 30, 1 << 20) == data[10:30]
    assert d.read("k" * 64, 10_000, None, 1 << 20) == data[10_000:]
    assert d.read("k" * 64, None, None, 100) == len(data)  # the caller reads it in a thread
    assert d.read("j" * 64, None, None, 1 << 20) is None


def test_a_long_etag_is_read_whole(tmp_path: Path) -> None:
    d = make(tmp_path)
    etag = '"' + "e" * 1500 + '"'
    assert d.store("k" * 64, b"body", etag) is None
    assert d.read("k" * 64, None, None, 1 << 20) == b"body"
    entry = d.open("k" * 64)
    assert entry is not None
    os.close(entry[0])
    assert entry[2:] == (4, etag)


def test_a_truncated_entry_is_never_returned_and_is_removed(tmp_path: Path) -> None:
    d = make(tmp_path)
    assert d.store("k" * 64, b"x" * 5000, None) is None
    path = d.path("k" * 64)
    os.truncate(path, 3000)
    assert d.read("k" * 64, None, None, 1 << 20) is None
    assert not os.path.exists(path)


def test_a_hit_marks_the_entry_used_so_eviction_keeps_it(tmp_path: Path) -> None:
    d = make(tmp_path, max_bytes=35_000)  # room for three 10 KB entries
    old = time.time() - 3600
    for k in "abc":
        assert d.store(k * 64, k.encode() * 10_000, None) is None
        os.utime(d.path(k * 64), (old, old + ord(k)))  # a, then b, then c: all long unused
    assert d.read("a" * 64, None, None, 1 << 20) == b"a" * 10_000  # a is used now
    assert d.store("d" * 64, b"d" * 10_000, None) is None  # evicts the least recently used
    left = {k for k in "abcd" if os.path.exists(d.path(k * 64))}
    assert {"a", "d"} <= left
    assert "b" not in left


def test_an_entry_longer_than_its_header_says_is_never_returned(tmp_path: Path) -> None:
    d = make(tmp_path)
    assert d.store("k" * 64, b"x" * 5000, None) is None
    with open(d.path("k" * 64), "ab") as f:
        f.write(b"y")
    assert d.read("k" * 64, None, None, 1 << 20) is None
    assert not os.path.exists(d.path("k" * 64))


def test_a_process_touches_an_entry_at_most_once_per_interval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = make(tmp_path)
    assert d.store("k" * 64, b"x" * 5000, None) is None
    path, old = d.path("k" * 64), time.time() - 3600

    def read_from_old() -> float:
        os.utime(path, (old, old))
        assert d.read("k" * 64, None, None, 1 << 20) == b"x" * 5000
        return os.stat(path).st_mtime

    assert read_from_old() > old + 3000  # the first hit marks it used
    assert read_from_old() == pytest.approx(old, abs=1)  # a second one, within the interval, not
    monkeypatch.setattr(_cache_dir, "_TOUCH_EVERY", 0.0)
    assert read_from_old() > old + 3000  # and one after it does


def test_an_entry_that_cannot_be_touched_is_still_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = make(tmp_path)
    assert d.store("k" * 64, b"x" * 5000, None) is None
    assert d.store("j" * 64, b"y" * 5000, None) is None

    def refused(*args: object) -> None:  # another user's entry: no write permission on it
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "utime", refused)
    assert d.read("k" * 64, None, None, 1 << 20) == b"x" * 5000
    assert d.read("j" * 64, 0, 10, 1 << 20) == b"y" * 10  # (a range: another path)
    assert os.path.exists(d.path("k" * 64))
    assert os.path.exists(d.path("j" * 64))
