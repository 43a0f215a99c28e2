"""The public facade: everything in __all__ exists, is sorted, and nothing private leaks."""

from __future__ import annotations

import re
import types
from pathlib import Path

import asyncload


def test_all_is_sorted_and_complete() -> None:
    assert asyncload.__all__ == sorted(asyncload.__all__)
    for name in asyncload.__all__:
        assert hasattr(asyncload, name), name
    # Submodules (asyncload.cli once imported, asyncload.sources) and the __future__ import
    # are attributes too, but not exports.
    public = {
        n
        for n in dir(asyncload)
        if not n.startswith("_") and not isinstance(getattr(asyncload, n), types.ModuleType)
    }
    assert public - {"annotations"} == set(asyncload.__all__)


def test_public_objects_claim_the_public_module() -> None:
    for name in asyncload.__all__:
        obj = getattr(asyncload, name)
        assert obj.__module__.startswith("asyncload"), name


def test_error_tree_inherits_builtins() -> None:
    assert issubclass(asyncload.NotFound, FileNotFoundError)
    assert issubclass(asyncload.PermissionDenied, PermissionError)
    assert issubclass(asyncload.Timeout, TimeoutError)
    assert issubclass(asyncload.RequestTimeout, asyncload.StorageError)
    assert issubclass(asyncload.BatchTimeout, RuntimeError)
    assert issubclass(asyncload.WorkerError, RuntimeError)
    assert issubclass(asyncload.NotPicklable, TypeError)
    for name in asyncload.__all__:
        obj = getattr(asyncload, name)
        if isinstance(obj, type) and issubclass(obj, Exception) and not issubclass(obj, Warning):
            assert issubclass(obj, asyncload.LoadError), name


def test_the_extension_api_is_public() -> None:
    # What a new URL scheme needs, importable from the public facade.
    import asyncload.sources as sources

    assert sources.__all__ == sorted(sources.__all__)
    for name in ("AttemptFailed", "Backend", "Resume", "register", "registered_schemes"):
        assert name in sources.__all__, name
        assert hasattr(sources, name), name


def test_counters_are_public() -> None:
    hedges = asyncload.hedge_counts()
    assert isinstance(hedges, asyncload.HedgeCounts)
    assert hedges.sent >= hedges.won >= 0
    cache = asyncload.cache_counts()
    assert isinstance(cache, asyncload.CacheCounts)
    assert cache.hits >= 0
    assert cache.misses >= 0


def test_every_public_name_is_on_the_api_page() -> None:
    # The API page lists objects one by one, grouped: a new export must join a group.
    import asyncload.sources as sources

    page = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()
    documented = set(re.findall(r"^::: (asyncload(?:\.sources)?\.\w+)$", page, re.M))
    expected = {f"asyncload.{n}" for n in asyncload.__all__}
    # asyncload.sources re-exports ObjectInfo and StorageOptions, documented at the top level.
    expected |= {f"asyncload.sources.{n}" for n in sources.__all__ if n not in asyncload.__all__}
    assert expected - documented == set(), "add these to docs/api.md"
    assert documented - expected == set(), "docs/api.md names what is not exported"
