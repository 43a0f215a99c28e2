"""The pass without processes or a network: a fake Workers answers in a seeded random order.

Ordering, exactly-once, resume, the lifecycle states and the timeout message are the pass's
own logic; here they are driven directly, in milliseconds.
"""

from __future__ import annotations

import random
import time
from typing import Any

import pytest
import torch
import torch.utils.data

import asyncload
from asyncload._checkpoint.resume import ResumePoint
from asyncload._engine import WorkerOptions
from asyncload._loader.pass_iterator import Pass, State
from asyncload._loader.spec import PassSpec
from asyncload._protocol.messages import (
    Failure,
    IndexTask,
    PassStarted,
    RemoteError,
    Result,
    Shutdown,
    StartPass,
)


class FakeWorkers:
    """Answers each task at once, in memory; ``get`` hands replies back in a seeded random
    order, as concurrent fetches with random latencies would complete."""

    def __init__(
        self, spec: PassSpec, *, jitter_seed: int = 0, fail: set[int] = frozenset(), silent=False
    ) -> None:
        self.spec = spec
        self.count = max(1, spec.num_workers)
        self.live_stats = None
        self.sent: list[tuple[int, object]] = []
        self.closed = 0
        self.prepared = 0  # prepare_next() calls
        self._replies: list[object] = []
        self._rng = random.Random(jitter_seed)
        self._fail = fail
        self._silent = silent

    @property
    def pids(self) -> tuple[int, ...]:
        return ()

    def send(self, worker_id: int, msg: object) -> None:
        self.sent.append((worker_id, msg))
        if self._silent or isinstance(msg, Shutdown):
            return
        if isinstance(msg, StartPass):
            self._replies.append(PassStarted(msg.generation, worker_id))
            return
        assert isinstance(msg, IndexTask)
        indices = [int(i) for i in msg.indices]
        bad = self._fail.intersection(indices)
        if bad:
            error = RemoteError.capture(ValueError(f"sample {min(bad)} is bad"), "in a fake")
            self._replies.append(Failure(msg.send_idx, msg.generation, worker_id, error))
            return
        data = self.spec.collate_fn([self.spec.dataset[i] for i in indices])
        self._replies.append(Result(msg.send_idx, msg.generation, worker_id, data))

    def get(self, timeout: float) -> object | None:
        if not self._replies:
            time.sleep(timeout)
            return None
        return self._replies.pop(self._rng.randrange(len(self._replies)))

    def prepare_next(self) -> None:
        self.prepared += 1

    def check_alive(self) -> None:
        pass

    def close(self) -> None:
        self.closed += 1


def _spec(
    n: int = 50,
    batch_size: int = 4,
    *,
    seed: int = 7,
    num_workers: int = 2,
    in_order: bool = True,
    persistent: bool = False,
    timeout: float = 0,
) -> PassSpec:
    gen = torch.Generator().manual_seed(seed)
    data = list(range(n))
    sampler = torch.utils.data.BatchSampler(
        torch.utils.data.RandomSampler(data, generator=gen), batch_size, drop_last=False
    )
    return PassSpec(
        dataset=data,
        is_iterable=False,
        auto_collation=True,
        index_sampler=sampler,
        batch_size=batch_size,
        drop_last=False,
        collate_fn=list,
        worker_init_fn=None,
        num_workers=num_workers,
        worker_options=WorkerOptions(max_concurrency=8),
        outstanding_per_worker=3,
        in_order=in_order,
        timeout=timeout,
        persistent=persistent,
        pin_device=None,
        generator=gen,
    )


def _start(spec: PassSpec, **fake: Any) -> tuple[Pass, list[FakeWorkers]]:
    made: list[FakeWorkers] = []

    def start(spec: PassSpec, **_: Any) -> FakeWorkers:
        made.append(FakeWorkers(spec, **fake))
        return made[-1]

    return Pass(spec, start_workers=start), made


def _torch_order(n: int, batch_size: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    loader = torch.utils.data.DataLoader(
        list(range(n)), batch_size=batch_size, shuffle=True, generator=gen, collate_fn=list
    )
    return [list(b) for b in loader]


@pytest.mark.parametrize("jitter_seed", [0, 1, 2])
def test_in_order_restores_sampler_order_as_torch(jitter_seed: int) -> None:
    it, _ = _start(_spec(), jitter_seed=jitter_seed)
    assert list(it) == _torch_order(50, 4, seed=7)


@pytest.mark.parametrize("jitter_seed", [0, 1])
def test_out_of_order_yields_each_batch_exactly_once(jitter_seed: int) -> None:
    it, _ = _start(_spec(in_order=False), jitter_seed=jitter_seed)
    got = list(it)
    assert sorted(map(sorted, got)) == sorted(map(sorted, _torch_order(50, 4, seed=7)))


@pytest.mark.parametrize("in_order", [True, False])
def test_resume_yields_exactly_the_rest(in_order: bool) -> None:
    it, _ = _start(_spec(in_order=in_order), jitter_seed=3)
    first = [next(it) for _ in range(5)]
    state = it.checkpoint(epoch=None).to_dict()
    rest_before = list(it)
    point = ResumePoint.from_dict(state, iterable=False, num_workers=2)
    spec = _spec(in_order=in_order, seed=99)  # a fresh generator: the checkpoint restores it
    resumed = Pass(spec, resume=point, start_workers=lambda s, **_: FakeWorkers(s, jitter_seed=4))
    rest_after = list(resumed)
    assert sorted(map(sorted, first + rest_after)) == sorted(map(sorted, first + rest_before))
    assert len(first) + len(rest_after) == 13
    if in_order:
        assert rest_after == rest_before


def test_states_and_misuse() -> None:
    it, (workers,) = _start(_spec(n=8, batch_size=4))
    assert it.state is State.RUNNING
    assert len(list(it)) == 2
    assert it.state is State.CLOSED  # not persistent: the end of the epoch closes it
    assert workers.closed == 1
    for _ in range(2):
        with pytest.raises(StopIteration):
            next(it)  # a finished iterator stays finished, as any Python iterator (and torch's)
    with pytest.raises(RuntimeError, match="pass was closed"):
        it.restart(epoch=None, len_reported=None)
    it.close()
    assert workers.closed == 1  # once only

    stopped, _ = _start(_spec(n=8, batch_size=4))
    next(stopped)
    stopped.close()  # mid-pass: what is left is not "the end", and saying so would lose it
    with pytest.raises(RuntimeError, match="pass was closed"):
        next(stopped)


def test_persistent_pass_restarts_with_the_handshake() -> None:
    it, (workers,) = _start(_spec(n=8, batch_size=4, persistent=True))
    first = list(it)
    assert it.state is State.EXHAUSTED
    assert workers.closed == 0
    with pytest.raises(StopIteration):
        next(it)  # an exhausted iterator stays exhausted, as any Python iterator
    it.restart(epoch=3, len_reported=None)
    starts = [m for _, m in workers.sent if isinstance(m, StartPass)]
    assert [(m.generation, m.epoch) for m in starts] == [(1, 3), (1, 3)]
    second = list(it)
    assert sorted(i for b in second for i in b) == sorted(i for b in first for i in b)
    assert second != first  # the sampler reshuffles every pass, as torch's does
    it.close()
    assert workers.closed == 1
    assert it.state is State.CLOSED


def test_a_failed_batch_is_raised_and_the_pass_goes_on() -> None:
    it, (workers,) = _start(_spec(n=12, batch_size=4, seed=1), fail={5})
    got: list[Any] = []
    errors = []
    while True:
        try:
            got.append(next(it))
        except StopIteration:
            break
        except ValueError as exc:
            errors.append(str(exc))
    assert errors == ["sample 5 is bad"]
    assert len(got) == 2
    assert 5 not in {i for b in got for i in b}
    assert workers.closed == 1


def test_timeout_names_the_batch_and_its_samples() -> None:
    it, (workers,) = _start(_spec(n=8, batch_size=4, timeout=0.2), silent=True)
    first = workers.sent[0][1]
    assert isinstance(first, IndexTask)
    with pytest.raises(asyncload.BatchTimeout) as info:
        next(it)
    text = str(info.value)
    assert text.startswith("DataLoader timed out after 0.2 seconds waiting for batch 0 ")
    assert f"(sample indices {first.indices.tolist()!r})" in text
    assert it.state is State.CLOSED
    assert workers.closed == 1


def test_a_worker_that_could_not_start_ends_the_pass() -> None:
    class Broken(FakeWorkers):
        def send(self, worker_id: int, msg: object) -> None:
            error = RemoteError.capture(RuntimeError("no credentials"), "during start-up")
            self._replies.append(Failure(-1, 0, worker_id, error))

    made: list[FakeWorkers] = []

    def start(spec: PassSpec, **_: Any) -> FakeWorkers:
        made.append(Broken(spec))
        return made[-1]

    it = Pass(_spec(), start_workers=start)
    with pytest.raises(RuntimeError, match="no credentials"):
        next(it)
    assert it.state is State.CLOSED
    assert made[0].closed == 1


def test_the_next_pass_is_prepared_once_the_last_task_is_sent() -> None:
    """``Workers.prepare_next`` (standby processes): once, when the sampler runs out, while
    batches are still to come, not at the start."""
    it, made = _start(_spec(n=200))  # 50 batches; 2 workers x 3 outstanding at first
    assert made[0].prepared == 0
    got = [next(it) for _ in range(40)]
    assert made[0].prepared == 1, "the sampler ran out with the last tasks sent"
    got += list(it)
    assert made[0].prepared == 1
    assert len(got) == 50
