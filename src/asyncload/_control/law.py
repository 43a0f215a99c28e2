"""How many requests one worker keeps in flight to one storage prefix, found while reading.

A fixed ``max_concurrency`` is wrong somewhere: too low on a slow store, too high where the
worker's CPU is the bottleneck, fatal where the store throttles (issue #33: two loaders of two
workers at 128 each drove a 2,000 GETs/s store to 37% ``503 SlowDown`` and both died). Here the
limit is found per worker and per prefix, from what the answers say.

The control law (``LimitController``), once per epoch (the answers to requests sent since the
last decision: at least 16, at most 64, so about one round trip):

* **Slow start.** From ``initial`` (8), double per epoch while nothing pushes back.
* **Latency, as TCP Vegas.** The epoch's median latency over the unloaded one (the least epoch
  median of the last 10 s) gives our requests waiting, ``queued = limit * (1 - base/median)``.
  Over ``high`` (1.4) with more than 4 waiting: latency rose without goodput (by Little's law
  goodput is limit / latency), so shrink toward the band's middle in one step, at most by half,
  as Netflix's Gradient2 does. Under ``low`` (1.1), or fewer than 4 waiting: grow 10%. Between:
  hold. Noise is not a queue: the log-latency spread (from the interquartile range) widens the
  band by two standard errors of a median and lifts the least median by two, since a minimum of
  many noisy medians sits that far below the true one. Three backoffs that left latency as it
  was mean the store itself got slower: its latency now becomes the unloaded one.
* **Throttles, as TCP CUBIC.** A ``503 SlowDown``, ``429`` or ``Retry-After`` cuts the limit to
  0.8 of it at once, once per overload (answers to requests sent before the cut do not cut
  again). The limit then follows CUBIC's curve: concave back to the throttled limit in 0.75 s,
  flat around it, convex beyond; 1.5 times past it with no throttle, the allowance rose and
  growth goes back to 10% per epoch. ``Retry-After`` freezes growth for as long as the server
  asked (the request itself waits in the retry path). Throttled below the last ceiling, the
  ceiling drops to the middle (CUBIC's fast convergence), so workers sharing a store even out.
* **Caps and signals.** An explicit ``max_concurrency`` bounds every value the limit takes. While
  the CPU lane reports that it is the bottleneck (``cpu_bound``), the limit shrinks by 10% per
  epoch and does not grow. Other failures (500s, resets, timeouts) neither count as goodput nor
  cut, and their latencies are not samples.
* **Sharing.** ``export`` gives a frozen ``LimitState`` (limit, unloaded latency, throttled
  limit and when); ``LimitState.combine`` merges the workers' states in the main process;
  a new controller started from it skips the slow start, and ``merge`` during a pass takes a
  throttle another worker saw as its own and moves halfway to the others' limit.

Figures (``tests/test_concurrency.py``'s stores, simulated, one worker unless said):

* (a) 50 ms and 0.25 ms of worker CPU per answer (4,000/s from ~200 in flight): 1.000 of the
  best fixed value (256) of a sweep 4-512, p99 69 ms against 55 ms unloaded, limit 256 within
  0.4 s.
* (b) token bucket 2,000/s, burst 200, ``503 SlowDown``: one worker 0.971 of the rate with
  0.56% of answers throttled (its sawtooth dips to 0.82 of the rate for a second at worst);
  four workers that know nothing of each other 1.001 and 0.48%; four with ``429`` and
  ``Retry-After: 1`` 0.991 and 0.62%.
* (c) 16/4/32 servers of 10/20/40 ms (exponential) behind a line: 0.991/1.003/0.947 of the
  sweep's best, p99 1.23/1.44/1.18 x unloaded.
* (d) a burst of throttles cuts the limit to <= 0.8 of it; goodput is back to >= 0.9 within 3 s.
* (e) two workers sharing states twice a second on (b)'s store: 0.967 of the rate together,
  0.92% throttled, 1,000/s and 935/s each.
* (g) the store's rate changed at 5 s, time until every 1 s window has >= 0.9 of the new rate
  and <= 5% throttled: 2,000->1,000 0.1 s, 1,000->2,000 2.1 s, 2,000->500 0.7 s,
  500->3,000 2.2 s.

Tried and dropped, on the same stores: a cut to 0.7 with 1 s of recovery (one worker 0.93-0.99
of the rate, and 5-6 s to converge after a change, against 3 s); one cut per round trip
instead of per overload (2,000->500 took 4.0-5.7 s); cutting from the delivered rate times
latency, as BBR estimates (0.76 of the rate at 200 ms, 0.91 after 500->3,000); Vegas with the
plain least latency as the base (collapsed to 1 in flight on a log-normal store, sigma 0.5:
0.004 of the best; 0.13 behind a line of 4 exponential servers). Pure AIMD (+1 per round trip)
was not simulated: at 50 ms it needs ~2 s per 40 requests in flight, where growth after a
change of 2x must take under 3 s. Not covered: a store at 500 ms that throttles synchronized
bursts (0.56 of the rate; pacing the sends would help).

Where it runs: ``_engine/slots.py`` sizes a worker's fetch slots with it (one controller per
worker, each sample one request; a storage attempt's throttle reaches it through
``_stats.note_throttle``); ``limiter.py`` has the asyncio semaphore built on it.
"""

from __future__ import annotations

import collections
import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["ControlConfig", "LimitController", "LimitState", "LimitStats", "Outcome"]


class Outcome(enum.Enum):
    """What one request's answer tells the controller.

    Examples:
        >>> Outcome.THROTTLED.value
        'throttled'
    """

    OK = "ok"
    """A response that counts as goodput; its latency is a sample of the store's."""
    THROTTLED = "throttled"
    """``503 SlowDown``, ``429``, or any answer with ``Retry-After``: the store says too many."""
    FAILED = "failed"
    """Any other failure (a 500, a reset, a timeout): neither goodput nor a throttle."""


@dataclass(frozen=True, slots=True)
class ControlConfig:
    """The constants of the control law; the defaults are the ones the simulations chose.

    Examples:
        >>> ControlConfig().initial
        8
        >>> ControlConfig(initial=0)
        Traceback (most recent call last):
        ...
        ValueError: ControlConfig needs 1 <= min_limit <= initial <= max_limit
    """

    initial: int = 8
    """Requests in flight before anything is known: few enough that a store which throttles at
    once, or a client with little memory, is not flooded by a loader's first round trip."""
    min_limit: int = 1
    """The controller never goes below this (one request in flight always makes progress)."""
    max_limit: int = 1024
    """The automatic mode's own ceiling, where the user gave no cap."""
    slow_start: float = 2.0
    """Growth per round trip while nothing has pushed back yet (TCP's slow start)."""
    growth: float = 0.1
    """Growth per round trip afterwards, as a share of the limit (at least one request)."""
    low: float = 1.1
    """Latency (an epoch's median over the unloaded median) under which there is no queue."""
    high: float = 1.4
    """Latency ratio over which requests queue for no gain: the limit shrinks back."""
    backoff: float = 0.8
    """The limit after a throttle, as a share of the limit before it."""
    recovery: float = 0.75
    """Seconds a cut takes to grow back to the limit that was throttled (CUBIC's K)."""
    probe: float = 1.5
    """Past this multiple of the throttled limit with no throttle, the store's allowance has
    risen: the cubic curve gives way to ``growth`` per round trip."""
    base_window: float = 10.0
    """Seconds an unloaded latency is remembered (a store's latency can change)."""
    min_samples: int = 16
    """Answers an epoch needs at least (two round trips at a limit of 8): with fewer, one
    slow answer moves the median."""
    max_samples: int = 64
    """Answers an epoch needs at most; under it, as many as the limit (one round trip)."""
    queue_floor: float = 4.0
    """Requests of ours that may wait in a queue before latency says back off: under it the
    rise is noise or not ours (at a limit of 2, latency cannot tell a queue of ours)."""
    rebase_after: int = 3
    """Backoffs in a row that left latency as it was: the store itself got slower, and its
    latency now is the new unloaded one."""
    max_hold: float = 30.0
    """Longest ``Retry-After`` that freezes growth (the retry path decides about the request)."""
    cpu_backoff: float = 0.9
    """The limit per round trip while the CPU lane is the bottleneck, as a share."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_limit <= self.initial <= self.max_limit:
            raise ValueError("ControlConfig needs 1 <= min_limit <= initial <= max_limit")
        if not (self.slow_start > 1 and self.growth > 0 and 1 <= self.low < self.high):
            raise ValueError("ControlConfig needs slow_start > 1, growth > 0, 1 <= low < high")
        if not (0 < self.backoff < 1 and 0 < self.cpu_backoff < 1 and self.recovery > 0):
            raise ValueError("ControlConfig needs 0 < backoff, cpu_backoff < 1 and recovery > 0")


@dataclass(frozen=True, slots=True)
class LimitState:
    """What a controller learned about a prefix, to start or steer another one with.

    A worker exports it (``LimitController.export``), the main process combines its workers'
    (``combine``) and hands the result to the next pass's workers (``LimitController(...,
    learned=...)``) or to the others of this pass (``LimitController.merge``). Times are on the
    clock every controller of the loader reads (``time.monotonic``, the same in all processes
    of one machine).

    Examples:
        >>> a = LimitState(limit=40.0, base_latency=0.05, ceiling=50.0, throttled_at=3.0)
        >>> b = LimitState(limit=60.0, base_latency=0.04)
        >>> both = LimitState.combine([a, b])
        >>> both.limit, both.base_latency, both.throttled_at, both.workers
        (50.0, 0.04, 3.0, 2)
        >>> both.for_workers(4).limit
        25.0
    """

    limit: float
    """The requests in flight one worker had (the mean over ``workers`` workers)."""
    base_latency: float | None = None
    """The unloaded latency (median of a quiet round trip), seconds; ``None`` if unknown."""
    ceiling: float | None = None
    """The per-worker limit at which the store last throttled, if it has."""
    throttled_at: float | None = None
    """When the store last throttled one of these workers."""
    workers: int = 1
    """How many workers' states this one summarises."""

    @staticmethod
    def combine(states: Iterable[LimitState]) -> LimitState:
        """One state for many workers: their mean limit, the lowest latency, the last throttle.

        Raises:
            ValueError: *states* is empty.
        """
        states = list(states)
        if not states:
            raise ValueError("LimitState.combine needs at least one state")
        workers = sum(s.workers for s in states)
        # Weighted by workers so that combining combined states gives the same mean.
        limit = sum(s.limit * s.workers for s in states) / workers
        bases = [s.base_latency for s in states if s.base_latency is not None]
        ceilings = [(s.ceiling, s.workers) for s in states if s.ceiling is not None]
        throttles = [s.throttled_at for s in states if s.throttled_at is not None]
        ceiling = (
            sum(c * w for c, w in ceilings) / sum(w for _, w in ceilings) if ceilings else None
        )
        return LimitState(
            limit=limit,
            base_latency=min(bases) if bases else None,
            ceiling=ceiling,
            throttled_at=max(throttles) if throttles else None,
            workers=workers,
        )

    def for_workers(self, workers: int) -> LimitState:
        """The per-worker share when the same prefix is read by *workers* workers instead.

        What the store allows is for all the workers together, so the share scales inversely.
        """
        scale = self.workers / max(1, workers)
        return LimitState(
            limit=self.limit * scale,
            base_latency=self.base_latency,
            ceiling=None if self.ceiling is None else self.ceiling * scale,
            throttled_at=self.throttled_at,
            workers=workers,
        )


@dataclass(frozen=True, slots=True)
class LimitStats:
    """A controller's figures at one moment, for ``loader.stats()`` and the bench.

    Examples:
        >>> LimitController(now=0.0).stats().phase
        'slow start'
    """

    limit: int
    """Requests allowed in flight now."""
    in_flight: int
    """Requests in flight now."""
    peak_in_flight: int
    """The most requests in flight at once so far."""
    requests: int
    """Requests answered so far, whatever the outcome."""
    throttled: int
    """Throttled answers so far (503 SlowDown, 429, Retry-After)."""
    failed: int
    """Other failures so far."""
    cuts: int
    """Times the limit was cut for a throttle."""
    backoffs: int
    """Times the limit shrank for latency (requests queued for no gain) or for the CPU lane."""
    base_latency: float | None
    """The unloaded latency, seconds."""
    latency: float | None
    """The smoothed median latency of recent round trips, seconds."""
    phase: str
    """``"slow start"``, ``"steady"``, ``"recovering"`` (after a throttle) or ``"held"``
    (``Retry-After`` pending)."""
    cpu_bound: bool
    """Whether the CPU lane is reported as the bottleneck."""


class LimitController:
    """The in-flight limit of one worker for one storage prefix: pure, with the clock passed in.

    The caller reports each request's start (``started``) and answer (``finished``) with the
    time; the controller never sleeps, reads a clock, or does I/O, so it runs the same under
    a simulator as in a worker's event loop. ``limit`` is how many may be in flight now.

    Args:
        config: The control law's constants.
        cap: An explicit ``max_concurrency``: the limit never exceeds it.
        learned: What earlier workers learned about this prefix (a pass's configuration):
            start there instead of from ``config.initial``, without a slow start.
        now: The current time.

    Examples:
        >>> c = LimitController(now=0.0)
        >>> c.limit
        8
        >>> for t in (0.0, 0.05):  # two round trips of 8 requests: one epoch
        ...     for _ in range(8):
        ...         c.started(t)
        ...     for _ in range(8):
        ...         c.finished(t + 0.05, Outcome.OK, latency=0.05)
        >>> c.limit  # nothing pushed back: slow start doubles it
        16
        >>> c.started(0.1)
        >>> c.finished(0.11, Outcome.THROTTLED, latency=0.01)
        >>> c.limit  # cut at once, to 0.8 of it
        12
        >>> LimitController(cap=4, now=0.0).limit
        4
    """

    def __init__(
        self,
        config: ControlConfig | None = None,
        *,
        cap: int | None = None,
        learned: LimitState | None = None,
        now: float = 0.0,
    ) -> None:
        self.config = config = config or ControlConfig()
        if cap is not None and cap < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {cap}")
        self.cap = cap
        self._max = float(min(cap, config.max_limit) if cap is not None else config.max_limit)
        self._min = float(min(config.min_limit, self._max))
        self._limit = float(config.initial)
        self._slow_start = True
        # The limit at the last throttle (CUBIC's W_max) and when the cut was made; while set,
        # growth follows the cubic curve back to it and then probes beyond it.
        self._ceiling: float | None = None
        self._cut_at = -math.inf
        self._quiet_until = -math.inf
        self._throttled_at: float | None = None
        self._hold_until = -math.inf
        self._cpu_bound = False
        # Unloaded latency: the lowest epoch median over base_window seconds, kept as a
        # monotonic deque of (time, median, answers) so that the minimum is its first entry.
        self._medians: collections.deque[tuple[float, float, int]] = collections.deque()
        self._srtt: float | None = None
        self._streak = 0
        self._streak_latency = 0.0
        # The spread of log-latency (its standard deviation, from the interquartile range):
        # how much medians vary by chance, so that noise is not read as a queue.
        self._spread = 0.0
        self._in_flight = 0
        self._peak = 0
        self._epoch_peak = 0
        self._epoch_start = now
        self._epoch_latencies: list[float] = []
        self._requests = self._throttled = self._failed = self._cuts = self._backoffs = 0
        if learned is not None:
            self._adopt(learned, now)
        self._limit = self._clamp(self._limit)

    # ── what the caller reports ──────────────────────────────────────────────────────────────

    @property
    def limit(self) -> int:
        """Requests that may be in flight now (at least one)."""
        return max(1, int(self._limit))

    @property
    def in_flight(self) -> int:
        """Requests started and not yet finished."""
        return self._in_flight

    def started(self, now: float) -> None:
        """A request was sent at *now* (the caller checked ``in_flight < limit``)."""
        self._in_flight += 1
        self._peak = max(self._peak, self._in_flight)
        self._epoch_peak = max(self._epoch_peak, self._in_flight)

    def finished(
        self,
        now: float,
        outcome: Outcome,
        latency: float,
        retry_after: float | None = None,
    ) -> None:
        """A request sent *latency* seconds before *now* was answered with *outcome*.

        Args:
            now: The time of the answer.
            outcome: What the answer says (see ``Outcome``).
            latency: Seconds from the request's start to its answer.
            retry_after: The server's ``Retry-After`` in seconds, if it sent one; such an
                answer counts as a throttle whatever its status.
        """
        self._in_flight = max(0, self._in_flight - 1)
        self._requests += 1
        if outcome is Outcome.THROTTLED or retry_after is not None:
            self._throttled += 1
            self._throttle(now, now - latency, retry_after)
            return
        if outcome is Outcome.FAILED:
            # A failure says nothing about queueing; its latency (often a timeout) would
            # poison the median.
            self._failed += 1
            return
        if now - latency < self._epoch_start:
            # Sent before this epoch, under the limit before: its latency tells about that
            # one (Vegas measures each window with its own requests).
            return
        self._epoch_latencies.append(latency)
        cfg = self.config
        needed = min(cfg.max_samples, max(cfg.min_samples, int(self._limit)))
        if len(self._epoch_latencies) >= needed:
            self._end_epoch(now)

    def returned(self) -> None:
        """A slot ``started`` but never used (nothing was sent, or it was cancelled before an
        answer): it is free again, and there is no answer to learn from."""
        self._in_flight = max(0, self._in_flight - 1)

    def throttled(self, now: float, sent: float, retry_after: float | None = None) -> None:
        """A request sent at *sent* was told "too many" at *now* and is being retried: it
        stays in flight (its final answer comes through ``finished``), but the limit is cut
        now, as for a ``THROTTLED`` answer."""
        self._throttled += 1
        self._throttle(now, sent, retry_after)

    def cpu_bound(self, now: float, bound: bool) -> None:
        """Whether the CPU lane (decoding, collating) is what limits the worker now.

        While it is, more requests in flight only hold more memory and contend for the loop:
        the limit shrinks by ``cpu_backoff`` per round trip and does not grow.
        """
        self._cpu_bound = bound

    # ── sharing ─────────────────────────────────────────────────────────────────────────────

    def export(self) -> LimitState:
        """What this controller learned, for the main process to pass on."""
        return LimitState(
            limit=self._limit,
            base_latency=self._base(),
            ceiling=self._ceiling,
            throttled_at=self._throttled_at,
        )

    def merge(self, state: LimitState, now: float) -> None:
        """Take in what the loader's other workers learned of the same prefix during a pass.

        They read the same store, so a throttle one of them saw and this one has not answered
        yet is this one's too: cut. Otherwise move halfway to their limit, so that workers
        sharing a store's allowance converge to equal shares.
        """
        if state.base_latency is not None:
            self._note_median(now, state.base_latency, self.config.max_samples)
        if state.throttled_at is not None and state.throttled_at > self._cut_at:
            self._throttled_at = max(self._throttled_at or -math.inf, state.throttled_at)
            self._cut(now)
            return
        if not self._slow_start:
            self._limit = self._clamp((self._limit + state.limit) / 2)

    # ── figures ─────────────────────────────────────────────────────────────────────────────

    def stats(self, now: float | None = None) -> LimitStats:
        """The controller's figures; *now* tells whether a ``Retry-After`` is still pending."""
        if now is not None and now < self._hold_until:
            phase = "held"
        elif self._slow_start:
            phase = "slow start"
        elif self._ceiling is not None:
            phase = "recovering"
        else:
            phase = "steady"
        return LimitStats(
            limit=self.limit,
            in_flight=self._in_flight,
            peak_in_flight=self._peak,
            requests=self._requests,
            throttled=self._throttled,
            failed=self._failed,
            cuts=self._cuts,
            backoffs=self._backoffs,
            base_latency=self._base(),
            latency=self._srtt,
            phase=phase,
            cpu_bound=self._cpu_bound,
        )

    # ── the control law ─────────────────────────────────────────────────────────────────────

    def _clamp(self, limit: float) -> float:
        return min(self._max, max(self._min, limit))

    def _base(self) -> float | None:
        return self._medians[0][1] if self._medians else None

    def _note_median(self, now: float, median: float, answers: int) -> None:
        window = self._medians
        while window and window[-1][1] >= median:
            window.pop()
        window.append((now, median, answers))
        while window[0][0] < now - self.config.base_window:
            window.popleft()

    def _adopt(self, learned: LimitState, now: float) -> None:
        self._limit = learned.limit
        # Start where the others got to: no slow start (its overshoot is what throttles).
        self._slow_start = False
        if learned.base_latency is not None:
            self._note_median(now, learned.base_latency, self.config.max_samples)
        if learned.ceiling is not None:
            # On the cubic curve's plateau: probe gently past the known ceiling.
            self._ceiling = learned.ceiling
            self._cut_at = now - self.config.recovery
        self._throttled_at = learned.throttled_at

    def _throttle(self, now: float, sent: float, retry_after: float | None) -> None:
        self._throttled_at = now
        if retry_after is not None:
            # Growth waits for the server's time; the request itself waits in the retry path.
            self._hold_until = max(self._hold_until, now + min(retry_after, self.config.max_hold))
        if sent < self._quiet_until:
            # Sent before the last cut, or in the round trip after it while the requests of
            # before were still being answered (and new ones sent as fast): the cut already
            # answers this overload. One cut per round trip, as CUBIC does, or a burst of
            # throttles would cut to 1.
            return
        self._cut(now)

    def _cut(self, now: float) -> None:
        cfg = self.config
        limit = self._limit
        # CUBIC's fast convergence: throttled below the last ceiling means others took part of
        # the store's allowance; aim lower so that they can keep it.
        if self._ceiling is not None and limit < self._ceiling:
            self._ceiling = limit * (1 + cfg.backoff) / 2
        else:
            self._ceiling = limit
        self._limit = self._clamp(limit * cfg.backoff)
        self._cut_at = now
        self._quiet_until = now  # answers to requests sent before the cut do not cut again
        self._slow_start = False
        self._cuts += 1
        self._new_epoch(now)

    def _cubic(self, now: float) -> float:
        assert self._ceiling is not None
        cfg = self.config
        x = (now - self._cut_at) / cfg.recovery - 1.0
        # Concave back to the ceiling over `recovery` seconds, flat around it, convex beyond.
        return self._ceiling * (1.0 + (1.0 - cfg.backoff) * x**3)

    def _new_epoch(self, now: float) -> None:
        self._epoch_start = now
        self._epoch_latencies.clear()
        self._epoch_peak = self._in_flight

    def _end_epoch(self, now: float) -> None:
        cfg = self.config
        latencies = sorted(self._epoch_latencies)
        n = len(latencies)
        median = latencies[n // 2]
        q1, q3 = latencies[n // 4], latencies[(3 * n) // 4]
        if q1 > 0:
            spread = math.log(q3 / q1) / 1.349  # a normal's IQR is 1.349 sigma
            self._spread = spread if self._srtt is None else 0.8 * self._spread + 0.2 * spread
        self._srtt = median if self._srtt is None else 0.75 * self._srtt + 0.25 * median
        self._note_median(now, median, n)
        base, base_answers = self._medians[0][1:]
        # A median of n has a standard error of 1.25 sigma / sqrt(n) (in log terms). The base
        # is the least of many such medians, so it sits about two errors below the true one:
        # lift it by that, and ask a queue to show more than two errors above the band.
        error = 1.25 * self._spread
        base *= math.exp(2.0 * error / math.sqrt(base_answers))
        high = cfg.high * math.exp(2.0 * error / math.sqrt(n))
        ratio = median / base if base > 0 else 1.0
        # Our requests waiting, by Little's law (Vegas's "diff"): the limit times the share of
        # the latency that is above the unloaded one.
        queued = self._limit * (1.0 - 1.0 / ratio) if ratio > 1 else 0.0
        # Whether the limit was what held the worker back: if it never filled it, the demand
        # (the sampler, the CPU lane) did, and a larger limit would be untested.
        used = self._epoch_peak >= 0.5 * self._limit
        limit = self._limit
        if self._cpu_bound:
            limit *= cfg.cpu_backoff
            self._backoffs += 1
        elif ratio > high and queued > cfg.queue_floor:
            # Requests queue (at the store or in this worker's loop) and the queue is what the
            # extra ones bought: shrink toward the middle of the band in one step, at most by
            # half, as Gradient2 does.
            limit *= max(0.5, (cfg.low + high) / 2 / ratio)
            self._slow_start = False
            self._backoffs += 1
            # A queue, not the store's rate, is the constraint now: the cubic curve's target
            # is stale.
            self._ceiling = None
            if self._streak == 0:
                self._streak_latency = median
            self._streak += 1
            if self._streak >= cfg.rebase_after and median >= 0.9 * self._streak_latency:
                # Shrinking did not bring latency down: not our queue but a slower store (or
                # a base that noise made too low). Latency now is the unloaded one.
                self._medians.clear()
                self._note_median(now, median, n)
                self._streak = 0
            self._limit = self._clamp(limit)
            self._new_epoch(now)
            return
        elif now < self._hold_until or not used:
            pass
        elif self._ceiling is not None:
            if ratio < cfg.low or queued < cfg.queue_floor or now - self._cut_at < cfg.recovery:
                limit = max(limit, self._cubic(now))
            if limit >= cfg.probe * self._ceiling:
                # Well past what was throttled and no throttle since: the allowance rose.
                self._ceiling = None
        elif ratio < cfg.low or queued < cfg.queue_floor:
            grow = cfg.slow_start - 1 if self._slow_start else cfg.growth
            limit += max(1.0, limit * grow)
        else:
            # Latency has started to rise: the knee. Hold here; slow start is over.
            self._slow_start = False
        self._streak = 0
        self._limit = self._clamp(limit)
        self._new_epoch(now)
