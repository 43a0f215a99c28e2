"""torch's own DataLoader behaviours that code swapping in asyncload.DataLoader relies on.

Each test names the behaviour from torch's documentation or source; all run in memory.
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

import pytest
import torch
import torch.utils.data
from torch.utils.data.datapipes.iter import IterableWrapper

import asyncload

from ._datasets import (
    Doubled,
    FailsAt,
    InitCounts,
    Negated,
    NoLength,
    OverReported,
    SharedCounter,
    Stuck,
    SyncNumbers,
    nested_collate,
    strided_nested_collate,
)
from ._procs import worker_processes

pytestmark = pytest.mark.usefixtures("no_leaks")


def _lists(batches: Any) -> list[Any]:
    return [b.tolist() if isinstance(b, torch.Tensor) else b for b in batches]


# ── workers belong to the iterator ──────────────────────────────────────────────────────────


def test_persistent_workers_with_a_temporary_loader() -> None:
    # The loader is garbage as soon as iter() returns; its workers must live on with the
    # iterator (torch ties them to the iterator, not to the loader).
    got = [
        b.tolist()
        for b in asyncload.DataLoader(
            SyncNumbers(12), batch_size=4, num_workers=2, persistent_workers=True
        )
    ]
    assert got == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    it = iter(
        asyncload.DataLoader(SyncNumbers(6), batch_size=3, num_workers=2, persistent_workers=True)
    )
    gc.collect()
    assert _lists(it) == [[0, 1, 2], [3, 4, 5]]


def test_an_error_leaving_the_loop_stops_the_workers_at_once() -> None:
    # torch stops the workers when the iterator goes, and the iterator goes when the error is
    # dropped: no reference cycle may hold it until a garbage collection.
    before = {p.pid for p in worker_processes()}
    gc.disable()
    try:
        try:
            for _ in asyncload.DataLoader(FailsAt(40, bad=9), batch_size=2, num_workers=2):
                pass
        except ValueError:
            pass
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            left = [p for p in worker_processes() if p.pid not in before]
            if not left:
                break
            time.sleep(0.05)
        assert not left, f"workers still running after the error: {[p.pid for p in left]}"
    finally:
        gc.enable()


# ── datasets: what torch calls ───────────────────────────────────────────────────────────────


@pytest.mark.parametrize("num_workers", [0, 2])
def test_subset_subclass_overrides_are_called(num_workers: int) -> None:
    data = list(range(8))
    ds = Doubled(data, [0, 1, 2, 3])  # type: ignore[arg-type]
    got = _lists(asyncload.DataLoader(ds, batch_size=2, num_workers=num_workers))
    assert got == _lists(torch.utils.data.DataLoader(ds, batch_size=2)) == [[0, 2], [4, 6]]
    cat = Negated([list(range(3)), list(range(3, 5))])  # type: ignore[list-item]
    got = _lists(asyncload.DataLoader(cat, batch_size=5, num_workers=num_workers))
    assert got == [[0, -1, -2, -3, -4]]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_plain_subset_and_concat_still_work(num_workers: int) -> None:
    ds = torch.utils.data.ConcatDataset(
        [torch.utils.data.Subset(SyncNumbers(10), [9, 8]), SyncNumbers(2)]
    )
    got = _lists(asyncload.DataLoader(ds, batch_size=4, num_workers=num_workers))
    assert got == [[9, 8, 0, 1]]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_iterable_dataset_length_warning_as_torch(num_workers: int) -> None:
    loader = asyncload.DataLoader(OverReported(6, reported=4), num_workers=num_workers)
    assert len(loader) == 4
    with pytest.warns(UserWarning, match="^Length of IterableDataset") as record:
        got = sorted(int(b) for b in loader)
    assert got == list(range(6))
    texts = [str(w.message) for w in record]
    assert any(
        t.startswith("Length of IterableDataset ")
        and "was reported to be 4(when accessing len(dataloader)), but 5 samples have been "
        "fetched. "
        in t
        for t in texts
    ), texts
    assert len(texts) == 2  # batches 5 and 6
    assert ("For multiprocessing data-loading" in texts[0]) == (num_workers > 0)


def test_no_length_warning_unless_len_was_asked() -> None:
    assert sorted(int(b) for b in asyncload.DataLoader(OverReported(6, reported=4))) == list(
        range(6)
    )


@pytest.mark.parametrize("num_workers", [0, 2])
def test_iterable_whose_len_raises_type_error_iterates(num_workers: int) -> None:
    loader = asyncload.DataLoader(NoLength(5), batch_size=None, num_workers=num_workers)
    got = sorted(int(b) for b in loader)
    assert got == [i for i in range(5) for _ in range(max(1, num_workers))]
    with pytest.raises(TypeError, match="valid length"):
        len(loader)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_datapipe_is_sharded_and_seeded_as_torch(num_workers: int) -> None:
    def run(seed: int) -> list[int]:
        dp = IterableWrapper(range(40)).shuffle().sharding_filter()
        gen = torch.Generator().manual_seed(seed)
        loader = asyncload.DataLoader(dp, batch_size=None, num_workers=num_workers, generator=gen)
        return [int(x) for x in loader]

    first = run(1)
    # Every worker shuffles with the same seed, then keeps its share: each item exactly once.
    assert sorted(first) == list(range(40))
    assert first != list(range(40))
    assert run(1) == first  # the shared seed comes from the loader's generator
    assert run(2) != first


def test_datapipe_reshuffles_each_epoch_with_persistent_workers() -> None:
    dp = IterableWrapper(range(30)).shuffle().sharding_filter()
    loader = asyncload.DataLoader(
        dp, batch_size=None, num_workers=2, persistent_workers=True,
        generator=torch.Generator().manual_seed(3),
    )  # fmt: skip
    epochs = [[int(x) for x in loader] for _ in range(2)]
    assert all(sorted(e) == list(range(30)) for e in epochs)
    assert epochs[0] != epochs[1]


# ── what crosses from a worker, and what the errors say ──────────────────────────────────────


@pytest.mark.parametrize(
    "collate",
    [
        nested_collate,
        # torch itself warns when it rebuilds a strided nested tensor, as in its own workers
        pytest.param(
            strided_nested_collate,
            marks=pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors"),
        ),
    ],
)
def test_nested_tensor_batches_cross_from_workers(collate: Any) -> None:
    loader = asyncload.DataLoader(SyncNumbers(6), batch_size=3, num_workers=2, collate_fn=collate)
    batches = list(loader)
    assert len(batches) == 2
    for batch, first in zip(batches, (0, 3), strict=True):
        assert batch.is_nested
        rows = list(batch.unbind())
        assert [r.tolist() for r in rows] == [[float(s)] * (s + 1) for s in range(first, first + 3)]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_timeout_message_keeps_the_number_as_given(num_workers: int) -> None:
    loader = asyncload.DataLoader(Stuck(), batch_size=2, num_workers=num_workers, timeout=1)
    with pytest.raises(asyncload.BatchTimeout, match=r"^DataLoader timed out after 1 seconds"):
        list(loader)


def _init(worker_id: int) -> None:
    pass


def test_unpicklable_worker_init_fn_warns_as_torch_and_raises_ours() -> None:
    loader = asyncload.DataLoader(
        SyncNumbers(4), num_workers=1, worker_init_fn=lambda w: _init(w),
        multiprocessing_context="forkserver",
    )  # fmt: skip
    with (
        pytest.warns(UserWarning, match="Got pickle error when attempting to start a worker"),
        pytest.raises(asyncload.NotPicklable, match="worker_init_fn"),
    ):
        iter(loader)
    assert issubclass(asyncload.NotPicklable, TypeError)


# ── objects shared "through inheritance", and the iterator's _workers ───────────────────────


@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn", None])
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.timeout(120)
def test_multiprocessing_values_locks_queues_and_events_reach_the_workers(
    method: str | None, persistent: bool
) -> None:
    """torch hands a dataset's or worker_init_fn's Value, Lock, Queue or Event to its workers as
    they start (its test_worker_seed uses one); pickling them later raises "Synchronized objects
    should only be shared between processes through inheritance"."""
    import multiprocessing

    ctx = multiprocessing.get_context(method or "forkserver")
    dataset = SharedCounter(24, ctx)
    init = InitCounts(ctx)
    loader = asyncload.DataLoader(
        dataset,
        batch_size=4,
        num_workers=2,
        multiprocessing_context=method,
        worker_init_fn=init,
        persistent_workers=persistent,
    )
    if method is None:
        time.sleep(0.5)  # the loader's standby processes have started meanwhile
    for epoch in range(2):
        assert sorted(i for b in loader for i in b.tolist()) == list(range(24))
        assert dataset.count.value == 24 * (epoch + 1)
    assert dataset.started.is_set()
    assert init.started.value == (2 if persistent else 4)
    del loader
    gc.collect()


@pytest.mark.timeout(120)
def test_a_managers_proxy_reaches_the_workers() -> None:
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    with ctx.Manager() as manager:
        shared = manager.dict()
        loader = asyncload.DataLoader(SharedCounter(8, ctx, shared), batch_size=4, num_workers=2)
        assert sorted(i for b in loader for i in b.tolist()) == list(range(8))
        assert sorted(shared.keys()) == list(range(8))
        del loader
        gc.collect()


def test_the_iterators_workers_are_torchs_list_of_processes() -> None:
    """torch's tests and users' own read iter(loader)._workers: pids, is_alive(), join()."""
    it = iter(asyncload.DataLoader(SyncNumbers(40), batch_size=4, num_workers=2))
    workers = it._workers
    assert len(workers) == 2
    assert all(w.is_alive() for w in workers)
    assert sorted(w.pid for w in workers) == sorted(it.worker_pids)
    del it
    gc.collect()
    for w in workers:
        w.join(10)
        assert not w.is_alive()
        assert w.exitcode == 0
    single = iter(asyncload.DataLoader(SyncNumbers(4), batch_size=4, num_workers=0))
    assert single._workers == []
    assert next(single).tolist() == [0, 1, 2, 3]


@pytest.mark.timeout(60)
def test_workers_joined_from_several_threads_all_see_exit_code_0() -> None:
    """The reaper joins a dropped iterator's workers while the program joins them too (from
    threads of its own, here): every thread must read the true exit code. A forkserver
    worker's status is 8 bytes on a pipe: read twice, multiprocessing said 255."""
    for _ in range(3):
        it = iter(asyncload.DataLoader(SyncNumbers(40), batch_size=4, num_workers=2))
        workers = it._workers
        codes: list[int | None] = []
        threads = [
            threading.Thread(target=_join_and_note, args=(w, codes))
            for w in workers
            for _ in range(3)
        ]
        for t in threads:
            t.start()
        del it
        gc.collect()
        for t in threads:
            t.join(15)
        assert codes == [0] * len(threads)
        assert [w.exitcode for w in workers] == [0, 0]


def _join_and_note(worker: Any, codes: list[int | None]) -> None:
    worker.join(10)
    codes.append(worker.exitcode)
