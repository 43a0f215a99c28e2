"""A discrete-event simulator of object stores and of workers that read them, with a fake clock.

For the in-flight controller's tests (``tests/control/test_law.py``): no network, no sleeping, the
same figures on every run (seeded jitter). A ``Worker`` keeps as many requests in flight to one
store as its limiter allows and reports every answer to it; stores answer after a latency that
depends on their model:

* ``FixedLatency``: every request takes the same time (with a little jitter);
* ``TokenBucket``: a rate limit per prefix, as S3's: a request without a token is answered at
  once with a throttle (``503 SlowDown``, or ``429`` with ``Retry-After``);
* ``Queue``: a few servers with a FIFO line in front: latency grows with the load;
* ``ClientCpu``: wraps a store; each answer then costs the worker's one CPU some time, so
  throughput saturates where the worker's loop is busy all the time (and latency, measured as
  the worker sees it, grows beyond that).
"""

from __future__ import annotations

import collections
import heapq
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from asyncload._control import LimitController, Outcome

Answer = Callable[[Outcome, "float | None"], None]


class Sim:
    """The clock and the event queue."""

    def __init__(self, seed: int = 1) -> None:
        self.now = 0.0
        self.rng = random.Random(seed)
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0

    def at(self, when: float, action: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._events, (max(when, self.now), self._seq, action))

    def after(self, delay: float, action: Callable[[], None]) -> None:
        self.at(self.now + delay, action)

    def run(self, until: float) -> None:
        events = self._events
        while events and events[0][0] <= until:
            when, _, action = heapq.heappop(events)
            self.now = when
            action()
        self.now = until

    def jitter(self, value: float, share: float) -> float:
        return value * (1.0 + self.rng.uniform(-share, share)) if share else value


class Store(Protocol):
    def request(self, sim: Sim, answer: Answer) -> None: ...


@dataclass
class FixedLatency:
    latency: float = 0.05
    jitter: float = 0.1

    def request(self, sim: Sim, answer: Answer) -> None:
        sim.after(sim.jitter(self.latency, self.jitter), lambda: answer(Outcome.OK, None))


@dataclass
class TokenBucket:
    """*rate* requests per second with bursts of *burst*; the rest are throttled."""

    rate: float = 2000.0
    burst: float = 200.0
    latency: float = 0.05
    jitter: float = 0.1
    throttle_latency: float = 0.01
    retry_after: float | None = None  # a 429 with Retry-After instead of a 503 SlowDown
    tokens: float = field(init=False)
    _last: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        self.tokens = self.burst

    def request(self, sim: Sim, answer: Answer) -> None:
        self.tokens = min(self.burst, self.tokens + (sim.now - self._last) * self.rate)
        self._last = sim.now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            sim.after(sim.jitter(self.latency, self.jitter), lambda: answer(Outcome.OK, None))
        else:
            after = self.retry_after
            delay = sim.jitter(self.throttle_latency, self.jitter)
            sim.after(delay, lambda: answer(Outcome.THROTTLED, after))


@dataclass
class Queue:
    """*servers* requests served at once for *service* seconds each (exponential), behind a
    FIFO line, *latency* of network round trip around it."""

    servers: int = 16
    service: float = 0.01
    latency: float = 0.04
    busy: int = 0
    line: collections.deque[Answer] = field(default_factory=collections.deque)

    def request(self, sim: Sim, answer: Answer) -> None:
        sim.after(self.latency / 2, lambda: self._arrive(sim, answer))

    def _arrive(self, sim: Sim, answer: Answer) -> None:
        if self.busy < self.servers:
            self._serve(sim, answer)
        else:
            self.line.append(answer)

    def _serve(self, sim: Sim, answer: Answer) -> None:
        self.busy += 1

        def done() -> None:
            self.busy -= 1
            sim.after(self.latency / 2, lambda: answer(Outcome.OK, None))
            if self.line:
                self._serve(sim, self.line.popleft())

        sim.after(sim.rng.expovariate(1.0 / self.service), done)


@dataclass
class ClientCpu:
    """Each answer of *store* then takes *cost* seconds of the worker's single CPU, in order."""

    store: Store
    cost: float = 0.00025
    _free: float = 0.0

    def request(self, sim: Sim, answer: Answer) -> None:
        def arrived(outcome: Outcome, retry_after: float | None) -> None:
            self._free = max(sim.now, self._free) + self.cost
            sim.at(self._free, lambda: answer(outcome, retry_after))

        self.store.request(sim, arrived)


class Limiter(Protocol):
    @property
    def limit(self) -> int: ...

    @property
    def in_flight(self) -> int: ...

    def started(self, now: float) -> None: ...

    def finished(
        self, now: float, outcome: Outcome, latency: float, retry_after: float | None = None
    ) -> None: ...


class Fixed:
    """A fixed ``max_concurrency``, for the sweeps the controller is measured against."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0

    def started(self, now: float) -> None:
        self.in_flight += 1

    def finished(
        self, now: float, outcome: Outcome, latency: float, retry_after: float | None = None
    ) -> None:
        self.in_flight -= 1


class Leaving:
    """A worker's limiter that stops sending once ``gone`` is set (its reader finished): the
    requests it has in flight are still answered."""

    def __init__(self, limiter: Limiter) -> None:
        self.limiter = limiter
        self.gone = False

    @property
    def limit(self) -> int:
        return 0 if self.gone else self.limiter.limit

    @property
    def in_flight(self) -> int:
        return self.limiter.in_flight

    def started(self, now: float) -> None:
        self.limiter.started(now)

    def finished(
        self, now: float, outcome: Outcome, latency: float, retry_after: float | None = None
    ) -> None:
        self.limiter.finished(now, outcome, latency, retry_after)


@dataclass
class Record:
    """What one worker saw: every answer and its limit over time."""

    answers: list[tuple[float, Outcome, float]] = field(default_factory=list)
    limits: list[tuple[float, int]] = field(default_factory=list)
    peak: int = 0  # most requests in flight at once
    over_limit: int = 0  # times more were in flight than the limit allowed when one started


class Worker:
    """Keeps its limiter's limit of requests in flight to *store*, for ever."""

    def __init__(self, sim: Sim, store: Store, limiter: Limiter) -> None:
        self.sim, self.store, self.limiter = sim, store, limiter
        self.record = Record()

    def start(self) -> None:
        self.sim.after(0.0, self._fill)

    def _fill(self) -> None:
        lim = self.limiter
        while lim.in_flight < lim.limit:
            self._send()

    def _send(self) -> None:
        sim, lim = self.sim, self.limiter
        sent = sim.now
        lim.started(sent)
        if lim.in_flight > lim.limit:
            self.record.over_limit += 1
        self.record.peak = max(self.record.peak, lim.in_flight)

        def answer(outcome: Outcome, retry_after: float | None) -> None:
            latency = sim.now - sent
            self.record.answers.append((sim.now, outcome, latency))
            lim.finished(sim.now, outcome, latency, retry_after)
            self._fill()

        self.store.request(sim, answer)


@dataclass
class Figures:
    """Figures of some workers over a window of simulated time."""

    goodput: float  # successful answers per second, all workers together
    throttled: float  # share of answers that were throttles
    p99: float  # 99th percentile latency of successful answers, seconds
    peak: int  # most requests in flight at once, all workers together (upper bound)

    def __str__(self) -> str:
        return (
            f"goodput {self.goodput:,.0f}/s, throttled {self.throttled:.2%}, "
            f"p99 {self.p99 * 1000:.1f} ms, peak {self.peak}"
        )


def figures(workers: Sequence[Worker], start: float, end: float) -> Figures:
    answers = [a for w in workers for a in w.record.answers if start <= a[0] < end]
    ok = sorted(lat for _, outcome, lat in answers if outcome is Outcome.OK)
    throttled = sum(1 for _, outcome, _ in answers if outcome is Outcome.THROTTLED)
    p99 = ok[min(len(ok) - 1, math.ceil(0.99 * len(ok)) - 1)] if ok else math.inf
    return Figures(
        goodput=len(ok) / (end - start),
        throttled=throttled / max(1, len(answers)),
        p99=p99,
        peak=sum(w.record.peak for w in workers),
    )


def goodput_series(workers: Sequence[Worker], end: float, step: float = 0.1) -> list[float]:
    """Successful answers per second in each *step* of time, all workers together."""
    counts = [0] * math.ceil(end / step)
    for w in workers:
        for when, outcome, _ in w.record.answers:
            if outcome is Outcome.OK and when < end:
                counts[int(when / step)] += 1
    return [c / step for c in counts]


def simulate(
    store: Store,
    limiters: Sequence[Limiter],
    duration: float,
    *,
    seed: int = 1,
    every: float = 0.05,
    each: Callable[[Sim, list[Worker]], None] | None = None,
) -> list[Worker]:
    """Run workers with *limiters* on one store for *duration* simulated seconds.

    *each*, if given, is called every *every* seconds (to change the store, share states,
    record limits).
    """
    sim = Sim(seed)
    workers = [Worker(sim, store, lim) for lim in limiters]
    for w in workers:
        w.start()

    def tick() -> None:
        for w in workers:
            w.record.limits.append((sim.now, w.limiter.limit))
        if each is not None:
            each(sim, workers)
        sim.after(every, tick)

    sim.at(0.0, tick)
    sim.run(duration)
    return workers


def best_fixed(
    make_store: Callable[[], Store],
    duration: float,
    start: float,
    values: Sequence[int] = (4, 8, 16, 32, 64, 128, 256, 512),
    workers: int = 1,
) -> tuple[int, Figures, dict[int, Figures]]:
    """The sweep of fixed limits: the best value, its figures, and everyone's."""
    sweep = {}
    for n in values:
        ws = simulate(make_store(), [Fixed(n) for _ in range(workers)], duration)
        sweep[n] = figures(ws, start, duration)
    best = max(sweep, key=lambda n: sweep[n].goodput)
    return best, sweep[best], sweep


def controller(**kwargs: object) -> LimitController:
    return LimitController(now=0.0, **kwargs)  # type: ignore[arg-type]
