"""Delivery that never idles behind a straggler: the pass sends on, bounded by bytes held.

A fake ``Workers`` holds back the first batch of a pass until everything else it was sent has
been answered, as one slow request would; the pass must keep sending later batches (up to the
byte bound), and still yield in sampler order, each batch once. A real loader with one sample
that waits for later samples to finish shows the same through the dataset's own counter.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import numpy as np
import pytest
import torch

import asyncload
from asyncload._loader.lookahead import BatchSizes, LookAhead, batch_nbytes
from asyncload._loader.pass_iterator import Pass
from asyncload._loader.spec import PassSpec
from asyncload._protocol.messages import IndexTask, Result

from .test_pass_iterator import FakeWorkers, _spec, _torch_order


class LateHead(FakeWorkers):
    """Answers batch 0 last: only once every other task it was sent has been answered."""

    sent_before_head: int | None = None

    def get(self, timeout: float) -> object | None:
        others = [r for r in self._replies if not (isinstance(r, Result) and r.send_idx == 0)]
        if others:
            reply = others[0]
            self._replies.remove(reply)
            return reply
        if self._replies and self.sent_before_head is None:
            self.sent_before_head = sum(isinstance(m, IndexTask) for _, m in self.sent)
        return super().get(timeout)


def _run(spec: PassSpec) -> tuple[list[Any], LateHead, Pass]:
    made: list[LateHead] = []

    def start(spec: PassSpec, **_: Any) -> LateHead:
        made.append(LateHead(spec))
        return made[-1]

    it = Pass(spec, start_workers=start)
    return list(it), made[0], it


def test_batch_nbytes_counts_payloads() -> None:
    assert batch_nbytes([b"x" * 100] * 32) == 3200
    assert batch_nbytes([b"x" * 100] * 640) == 64_000  # sized from its first items
    assert batch_nbytes({"img": torch.zeros(4, 8, dtype=torch.float32), "n": np.zeros(3)}) == 152
    assert batch_nbytes(("ab", memoryview(b"abc"))) == 5


def test_workers_fetch_on_behind_a_late_head_and_order_holds() -> None:
    spec = _spec()  # 13 batches, a fixed window of 3 x 2 workers = 6
    got, workers, it = _run(spec)
    assert workers.sent_before_head == 13  # every batch, not just the window
    assert got == _torch_order(50, 4, seed=7)
    assert it.tally.head_wait_s >= 0.0
    assert it.tally.stats().head_wait_s == it.tally.head_wait_s


def test_prefetch_bytes_bounds_the_look_ahead() -> None:
    one_batch = batch_nbytes(list(range(4)))
    got, workers, _it = _run(dataclasses.replace(_spec(), prefetch_bytes=10 * one_batch))
    # The window (6) is always allowed; beyond it, sent-but-unyielded batches fill 10 batches'
    # bytes, not one more.
    assert workers.sent_before_head == 10
    assert got == _torch_order(50, 4, seed=7)
    got, workers, _it = _run(dataclasses.replace(_spec(), prefetch_bytes=0))
    assert workers.sent_before_head == 6  # 0: the fixed window only
    assert got == _torch_order(50, 4, seed=7)


def test_look_ahead_rule() -> None:
    la = LookAhead(window=2, limit_bytes=1000)
    assert la.may_send(pending=1, ready=0)
    assert not la.may_send(pending=2, ready=0)  # beyond the window before any size is known
    la.arrived(300, held=True)
    assert la.held_bytes == 300
    assert la.may_send(pending=1, ready=1)  # 300 held + 2 x 300 expected <= 1000
    assert not la.may_send(pending=2, ready=1)  # 300 + 3 x 300 > 1000
    la.released(300)
    assert la.held_bytes == 0


class Straggler(asyncload.Dataset[int]):
    """Sample 0 waits (bounded) until *wait_for* other samples were fetched."""

    def __init__(self, n: int, wait_for: int) -> None:
        self.n = n
        self.wait_for = wait_for
        self.done = 0
        self.seen_while_waiting: int | None = None

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, i: int) -> int:
        if i == 0:
            deadline = time.monotonic() + 10
            while self.done < self.wait_for and time.monotonic() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(0.005)
            self.seen_while_waiting = self.done
        else:
            await asyncio.sleep(0)
            self.done += 1
        return i


@pytest.mark.parametrize("in_order", [True, False])
def test_a_straggling_sample_does_not_stop_later_batches(in_order: bool) -> None:
    # max_concurrency=4, batch 4: a fixed window of 2 batches would let at most 7 other
    # samples finish while sample 0 waits. It waits for all 63 others, so its batch is
    # finished last whatever the timing (in_order=False then yields it last).
    data = Straggler(64, wait_for=63)
    loader = asyncload.DataLoader(
        data, batch_size=4, num_workers=0, max_concurrency=4, collate_fn=list, in_order=in_order
    )
    got = list(loader)
    assert data.seen_while_waiting is not None
    assert data.seen_while_waiting == 63
    expected = [list(range(k, k + 4)) for k in range(0, 64, 4)]
    if in_order:
        assert got == expected
        assert loader.stats().head_wait_s > 0
    else:
        assert sorted(got) == expected
        assert got[-1] == [0, 1, 2, 3]  # the straggler's batch came last


def test_prefetch_bytes_must_be_non_negative() -> None:
    with pytest.raises(ValueError, match="prefetch_bytes"):
        asyncload.DataLoader(list(range(4)), prefetch_bytes=-1)


class InOrder(FakeWorkers):
    """Answers in the order it was sent: no late head."""

    def get(self, timeout: float) -> object | None:
        if not self._replies:
            time.sleep(timeout)
            return None
        return self._replies.pop(0)


def _most_out(spec: PassSpec) -> tuple[int, list[Any]]:
    """The most batches out (sent, not yet yielded) seen after each batch the loop takes."""
    made: list[InOrder] = []

    def start(spec: PassSpec, **_: Any) -> InOrder:
        made.append(InOrder(spec))
        return made[-1]

    it = Pass(spec, start_workers=start)
    got, most = [], 0
    for batch in it:
        got.append(batch)
        sent = sum(isinstance(m, IndexTask) for _, m in made[0].sent)
        most = max(most, sent - len(got))
    return most, got


def test_large_batches_are_bounded_by_bytes_beyond_torchs_two_per_worker() -> None:
    one_batch = batch_nbytes(list(range(4)))
    sizes = BatchSizes()  # the loader's, shared by its passes

    def spec(limit: float, always: int = 1) -> PassSpec:
        return dataclasses.replace(
            _spec(), prefetch_bytes=int(limit), always_out_per_worker=always, batch_sizes=sizes
        )

    most, got = _most_out(spec(4.5 * one_batch))
    # Before any batch's size is known, the whole window (3 x 2 workers) went out: 5 were
    # left once the first was taken.
    assert most == 5
    assert got == _torch_order(50, 4, seed=7)
    most, got = _most_out(spec(4.5 * one_batch))
    assert most == 4  # the loader's next pass: 4 batches' bytes, inside the window
    assert got == _torch_order(50, 4, seed=7)
    most, _ = _most_out(spec(one_batch))
    assert most == 2  # always_out_per_worker x 2 workers, whatever their bytes
    # prefetch_factor given: the whole window is out whatever the bytes, as torch has it.
    most, _ = _most_out(spec(one_batch, always=3))
    assert most == 6


class Big(asyncload.Dataset[torch.Tensor]):
    """256 KiB tensors; counts the samples fetched."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.fetched = 0

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, i: int) -> torch.Tensor:
        await asyncio.sleep(0)
        self.fetched += 1
        return torch.full((64, 1024), float(i))


def test_a_slow_training_loop_over_large_samples_holds_prefetch_bytes_not_the_window() -> None:
    # 1 MiB batches; the default window is ceil(512 / 4) + 1 = 129 batches, the whole pass.
    # The first pass sends it all before any batch's size is known; the next ones don't.
    data = Big(256)
    loader = asyncload.DataLoader(data, batch_size=4, num_workers=0, prefetch_bytes=4 << 20)
    assert len(list(loader)) == 64
    data.fetched = 0
    it = iter(loader)
    first = next(it)
    time.sleep(0.3)  # a training step, long enough for the workers to run far ahead
    ahead = data.fetched
    rest = list(it)
    assert ahead <= 4 * (1 + 4 + 1)  # the batch taken, 4 MiB out, one more while it lands
    assert [int(b[0, 0, 0]) for b in [first, *rest]] == list(range(0, 256, 4))
