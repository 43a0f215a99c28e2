"""The public facade: everything in __all__ exists, is sorted, and nothing private leaks."""

from __future__ import annotations

import types

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
