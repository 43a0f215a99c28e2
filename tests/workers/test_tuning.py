"""Heap and collector thresholds of a loader's processes (``_tuning``)."""

from __future__ import annotations

import ctypes
import sys

import pytest

import asyncload
from asyncload._workers import tuning as _tuning

from .._datasets import GcThreshold, init_sets_gc_threshold
from .._procs import run_script

pytestmark = pytest.mark.usefixtures("no_leaks")


def _has_mallinfo2() -> bool:
    try:
        ctypes.CDLL(None).mallinfo2  # noqa: B018 - glibc 2.33+
    except (OSError, AttributeError):
        return False
    return sys.platform == "linux"


def test_a_worker_collects_young_objects_once_per_many_requests_in_flight() -> None:
    import gc

    default = gc.get_threshold()  # the interpreter's, as a new worker starts with
    for max_concurrency in (64, 10_000):
        loader = asyncload.DataLoader(
            GcThreshold(), batch_size=None, num_workers=1, max_concurrency=max_concurrency
        )
        (gen0, gen1, gen2), _ = list(loader)
        wanted = min(max_concurrency * _tuning._GC_PER_REQUEST, _tuning._GC_MAX)
        assert gen0 == max(default[0], wanted)
        assert (gen1, gen2) == default[1:]


def test_worker_init_fn_has_the_last_word_on_the_collector() -> None:
    loader = asyncload.DataLoader(
        GcThreshold(), batch_size=None, num_workers=1, worker_init_fn=init_sets_gc_threshold
    )
    assert [tuple(t) for t in loader] == [(1234, 5, 6)] * 2


def test_the_main_process_keeps_its_collector_and_threads_leave_it_alone() -> None:
    import gc

    before = gc.get_threshold()
    loader = asyncload.DataLoader(GcThreshold(), batch_size=None, num_workers=0)
    assert [tuple(t) for t in loader] == [before, before]
    assert gc.get_threshold() == before


@pytest.mark.skipif(not _has_mallinfo2(), reason="glibc 2.33+ only (mallinfo2)")
@pytest.mark.parametrize(("how", "after"), [("none", True), ("loader", False)])
def test_a_pass_with_workers_lets_glibc_keep_freed_batches_in_the_heap(
    how: str, after: bool
) -> None:
    # A fresh interpreter: glibc's thresholds only ever rise, and this one's may have.
    result = run_script("heap_thresholds.py", how, timeout=60)
    assert result["before"] is True  # glibc's default: 1 MiB comes from mmap
    assert result["after"] is after
