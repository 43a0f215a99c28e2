"""What goes into a ``LimitController`` and what comes out of it, as plain values.

Into it: ``Outcome`` (what one answer says) and ``ControlConfig`` (the control law's constants).
Out of it: ``LimitState`` (what it learned about the store, which travels from the workers to
the main process and on to other controllers) and ``LimitStats`` (its figures, for
``loader.stats()`` and the bench). The law itself, which reads and makes these, is ``law``'s.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["ControlConfig", "LimitState", "LimitStats", "Outcome"]


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
    rise: float = 1.2
    """In slow start, an epoch whose fastest answer took this multiple of the last epoch's
    fastest means the last doubling bought a queue (HyStart++'s delay rule): slow start ends,
    and the limit goes back to where it was. Fastest to fastest compares like with like: a
    pass's first answers find the store idle, whatever the load of the rest. HyStart++'s
    own threshold (+1/8) stopped the 50 ms store of ``bench_autotune`` (a) early, whose
    fastest moved by up to 1.14x from one doubling to the next; 1.5 let its (d) store
    double past the knee, where the fastest rose 1.24-1.25x."""
    rise_samples: int = 8
    """Answers an epoch needs before ``rise`` is judged (HyStart++'s N_RTT_SAMPLE)."""
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
    risen: the throttled limit is forgotten (no cubic curve, no fast convergence toward it)."""
    convex_step: float = 1.25
    """Most the recovery curve's convex part multiplies the limit by in one epoch. Its clock
    runs in wall time, also while the worker reads nothing (a pause for evaluation) or less
    than half its limit: after a pause of 5 s, the first epoch jumped toward 37 times the
    throttled limit (clamped at max_limit), and 61% of the next second's requests were
    throttled (simulated, 3 seeds; 3.3-3.7% with this step). Where epochs last 0.25 s or more
    (stores of ~150 ms and slower) it binds without a pause too: the limit then passes 1.5
    times the throttled limit at most one epoch later than the curve would take it there."""
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
    probe_limit: int = 8
    """Requests in flight while the unloaded latency is measured again (a probe, as BBR's
    PROBE_RTT): when a pass started above this, its first latencies were taken under load."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_limit <= self.initial <= self.max_limit:
            raise ValueError("ControlConfig needs 1 <= min_limit <= initial <= max_limit")
        if not (self.slow_start > 1 and self.growth > 0 and 1 <= self.low < self.high):
            raise ValueError("ControlConfig needs slow_start > 1, growth > 0, 1 <= low < high")
        if not (self.rise > 1 and self.rise_samples >= 1):
            raise ValueError("ControlConfig needs rise > 1 and rise_samples >= 1")
        if not (0 < self.backoff < 1 and self.recovery > 0 and self.convex_step >= 1):
            raise ValueError(
                "ControlConfig needs 0 < backoff < 1, recovery > 0 and convex_step >= 1"
            )


@dataclass(frozen=True, slots=True)
class LimitState:
    """What a controller learned about the store, to start or steer another one with.

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
    base_at: float | None = None
    """When ``base_latency`` was measured, so that a peer forgets it as its measurer would."""

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
        bases = [(s.base_latency, s.base_at) for s in states if s.base_latency is not None]
        ceilings = [(s.ceiling, s.workers) for s in states if s.ceiling is not None]
        throttles = [s.throttled_at for s in states if s.throttled_at is not None]
        ceiling = (
            sum(c * w for c, w in ceilings) / sum(w for _, w in ceilings) if ceilings else None
        )
        base, base_at = min(bases, key=lambda b: b[0]) if bases else (None, None)
        return LimitState(
            limit=limit,
            base_latency=base,
            ceiling=ceiling,
            throttled_at=max(throttles) if throttles else None,
            workers=workers,
            base_at=base_at,
        )

    def for_workers(self, workers: int) -> LimitState:
        """The per-worker share when the same store is read by *workers* workers instead.

        What the store allows is for all the workers together, so the share scales inversely.
        """
        scale = self.workers / max(1, workers)
        return LimitState(
            limit=self.limit * scale,
            base_latency=self.base_latency,
            ceiling=None if self.ceiling is None else self.ceiling * scale,
            throttled_at=self.throttled_at,
            workers=workers,
            base_at=self.base_at,
        )


@dataclass(frozen=True, slots=True)
class LimitStats:
    """A controller's figures at one moment, for ``loader.stats()`` and the bench.

    Examples:
        >>> from asyncload._control.law import LimitController
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
    """Whether the worker's own CPU (its loop or its CPU lane) was last seen to bound it."""
