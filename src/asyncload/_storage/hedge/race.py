"""One round of a hedged request: the request, and copies of it while every copy straggles.

``_race`` returns the first answer and cancels the other copies; their cleanup (a response
released, a connection closed) is waited for by ``copies.drain`` before clients close. Once the
prefix's delay is known the request runs in its caller's own task and only a hedge gets a task
(``_race_in_place``); before that, every request is watched from a task of its own
(``_straggles``).

Each copy's failure is heard once, as soon as the round sees it (``_Ears``): a round may end
with another copy's answer, and a throttle it met must still reach the stats and the in-flight
limit, and hush the prefix's hedges. The retry loop judges only the failure a round ends with
(``retry.next_wait``), which the round marks as heard.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from ..backends.progress import Progress, watching
from ..retry import AttemptFailed, Hedge, hear, heard
from .copies import _cancel, _count_win, _send
from .latency import _Prefix

__all__: list[str] = []  # _race, for the package

T = TypeVar("T")

# How often a request sent before the delay was learned looks whether it is due (at least), and
# how many requests sent after it must have finished first (see _straggles).
_LEARNING_POLL = 0.02
_OVERTAKEN = 4
# _RESERVE: by its definition, one request in twenty outlives a p95 delay, mostly by a little,
# and those would spend a 5% budget whole. A request the bucket refused asks again every delay
# (tokens come back with every request), and at its first ask it leaves this many tokens in the
# bucket, at its second one fewer, and so on: the longer a request is out, the surer it is a
# straggler. The end of an epoch earns no more tokens (no more requests), and its last
# stragglers need some.
_RESERVE = 3
# Hedges one round may send: a second one when the first straggles too (see _race).
_MAX_HEDGES = 2
# Task.uncancel() (3.11) lets a round run its primary in the caller's task (_race_in_place).
_IN_PLACE = sys.version_info >= (3, 11)


class _Ears:
    """The copies of one round whose failures it heard, each once (``retry.hear``): a throttle
    told to the stats and the in-flight limit, and the prefix hushed for a retryable failure,
    as ``read`` hushes it for the failure a round ends with.

    A copy may be seen failing from several places (the wait that woke for it, a hedge's
    done callback, the round's end), so copies are heard by identity, once each; the failure
    the round raises is marked heard (``retry.heard``) for the retry loop that judges it next.
    """

    __slots__ = ("_unheard", "tracker")

    def __init__(self, tracker: _Prefix) -> None:
        self.tracker = tracker
        # The copies sent and not heard yet, with when each went out.
        self._unheard: dict[asyncio.Future[Any], float] = {}

    def sent(self, fut: asyncio.Future[T]) -> asyncio.Future[T]:
        """*fut*, a copy that went out now (``time.monotonic``: a throttle is dated by it)."""
        self._unheard[fut] = time.monotonic()
        return fut

    def copy(self, fut: asyncio.Future[Any]) -> None:
        """Hear *fut*'s failure if it is done with one and was not heard yet (a cancelled
        loser had no answer to hear)."""
        if fut not in self._unheard or not fut.done() or fut.cancelled():
            return
        exc = fut.exception()
        if isinstance(exc, AttemptFailed):
            _hear(self.tracker, exc, self._unheard.pop(fut))


def _hear(tracker: _Prefix, failure: AttemptFailed, sent: float) -> None:
    """Hear *failure* of a request sent at *sent* (``time.monotonic``) to *tracker*'s prefix: a
    throttle noted, and the prefix hushed for a retryable failure."""
    hear(failure, sent)
    if failure.retryable:
        tracker.hush(failure.retry_after or 0.0)


def _latency(watch: Progress, loop: asyncio.AbstractEventLoop) -> float | None:
    """Seconds since *watch*'s request left the pool's line; None if it never did."""
    return None if watch.waiting else loop.time() - watch.out


_STOPPED: Any = object()  # _InPlace.outcome once the round is over


async def _settles(fut: asyncio.Future[T], timeout: float) -> bool:
    """Whether *fut* is done within *timeout* seconds (it is not cancelled either way).

    ``asyncio.wait((fut,), timeout=...)`` does this on every request's path; this does it with
    one waiter, one timer and no sets (~2x cheaper).
    """
    if fut.done():
        return True
    loop = fut.get_loop()
    waiter: asyncio.Future[None] = loop.create_future()

    def wake(_: object = None) -> None:
        if not waiter.done():
            waiter.set_result(None)

    timer = loop.call_later(timeout, wake)
    fut.add_done_callback(wake)
    try:
        await waiter
    finally:
        timer.cancel()
        fut.remove_done_callback(wake)
    return fut.done()


async def _goes_quiet(primary: asyncio.Future[T], watch: Progress, seconds: float) -> bool:
    """Wait until *primary* has shown no sign of life (*watch*) for *seconds*; whether it is
    still running then."""
    loop = primary.get_loop()
    while True:
        wait = seconds - watch.quiet(loop.time())
        if wait <= 0:
            return not primary.done()
        if await _settles(primary, wait):
            return False


async def _straggles(
    primary: asyncio.Future[T], tracker: _Prefix, policy: Hedge, watch: Progress, rank: int
) -> bool:
    """For a request sent before its prefix's delay was learned: wait until *primary* is due a
    hedge; whether it is still running then.

    A fresh worker sends its first few hundred requests at once; *rank* went before this one.
    It looks again every ``min_delay`` (20 ms at least), and is due only when it is slow twice
    over: quiet for twice the delay (the first estimate comes from the fastest of that wave;
    quiet: since its connection, its headers or its body's last bytes, as *watch* tells), and
    not in a line. A request that waited in line for a connection is not timed meanwhile, and
    one in the server's line is not overtaken, so the budget goes to the wave's real
    stragglers: those that requests sent after them have overtaken (four more have finished
    than went before it), those whose response began and then stopped, and, once the wave has
    ended, those still out when no request of the prefix has finished for twice the delay (a
    line moves; the end of a wave has no later requests to overtake anything). Without this a
    straggler of the first wave, often in the first batch, would hold it its whole 0.5-2 s.
    """
    loop = asyncio.get_running_loop()
    finished, line_moved = tracker.finished, watch.moved
    while True:
        now = loop.time()
        if tracker.finished != finished:  # seen a poll late at most: the line looks busier
            finished, line_moved = tracker.finished, now
        delay = tracker.delay
        timeout = max(policy.min_delay, _LEARNING_POLL)
        if delay != float("inf"):
            due_in = 2 * delay - watch.quiet(now)
            if due_in > 0:
                timeout = due_in
            elif (
                tracker.finished - rank >= _OVERTAKEN
                or watch.served
                or (watch.sent and now - line_moved >= 2 * delay)
            ):
                return not primary.done()
        if await _settles(primary, timeout):
            return False


async def _race(
    start: Callable[[], Awaitable[T]], tracker: _Prefix, policy: Hedge, spare: int
) -> tuple[T, int]:
    """One round: the request, and hedges if it straggles. Returns (result, requests sent).

    Raises the round's ``AttemptFailed`` with ``requests`` set to the requests it used.
    """
    loop = asyncio.get_running_loop()
    began = loop.time()
    delay = tracker.delay
    rank = tracker.started  # requests of this prefix sent before this one
    tracker.started += 1
    tracker.earn(policy)
    if spare < 1:
        # Nothing to race: no task, the request runs in the caller's.
        try:
            result = await start()
        except AttemptFailed:
            tracker.observe(loop.time() - began, policy)
            raise
        tracker.observe(loop.time() - began, policy)
        return result, 1
    if _IN_PLACE and delay != float("inf"):  # the usual case
        return await _race_in_place(start, tracker, policy, spare, began)
    ears = _Ears(tracker)
    watch = Progress(began)
    token = watching.set(watch)  # the task copies this context
    try:
        primary: asyncio.Future[T] = ears.sent(asyncio.ensure_future(start()))
    finally:
        watching.reset(token)
    straggles = False
    try:
        if delay != float("inf"):  # Python 3.10: the waits in this coroutine
            straggles, asks = await _goes_quiet(primary, watch, delay), 0
        else:  # slow twice over when it returns: the whole bucket is open to it
            straggles, asks = await _straggles(primary, tracker, policy, watch, rank), _RESERVE
        # Refused: ask again a delay later (never sooner than _LEARNING_POLL: min_delay may be
        # 0), more of the bucket open each time (_RESERVE), if it is still quiet.
        while straggles and not tracker.spend(max(0, _RESERVE - asks)):
            wait = max(tracker.delay, _LEARNING_POLL)
            straggles, asks = not await _settles(primary, wait), asks + 1
            if straggles:
                straggles = await _goes_quiet(primary, watch, tracker.delay)
    except BaseException:
        if straggles:  # a straggler cancelled while it asked: its latency is at least this
            tracker.observe(_latency(watch, loop), policy)
        _cancel(primary)
        raise
    if not straggles:
        try:
            result = await primary
        except AttemptFailed as failure:
            ears.copy(primary)
            heard(failure)
            raise
        finally:
            tracker.observe(_latency(watch, loop), policy)
        return result, 1
    copies: list[asyncio.Future[T]] = [primary, ears.sent(_send(start))]
    try:
        return await _await_copies(
            start, ears, copies, 1 + min(spare, _MAX_HEDGES), loop.time(), None
        )
    finally:
        # The primary's latency is at least this long: a lower bound keeps the percentile honest.
        tracker.observe(_latency(watch, loop), policy)
        for fut in copies:
            ears.copy(fut)  # failed, and not seen by the wait that returned
            _cancel(fut)


async def _await_copies(
    start: Callable[[], Awaitable[T]],
    ears: _Ears,
    copies: list[asyncio.Future[T]],
    most: int,
    last: float,
    failure: AttemptFailed | None,
    ran_in_place: int = 0,
) -> tuple[T, int]:
    """Wait for the round's *copies*, done ones too (the first is the primary, unless it ran in
    place: ``ran_in_place=1``, and failed with *failure*); send another copy, up to *most*
    requests, when every copy out has straggled a delay since the *last* one went out."""
    loop = asyncio.get_running_loop()
    tracker = ears.tracker
    pending = set(copies)
    # A hedge straggles too, one time in a hundred: with ~40 stragglers a run, one of them in
    # three. Both copies then hold their batch until the primary answers (0.5-2 s). So a round
    # may send one more copy, a delay after the last, when the attempts and the bucket allow.
    while pending:
        timeout, delay = None, tracker.delay
        # A hedge goes out once the delay is known (_straggles), and it stays known; uvloop
        # would refuse an infinite timeout all the same.
        if len(copies) + ran_in_place < most and delay != float("inf"):
            timeout = max(last + max(delay, _LEARNING_POLL) - loop.time(), 0)
        done, pending = await asyncio.wait(
            pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
        if not done:  # every copy out still straggles: another one, if a token is left
            last = loop.time()
            if tracker.spend():
                copies.append(ears.sent(_send(start)))
                pending.add(copies[-1])
            continue
        # Several may be done in one wake-up: prefer a success, and the earlier copy.
        for fut in sorted(done, key=copies.index):
            ears.copy(fut)
            exc = fut.exception()
            if exc is None:
                if ran_in_place or fut is not copies[0]:
                    _count_win()
                return fut.result(), len(copies) + ran_in_place
            if not isinstance(exc, AttemptFailed):
                raise exc
            failure = exc
            if not exc.retryable:  # a 404 or a 403 will not change for the twin
                pending.clear()
                break
    assert failure is not None
    failure.requests = len(copies) + ran_in_place
    heard(failure)  # by ears, above, or by the primary in place
    raise failure


class _InPlace(Progress):
    """A round whose primary request runs in the caller's own task (``_race_in_place``).

    A timer sends the hedges; the first hedge to end the round (an answer, or a failure that
    another copy cannot mend) cancels the caller's task, which interrupts the primary where it
    waits, and the round then takes that hedge's outcome and uncancels the task. The round is
    its primary's ``Progress`` too (one object per request): the timer reads it when it fires.
    """

    __slots__ = (
        "asks",
        "cancelling",
        "ears",
        "hedges",
        "interrupted",
        "last",
        "most",
        "outcome",
        "start",
        "task",
        "timer",
        "tracker",
    )

    def __init__(
        self, start: Callable[[], Awaitable[Any]], tracker: _Prefix, spare: int, began: float
    ) -> None:
        super().__init__(began)
        task = asyncio.current_task()
        assert task is not None
        self.task = task
        # Cancellations the task had when the round began, caught and not withdrawn: more
        # after the round's own is withdrawn are the caller's.
        self.cancelling = 0
        if sys.version_info >= (3, 11):
            self.cancelling = task.cancelling()
        self.start, self.tracker = start, tracker
        # Made with the first hedge: most rounds send none, and the primary in place is heard
        # without it (_race_in_place).
        self.ears: _Ears | None = None
        self.most = 1 + min(spare, _MAX_HEDGES)
        self.hedges: list[asyncio.Future[Any]] = []
        self.asks = 0  # times the bucket refused the first hedge (see _RESERVE)
        self.outcome: asyncio.Future[Any] | None = None
        self.interrupted = False  # this round cancelled the caller's task
        loop = asyncio.get_running_loop()
        self.last = began  # when the last copy went out
        self.timer: asyncio.TimerHandle | None = loop.call_later(tracker.delay, self._due)

    def _due(self) -> None:
        """Every copy out has straggled a delay: send another one, if the bucket allows."""
        self.timer = None
        if self.outcome is not None:
            return
        first = not self.hedges
        tracker = self.tracker
        loop = asyncio.get_running_loop()
        # Straggled: the primary quiet for a delay (since its connection, its headers or its
        # body's last bytes: a request waiting in the pool's line, or a body that flows, is no
        # straggler), and each hedge out for one. Not yet: look again when it would be.
        now = loop.time()
        wait = max(self.last, now - self.quiet(now)) + tracker.delay - now
        if wait > 0:
            self.timer = loop.call_later(wait, self._due)
            return
        # The first hedge leaves part of the bucket to later stragglers (_RESERVE); a second
        # one takes what there is.
        if tracker.spend(max(0, _RESERVE - self.asks) if first else 0):
            if self.ears is None:
                self.ears = _Ears(tracker)
            hedge = self.ears.sent(_send(self.start))
            hedge.add_done_callback(self._hedge_done)
            self.hedges.append(hedge)
            self.last = loop.time()
        elif first:
            self.asks += 1
        else:
            self.last = loop.time()
        if not self.hedges or 1 + len(self.hedges) < self.most:
            self.timer = loop.call_later(max(tracker.delay, _LEARNING_POLL), self._due)

    def _hedge_done(self, hedge: asyncio.Future[Any]) -> None:
        assert self.ears is not None  # made with the first hedge
        self.ears.copy(hedge)
        if self.outcome is not None or hedge.cancelled():  # decided, or a loser
            return
        exc = hedge.exception()
        if isinstance(exc, AttemptFailed) and exc.retryable:
            return  # the primary or another copy may still answer
        self.outcome = hedge
        if self.task.cancel():
            self.interrupted = True

    def stop(self) -> asyncio.Future[Any] | None:
        """No more hedges or interruptions; the hedge that ended the round, if one did."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        outcome, self.outcome = self.outcome, _STOPPED
        if self.interrupted and sys.version_info >= (3, 11):
            self.interrupted = False
            self.task.uncancel()
        return outcome if outcome is not _STOPPED else None


async def _race_in_place(
    start: Callable[[], Awaitable[T]], tracker: _Prefix, policy: Hedge, spare: int, began: float
) -> tuple[T, int]:
    """``_race`` once the prefix's delay is known: the primary runs in the caller's task.

    A task of its own and a wait on it put two turns of a busy loop between the request and
    its caller (1-2 ms of a sample's ~55 at 50 ms); here only a timer does, and a hedge, one
    request in twenty at most, gets a task.
    """
    loop = asyncio.get_running_loop()
    round_ = _InPlace(start, tracker, spare, began)
    token = watching.set(round_)  # the backend reports the primary's signs of life
    try:
        try:
            result = await start()
        except asyncio.CancelledError:
            outcome = round_.stop()
            if outcome is None or (
                sys.version_info >= (3, 11) and round_.task.cancelling() > round_.cancelling
            ):
                raise  # the caller's own cancellation
        except AttemptFailed as failure:
            # Sent when the round began, on the loop's clock (uvloop's: whole ms, read once a
            # turn): converted to time.monotonic here, on failure, not read for every request.
            elapsed = loop.time() - began  # read first: the send time is not put too early
            _hear(tracker, failure, time.monotonic() - elapsed)
            outcome = round_.stop()
            if outcome is None:  # the primary failed first
                if not failure.retryable or round_.ears is None:  # no hedge went out
                    failure.requests = 1 + len(round_.hedges)
                    heard(failure)
                    raise
                # Every hedge, those done too: one may have answered in this same turn, before
                # its callback ran.
                return await _await_copies(
                    start, round_.ears, round_.hedges, round_.most, round_.last, failure, 1
                )
        except BaseException:
            round_.stop()
            raise
        else:
            round_.stop()  # a hedge may have ended the round too late: the primary won
            return result, 1 + len(round_.hedges)
        # A hedge ended the round: its answer, or the failure no other copy would mend.
        exc = outcome.exception()
        if exc is not None:
            if isinstance(exc, AttemptFailed):
                exc.requests = 1 + len(round_.hedges)
                assert round_.ears is not None  # outcome is a hedge
                round_.ears.copy(outcome)
                heard(exc)
            raise exc
        _count_win()
        return outcome.result(), 1 + len(round_.hedges)
    finally:
        watching.reset(token)
        tracker.observe(_latency(round_, loop), policy)
        if round_.ears is not None:
            for hedge in round_.hedges:
                round_.ears.copy(hedge)  # failed before the primary answered
                _cancel(hedge)
