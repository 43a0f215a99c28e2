"""A finished read waits for the loop's next poll when inline CPU work kept the loop from it.

No network: the loop's own timers stand in for answers that arrived (both are handled right
after a poll), and busy-waits for decodes. Counts, not durations, are asserted.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest
import uvloop

import asyncload
from asyncload._control import turns as _turns

from .._datasets import TurnRank, spin

pytestmark = pytest.mark.timeout(30)

T = TypeVar("T")


async def _pause() -> None:
    """What ``asyncload.read`` does once it has the bytes."""
    loop_turns = _turns.must_wait()
    if loop_turns is not None:
        await loop_turns.wait()


DECODES = 20
DECODE_S = 0.002


def _decode() -> None:
    spin(DECODE_S)  # CPU work that holds the loop, as an inline decode


async def _burst(loop_turns: _turns.LoopTurns | None) -> int:
    """*DECODES* samples whose reads finished together, each decoded inline after its read;
    how many were decoded before a timer that came due during the first decode (an answer
    that arrived meanwhile) was handled."""
    decoded = 0
    seen: list[int] = []

    async def sample() -> None:
        nonlocal decoded
        await _pause()  # where storage.read ends
        if decoded == 0 and not seen:
            # Due at once: handled at the loop's next poll, whenever that is.
            asyncio.get_running_loop().call_later(0, lambda: seen.append(decoded))
        _decode()
        decoded += 1

    async def run() -> None:
        await asyncio.gather(*(sample() for _ in range(DECODES)))

    if loop_turns is None:
        await run()
    else:
        with _turns.using(loop_turns):
            await run()
    return seen[0]


def _on_uvloop(coro: Coroutine[Any, Any, T]) -> T:
    # A worker's loop (``_workers/child.py``): uvloop runs timers and I/O callbacks at the start
    # of every turn, before the ready tasks; asyncio's own loop queues them behind those.
    loop = uvloop.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


def test_a_burst_of_inline_decodes_lets_the_loop_poll_within_the_budget() -> None:
    # Without turns, the whole burst runs in one turn of the loop: the answer waits for all.
    assert _on_uvloop(_burst(None)) == DECODES
    # With them, the loop polls once the budget (5 ms) is spent: after 3-4 decodes of 2 ms.
    assert _on_uvloop(_burst(_turns.LoopTurns(budget=0.005))) <= 5


def test_a_loop_that_is_not_busy_never_pauses_and_then_sleeps() -> None:
    async def main() -> tuple[int, bool]:
        loop_turns = _turns.LoopTurns(budget=0.005)
        with _turns.using(loop_turns):
            for _ in range(50):  # one read per turn, nothing else to do
                await _pause()
                await asyncio.sleep(0)
        await asyncio.sleep(0.01)
        return loop_turns.pauses, loop_turns._armed

    pauses, armed = asyncio.run(main())
    assert pauses == 0
    assert not armed  # no callback left queued: an idle loop is not kept awake


def test_a_turn_long_in_wall_time_but_not_in_cpu_time_does_not_pause() -> None:
    # A worker descheduled on shared cores (here: a blocking sleep) was not busy: its turn is
    # long on the wall clock, which the check reads first, and short on the thread's CPU clock,
    # which decides.
    async def main() -> tuple[bool, bool, int]:
        loop_turns = _turns.LoopTurns(budget=0.005)
        loop_turns.due()  # starts watching this turn
        time.sleep(0.02)  # 20 ms of wall time, next to no CPU
        descheduled = loop_turns.due()
        _decode()
        _decode()
        _decode()  # 6 ms of CPU: past the budget on both clocks
        busy = loop_turns.due()
        return descheduled, busy, loop_turns.pauses

    assert asyncio.run(main()) == (False, True, 1)


def test_outside_an_engine_reads_never_pause() -> None:
    async def main() -> list[bool]:
        said = []
        for _ in range(3):  # all in one turn: with turns of budget 0, the second would wait
            _decode()
            said.append(_turns.must_wait() is not None)
        return said

    assert _turns.turns.get() is None
    assert asyncio.run(main()) == [False, False, False]


def test_storage_reads_pause_on_a_busy_loop(tmp_path: Path) -> None:
    path = tmp_path / "blob"
    path.write_bytes(b"x" * 1000)

    async def main() -> int:
        loop_turns = _turns.LoopTurns(budget=0.0)  # any work at all is "busy"
        with _turns.using(loop_turns):
            # Finished in one turn (a file in the page cache is read inline): the first read
            # starts watching the turn, the others find it past the budget.
            got = await asyncio.gather(*(asyncload.read(str(path)) for _ in range(4)))
        assert got == [b"x" * 1000] * 4
        return loop_turns.pauses

    assert asyncio.run(main()) >= 1


@pytest.mark.parametrize("in_order", [True, False])
def test_a_workers_turns_rank_its_reads_by_their_batch(in_order: bool) -> None:
    # The wiring of _workers/child.py: each worker's turns rank a waiting read by its
    # sample's batch (the engine's send order), whichever worker reads it.
    loader = asyncload.DataLoader(
        TurnRank(24), batch_size=4, num_workers=2, in_order=in_order, collate_fn=list
    )
    batches = list(loader)
    del loader  # its standby workers go now, not with a failed assert's traceback
    assert sorted(i for b in batches for i, _ in b) == list(range(24))
    for batch in batches:
        (rank,) = {r for _, r in batch}  # one rank for a whole batch
        assert [i for i, _ in batch] == list(range(4 * rank, 4 * rank + 4))


batch: contextvars.ContextVar[int] = contextvars.ContextVar("batch", default=0)


def test_reads_that_wait_go_on_the_head_batchs_first() -> None:
    # The engine's batches, the head batch 0, their samples' reads finished in one busy turn in
    # another order: their inline work then runs batch by batch, in order within each.
    async def main() -> list[tuple[int, int]]:
        order: list[tuple[int, int]] = []

        async def sample(b: int, k: int) -> None:
            batch.set(b)
            _decode()  # the turn's CPU clock moves on: past a budget of 0 at the next read
            await _pause()
            order.append((b, k))

        loop_turns = _turns.LoopTurns(budget=0.0, priority=batch.get)
        with _turns.using(loop_turns):
            await asyncio.gather(*(sample(b, k) for k in range(3) for b in (3, 1, 2, 0)))
        assert not loop_turns._letting_go  # nothing waits, no callback left queued
        return order

    order = _on_uvloop(main())
    # The first read found the turn within its budget and went on; every other one waited.
    assert order[0] == (3, 0)
    assert order[1:] == sorted(order[1:])


def test_a_read_cancelled_while_it_waits_lets_the_others_go() -> None:
    async def main() -> tuple[list[int], bool]:
        went: list[int] = []

        async def sample(k: int) -> None:
            await _pause()
            went.append(k)

        loop_turns = _turns.LoopTurns(budget=0.0)
        with _turns.using(loop_turns):
            tasks = [asyncio.create_task(sample(k)) for k in range(5)]
            await asyncio.sleep(0)  # every task has read; all but the first wait
            tasks[2].cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return went, not loop_turns._letting_go

    went, idle = _on_uvloop(main())
    assert went == [0, 1, 3, 4]
    assert idle


def test_a_read_that_finishes_while_others_are_let_go_goes_behind_them() -> None:
    # Reads let go resume a turn later; one that finishes meanwhile (a task queued behind the
    # callback that let them go) must not go first.
    async def main() -> list[int]:
        order: list[int] = []

        async def sample(b: int) -> None:
            batch.set(b)
            _decode()
            await _pause()
            order.append(b)

        loop_turns = _turns.LoopTurns(budget=0.0, priority=batch.get)
        with _turns.using(loop_turns):
            first = [asyncio.create_task(sample(b)) for b in (5, 0)]
            await asyncio.sleep(0)  # 5 went on (the turn's first read), 0 waits
            late = asyncio.create_task(sample(9))  # runs after the callback that lets 0 go
            await asyncio.gather(*first, late)
        return order

    assert _on_uvloop(main()) == [5, 0, 9]


def test_a_read_waits_behind_others_in_line_within_the_budget() -> None:
    # A large budget: only the line makes the second read wait, and the head batch goes first.
    async def main() -> tuple[list[int], int]:
        order: list[int] = []
        loop_turns = _turns.LoopTurns(budget=60.0, priority=batch.get)

        async def sample(b: int, *, forced: bool = False) -> None:
            batch.set(b)
            if forced:
                await loop_turns.wait()  # as a read past the budget would
            else:
                await _pause()
            order.append(b)

        with _turns.using(loop_turns):
            await asyncio.gather(sample(1, forced=True), sample(0))
        return order, loop_turns.pauses

    order, pauses = _on_uvloop(main())
    assert order == [0, 1]
    assert pauses == 0  # the budget never ran out: the line alone held the second read


def test_reads_on_another_loop_neither_wait_nor_count() -> None:
    # A worker's turns are its loop's: a read_sync in a thread that copied the worker's
    # context runs on a loop of its own, and never waits on (or wakes) the worker's.
    async def other_loop_checks(loop_turns: _turns.LoopTurns) -> bool:
        return loop_turns.must_wait()

    async def main() -> tuple[bool, bool]:
        loop_turns = _turns.LoopTurns(budget=0.0, loop=asyncio.get_running_loop())
        loop_turns.due()
        _decode()
        here = loop_turns.must_wait()  # past the budget on its own loop
        there = await asyncio.to_thread(asyncio.run, other_loop_checks(loop_turns))
        return here, there

    assert _on_uvloop(main()) == (True, False)
