"""Turns of a worker's event loop for its I/O while samples' CPU work runs inline on it.

A worker that decodes inline (the default with one core per worker: ``_dataset/cpu.py``,
``decode_on_lane``) runs each sample's decode as part of the task that read it. When a round
trip's worth of answers lands together, their tasks are all ready at once and the loop runs
them one after another, 60 ms and more of decoding, before it polls its sockets again. An
aiohttp answer needs two or three such turns (headers, body, the task's resumption), so each
burst stretches the next answers' latency by as much, and the samples waiting to be decoded hold
their fetch slots meanwhile: the requests actually on the wire drain, and then the CPU waits for
them. ``bench_pipeline``'s JPEGs over HTTP at 50 ms (2 workers, 2 cores) left 8-11% of the
machine idle, against 1% over local files.

So a finished read (``_storage/api.py``) lets the loop poll first when its thread has run more
than ``TURN_BUDGET`` of CPU since it last did: the sample's decode waits for the next turn, in
whose poll the answers that arrived meanwhile are read (uvloop, a worker's loop, runs I/O
callbacks in the poll, before the ready tasks). CPU time, not wall time: on shared cores a
worker descheduled for 10 ms is not busy, and pausing for that (wall time) cost two loaders
sharing a throttled store (``bench_autotune`` (c)) 5% of their goodput, median of 8 runs; it
also paused under log-normal latency, where it gained 4% that CPU time does not.

Measured on the JPEG pipeline at 50 ms: 1,205-1,212 images/s in 4 runs of 6,144 images against
a median of 1,140 of 6 without, 3-5% of the machine idle against 8%, the same CPU per image;
1,080-1,086 against 1,026-1,041 over 2,048 images. Under log-normal latency (p99 400 ms) and
over local files, no change beyond the noise; ``bench_autotune`` (c) level (median 0.925 of
the store's limit in 8 runs, 0.89 in 11 without). 1 KB records at 0 ms (``bench_loader`` B):
94-100 µs of CPU per sample against 92-96, the check's cost where every turn is many answers;
since then the check reads the thread's CPU clock (a system call) only once the turn's wall time
is past the budget, and the poll's callback reads none: 160 ns a check instead of 590, 32
checks a turn (``LoopTurns.due``). The line of waiting reads (below) adds ~90 ns a read: 350 ns
a check against 260 without it, measured on 2026-11-29, when this machine ran at half the speed.

The reads that wait go on in a later turn in order of need: the batch their sample belongs to
(the engine's send order, the head batch first; ``_dataset/cpu.py``'s ``priority``), then the
order they came in, and a read that finishes while others are in line waits behind them, so it
cannot take their place. That is the CPU lane's order (``_dataset/cpu.py``) for the work a worker
does inline. In arrival order (``asyncio.sleep(0)``, before 2026-11-29), a worker decoding JPEGs
from local files decoded three or four batches interleaved, and a pass delivered its 4th batch
after 0.8-1.1 s where torch's DataLoader did after 0.5 s. Iterable datasets set no priority
(their reads go in arrival order), and a cache hit returns before the check.

The loop's last poll is seen by a callback queued with ``call_soon``, which runs right after
the next poll; one is queued at a time, and only while reads finish, so an idle loop stays idle.
obstore's reads (s3://, gs://, az://) complete on its own threads, and those rows idled 2%
before: the pause changes little there. Outside an engine (your own ``asyncio.run``) there are
no turns to share and reads never pause.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import time
from collections.abc import Callable, Iterator

__all__ = ["TURN_BUDGET", "LoopTurns", "must_wait", "turns", "using"]

TURN_BUDGET = 0.01
"""CPU seconds of the loop's thread after a poll of its sockets, past which a finished read
waits for the next poll: a few decodes of a few milliseconds, and more cheap answers than a
small-record worker's turn holds."""


class LoopTurns:
    """The turns of one event loop: when the work of this one began (its first finished read
    since a poll), whether a read should wait for the next poll because that work ran past
    the budget on the loop thread's CPU clock, and the reads that wait, in line by batch.

    ``due`` and ``must_wait`` are checks, not coroutines: they run on every read of a worker
    (the per-sample path). A read that must wait (its turn is past the budget, or others are
    in line: waiting, or let go and not yet resumed) awaits ``wait``; a later turn lets them
    all go in order of ``priority`` (the batch a sample belongs to, the head batch's first),
    then of arrival. Reads on any other loop (a ``read_sync`` on its own, in a thread that
    copied the worker's context) neither wait nor count.

    Args:
        budget: CPU seconds after a poll past which ``due`` says to wait for the next one.
        loop: The loop whose turns these are; ``None``: the first that reads.
        priority: The running sample's priority; a worker passes the engine's batch order
            (``_dataset/cpu.py``'s ``priority``). ``None``: one for all, in arrival order.

    Examples:
        >>> import asyncio
        >>> async def main() -> list[bool]:
        ...     turns = LoopTurns(budget=0.0)
        ...     first = turns.due()  # starts watching this turn of the loop
        ...     second = turns.due()  # the same turn, past the budget
        ...     await asyncio.sleep(0)  # the next turn, after a poll
        ...     return [first, second, turns.due()]
        >>> asyncio.run(main())
        [False, True, False]
    """

    __slots__ = (
        "_armed",
        "_busy_cpu",
        "_busy_wall",
        "_in_line",
        "_letting_go",
        "_loop",
        "_order",
        "_priority",
        "_waiting",
        "budget",
        "pauses",
    )

    def __init__(
        self,
        budget: float = TURN_BUDGET,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        priority: Callable[[], int] | None = None,
    ) -> None:
        self.budget = budget
        self.pauses = 0
        """Times ``due`` said to wait for the next poll."""
        # When the watched turn's work began (the first read that finished in it), on the loop
        # thread's CPU clock and on the wall clock.
        self._busy_cpu = 0.0
        self._busy_wall = 0.0
        self._armed = False
        self._priority = priority or _no_priority
        self._loop = loop
        # The reads that wait, (priority, arrival, future) each; those in line, let go or
        # not (a read let go resumes a turn later: until then, one that finishes waits too);
        # and whether the callback that lets them go (_next_turn) is queued.
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []
        self._in_line = 0
        self._order = itertools.count()
        self._letting_go = False

    def _polled(self) -> None:
        # Queued by call_soon during a turn: runs in the next one, right after its poll, which
        # ends the watched turn. It reads no clock: the next read that finishes marks when the
        # new turn's work began (due), and nothing reads the marks before then.
        self._armed = False

    def due(self) -> bool:
        """Whether the loop's thread has run over ``budget`` of CPU in this turn, since the
        first read that finished in it (the first call since the last poll): the caller should
        then wait for a later poll (``wait``). Called from a task of the loop."""
        if not self._armed:
            # Nothing watches this turn yet (the loop may have slept since the last mark): it
            # has been busy since now at least; the next poll marks the turn's end.
            self._armed = True
            # The loop's thread runs this, so thread_time is that thread's clock.
            self._busy_cpu = time.thread_time()
            self._busy_wall = time.perf_counter()
            asyncio.get_running_loop().call_soon(self._polled)
            return False
        # Once per read: resumed after the poll, the sample goes on. Waiting again while the
        # turn's budget is spent (by samples resumed before it) cost more CPU than it saved
        # (1,070-1,096 images/s, 1.69 ms of CPU per image against 1.53).
        # The thread's CPU clock is a system call (~0.4 us, a tenth of that for perf_counter):
        # read it only once the turn's wall time is past the budget, which its CPU time can
        # only be if its wall time is too. Most reads end in a short turn and pay no call.
        if (
            time.perf_counter() - self._busy_wall <= self.budget
            or time.thread_time() - self._busy_cpu <= self.budget
        ):
            return False
        self.pauses += 1
        return True

    def must_wait(self) -> bool:
        """Whether a read that just finished should ``wait``: its turn ran past the budget
        (``due``), or reads are in line (going past them would take their place). Called from
        a task of a running loop: on another than this one's, never."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        if self._in_line == 0 and not self.due():
            return False  # most reads: no loop looked up (that cost ~0.4 µs a read)
        # A read on another loop (a read_sync in a thread that copied the worker's context) goes
        # on; its due() at most marks the worker's turn early, as it always did.
        return asyncio.get_running_loop() is self._loop

    async def wait(self) -> None:
        """Wait for a later turn of the loop, in line by the running sample's priority.

        The next turn, after a poll, lets every read that waits go, the head batch's first,
        and they resume in that order in the turn after it: their samples' inline work runs
        in that order, and reads that finish meanwhile wait behind them. ``asyncio.sleep(0)``
        let them go in the order they came, and a worker decoding JPEGs inline from local
        files decoded the samples of three or four batches interleaved: a read handed to a
        thread (its file not in the page cache) came back two turns of 60 decodes later, at
        the back of the line, and held its batch 0.3 s (a whole pass's 3rd and 4th batches
        came after 0.8-1.1 s, against 0.5 s from torch's DataLoader).
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self._waiting.append((self._priority(), next(self._order), future))
        if not self._letting_go:
            self._letting_go = True
            loop.call_soon(self._next_turn)
        self._in_line += 1
        try:
            await future
        finally:
            self._in_line -= 1

    def _next_turn(self) -> None:
        # Queued with call_soon: runs in the next turn, after its poll. All go, not a budget's
        # worth a turn: shorter turns read fewer answers each, and that cost samples over S3
        # (bench_pipeline's JPEGs at 50 ms, 5 interleaved pairs: a median 0.86 of the rate,
        # with more CPU a sample in 4 of them).
        self._letting_go = False
        waiting, self._waiting = self._waiting, []
        waiting.sort()  # arrival numbers are unique: futures are never compared
        for _, _, future in waiting:
            if not future.done():  # not cancelled with its sample
                future.set_result(None)


turns: contextvars.ContextVar[LoopTurns | None] = contextvars.ContextVar(
    "asyncload_loop_turns", default=None
)
"""The running engine's ``LoopTurns`` (``None`` outside one)."""


def _no_priority() -> int:
    return 0


def must_wait() -> LoopTurns | None:
    """The running engine's ``LoopTurns`` if a read that just finished should wait for it
    (``await it.wait()``), else ``None``: ``LoopTurns.must_wait`` of the loop's turns, and
    ``None`` outside an engine. A check, not a coroutine: the per-sample path pays no
    coroutine where the read goes on at once."""
    current = turns.get()
    return current if current is not None and current.must_wait() else None


@contextlib.contextmanager
def using(loop_turns: LoopTurns) -> Iterator[LoopTurns]:
    """Make *loop_turns* the one reads pause with, in this context and tasks started from it."""
    token = turns.set(loop_turns)
    try:
        yield loop_turns
    finally:
        turns.reset(token)
