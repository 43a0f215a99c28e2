"""How many requests one worker keeps in flight, found while reading.

A fixed ``max_concurrency`` is wrong somewhere: too low on a slow store, too high where the
worker's CPU is the bottleneck, fatal where the store throttles (issue #33: two loaders of two
workers at 128 each drove a 2,000 GETs/s store to 37% ``503 SlowDown`` and both died). Here the
limit is found per worker, from what the answers say.

One limit per worker, not one per storage prefix: a worker's samples come in the sampler's
order, and a dataset that reads several prefixes (a ``Mix``, an image and its label from two
stores) needs them in fixed proportions. The slowest prefix then bounds the rate of all of
them, whatever each one's limit. A throttle from one prefix cuts the worker's limit, and by
Little's law every prefix's requests in flight shrink in proportion (``rate x latency`` each),
which is what the proportions need. Limits per prefix would only change which requests wait.

The control law (``LimitController``), once per epoch (the answers to requests sent since the
last decision: at least 16, at most 64, so about one round trip):

* **Slow start.** From ``initial`` (8), double per epoch while nothing pushes back. A pass
  that starts above ``probe_limit`` (a batch's requests at once) doubles from its second
  epoch on: the first one's answers waited for the pass's new connections (opened a few at a
  time, ``_storage/backends/pacing.py``) and for the queue its own burst made, so it only
  measures (``bench_autotune`` (d): whole-run p99 214 -> 173 ms, medians of 6 interleaved
  runs, lower in 5; without it the doubling from there looked free and the next went into
  the queue). An epoch at a doubled limit whose fastest answer took ``rise`` (1.2) times the
  last epoch's fastest ends slow start and takes the doubling back (HyStart++'s delay rule):
  fastest against fastest compares like with like, and the fastest answers find the store
  idle even where the connections still opening make an epoch's median as slow as a queue
  would.
* **Latency, as TCP Vegas.** The epoch's median latency over the unloaded one (the least epoch
  median of the last 10 s) gives our requests waiting, ``queued = limit * (1 - base/median)``.
  Over ``high`` (1.4) with more than 4 waiting: latency rose without goodput (by Little's law
  goodput is limit / latency), so shrink toward the band's middle in one step, at most by half,
  as Netflix's Gradient2 does. Under ``low`` (1.1), or fewer than 4 waiting: grow 10%. Between:
  hold. A pass that starts above ``probe_limit`` (8; a first batch's worth) takes its first
  latencies under its own load, so its first backoff is also a probe, as BBR's PROBE_RTT:
  ``probe_limit`` in flight for one epoch of that many answers, whose median is a candidate
  for the unloaded latency, then back to the shrunk limit. The probe waits one epoch at the
  shrunk limit, so that the worker knows by then whether its own CPU made the queue (below).
  Noise is not a queue: the log-latency spread (from the interquartile range) widens the band
  by two standard errors of a median and lifts the least median by two, since a minimum of
  many noisy medians sits that far below the true one. Three backoffs that left latency as it
  was mean the store itself got slower: its latency now becomes the unloaded one.
* **Throttles, as TCP CUBIC.** A ``503 SlowDown``, ``429`` or ``Retry-After`` cuts the limit to
  0.8 of it at once, once per overload (answers to requests sent before the cut do not cut
  again); in slow start, to half of it, taking back the doubling that overshot (four workers
  starting together on a 2,000/s bucket: 6% of the first second's answers throttled, 11% with
  a cut to 0.8; ``bench_autotune`` (c): 63-97 throttles in its first 0.5 s instead of 119-187).
  The limit then follows CUBIC's curve: concave back to the throttled limit in 0.75 s; then,
  where latency shows no queue, the more of the curve's convex part (at most a quarter more an
  epoch: its clock runs on while the worker pauses, ``ControlConfig.convex_step``) and 10% per
  epoch, and otherwise it holds; 1.5 times past it with no throttle, the allowance rose and
  the curve is dropped. CUBIC's curve stays flat around the throttled limit for a while: that
  held a loader whose peer had finished at its own share for 1-2 s (``bench_autotune`` (c), 10
  interleaved pairs: whole runs at a median 0.91 of the store's rate, 0.76-0.95, with 1.75% of
  requests throttled, against 0.82, 0.76-0.94, and 1.4% with the flat part). ``Retry-After``
  freezes growth for as long as the server asked (the request itself waits in the retry path);
  a hold longer than the concave part leaves the curve at the throttled limit. Throttled below
  the last ceiling, the ceiling drops to the middle (CUBIC's fast convergence), so workers
  sharing a store come closer, slowly (and more slowly since growth no longer waits on the
  lowered ceiling's flat part): the curve scales with each worker's own limit, so a cut and its
  regrowth keep the ratio between two loaders that share nothing (``bench_autotune`` (c): one
  loader keeps 55-65% of the rate in some runs). TCP CUBIC's curve, in requests per second
  cubed and the same for every worker, would even them out; it made the simulated 2,000 ->
  500/s change take 5.3 s, so it is not used.
* **Caps and signals.** An explicit ``max_concurrency`` bounds every value the limit takes.
  While the worker's own CPU is what bounds it (``cpu_bound``: its loop or its CPU lane busy,
  ``_engine/cpu_load.py``), latency rises with its own queue: Vegas stops at that knee as at
  a store's, but the probe waits for an epoch whose CPU is free, since a probe's round trip
  at ``probe_limit`` in flight idles the CPU that bounds the worker (``bench_autotune`` (a)
  and (b): 0.78 and 0.89 of the best fixed limit with it, 0.97 and 0.99 without). A worker
  busy only with its start (opening connections at 128 in flight) probes once that is over;
  one that stays bound never does. Other failures (500s, resets, timeouts)
  neither count as goodput nor cut, and their latencies are not samples.
* **Sharing.** ``export`` gives a frozen ``LimitState`` (limit, unloaded latency and when it
  was measured, throttled limit and when); ``LimitState.combine`` merges the workers' states
  in the main process; a new controller started from it skips the slow start, and ``merge``
  during a pass (the main process sends each worker the others' states, ``Peers``) takes a
  throttle another worker saw more than a round trip after its own last cut as its own,
  an unloaded latency far below its own (a probe's, where its own was taken under load), and
  moves halfway to the others' limit. During a probe a worker exports the limit it returns
  to, not the probe's 8 (which its peers moved halfway toward). A cut goes out with the
  worker's next batch (``news``), not with the stats every 0.2 s.

What it reaches on simulated stores (a constant latency with a CPU-bound client, token
buckets, servers behind a line, a throttled burst, workers sharing, a change of rate, a pass
that starts past the knee) is listed with those stores, in the tests of this module.

Tried and dropped, on the same stores: a cut to 0.7 with 1 s of recovery (one worker 0.93-0.99 of
the rate, and 5-6 s to converge after a change, against 3 s); one cut per round trip instead of per
overload (2,000->500 took 4.0-5.7 s); cutting from the delivered rate times latency, as BBR
estimates (0.76 of the rate at 200 ms, 0.91 after 500->3,000); Vegas with the plain least latency
as the base (collapsed to 1 in flight on a log-normal store, sigma 0.5: 0.004 of the best; 0.13
behind a line of 4 exponential servers). Pure AIMD (+1 per round trip) was not simulated: at 50 ms
it needs ~2 s per 40 requests in flight, where growth after a change of 2x must take under 3 s. An
additive +1 or +2 per epoch on top of the cubic curve, for fairness between workers that share
nothing, evened out two simulated workers from 70/30 within 2-4 s but did not help two loaders on
the loopback store (``bench_autotune`` (c): 0.80-0.93 of the rate against 0.81-0.98, more
throttles). A cut to 0.8 in slow start too (the rule before the halving above) left workers that
had doubled together 1.6 times over what passed. A band 1.5 times wider while the worker's loop
(not only its lane) was busy: the requests waiting are answers that loop has yet to read, and one
turn reads all that arrived, so more in flight cost each less of it. Passes of 16,384 objects of
100 KB at 50 ms (two workers on the loopback store's 2 cores, where the band as it is held the
limit at 90-120 and reached 0.90-0.94 of a fixed 128) ran 1.16x faster over S3 (median of 6
interleaved pairs, 0.98-1.30) and as fast over HTTP (0.88-1.14), and a simulated loop that reads in
turns (1.5 ms a turn, 0.5 ms an answer) reached 0.98 of the best fixed value against 0.93; but
``bench_autotune`` (b) fell to 0.50 of its best fixed value in the run made. Its decode runs inline
on the same loop (a core per worker): the wider band only fetched ahead of the decode (every object
requested within its 5 s, half of them delivered), and a loop busy decoding gains nothing from more
answers waiting. The two were then told apart (the steps of the engine's sample tasks timed, less
those of their reads: the samples' own work took 0.2-0.4 of a busy loop's time where they only
read, 0.85-0.9 where they decoded a JPEG inline), and the band widened only for a loop busy
reading. In passes of 16,384 objects (4 interleaved rounds, 2026-11-28) the two HTTP workers'
limits ended at 333-439 together against 195-262, their CPU per sample was no lower (medians 638
and 602 µs), and the passes ran at 0.94 of the default's rate (medians 2,162 and 2,310/s); over S3
as fast (2,392 and 2,403/s). At 200 per worker and more, more answers per turn did not cost each
one less. Slow start was also made to resume, once a pass, when one of the 3 epochs after it ended
came back under ``low`` (HyStart++'s conservative slow start: the pass's own start slows its first
round trips at 64 in flight, and 10% per epoch then takes a second to reach 128). Resumed after
either end (the delay rule's or the Vegas hold's), passes of 4,096 objects ran 1.15x (HTTP) and
1.20x (S3) faster and ``bench_autotune`` (a) reached 1.08 of its best fixed value against 0.88, but
(d)'s whole-run p99 over its fixed 32 row's went from 2.00x to 2.49x: once the delay rule takes a
doubling back, the next epochs are fast whatever the rise was, and slow start doubled into the
queue again (medians of 4-5 interleaved runs, 2026-11-28). Resumed after the Vegas hold only, or
with 25% growth for those 3 epochs instead of resuming, the passes' rate moved within the noise
(0.85-1.04 of the base's), as did (a) and (d) for the first. With ``low`` at 1.1, passes of 4,096
objects over S3 held their workers at 50-90 each, their latency 1.0-1.3x the probe's (the machine's
two cores shared, not a queue at the store), where a fixed 128 ran 1.2x faster. Growing under 1.25
instead, for every worker, ran faster over S3 in 21 of 30 interleaved pairs (set medians 0.94-1.16x;
in two of the four sets the shrink target and CUBIC's recovery moved with ``low``, in two only the
growth test did) and over HTTP in 15 of 30, no better than chance; in the runs made with ``low`` at
1.25, (d)'s whole-run p99 was higher (medians 2.21x against 1.92x of the fixed 32 row's, 4 runs
each; 1.38x against 1.32x simulated) and (c) reached 0.80-0.85 of the store's rate in 4 runs,
against 0.89 in 2 of the base's 4 (0.48 and 0.70 in the other 2, during a slow spell). Growing under
1.25 only while the worker's CPU bounds it won 12 of 18 pairs over HTTP and 9 of 18 over S3
(2026-11-28). A floor of a batch's worth (32) on the Vegas shrink while the worker's CPU bounds
it, for a store that answers at once (an in-memory one: limits of 3-7, where each turn of the
worker's loop reads few answers): 8% more samples/s there in 3 of 4 pairs, but ``bench_autotune``
(d) read its workers as bound at their start, and its whole-run p99 went to 195 and 212 ms against
97 and 150 (2 interleaved runs each; 2026-11-28). Ending a worker's slow start when another's
ended on a queue or a throttle (taking its running doubling back), with a worker in slow start
exporting the limit before its running doubling: through the main process (``Peers``) the news
came 80-120 ms late, after the next doubling, so it also went through a byte per worker in shared
memory, read at each answer. (d)'s whole-run p99 fell to a median of 116 ms from 180 (6
interleaved runs each; a worker doubled on to 128 in 2 runs against 4). But passes of 4,096
objects (``bench_ab``, 6 interleaved pairs each, 2026-11-29) ran at these shares of the code
before: over S3 0.86 with the shared memory, 0.91 with it limited to slow starts that ended while
the worker's own CPU was free, 0.97 through the main process alone, 0.92 with the export alone;
over HTTP 0.92, 1.00, not run, 0.96 (what landed instead: 1.00 and 1.00). In a traced S3 pass one
worker's rise at 64 in flight took the other's doubling back: on two shared cores such a rise is
the machine's, not the store's, and obstore reads on its own threads, where the CPU test does not
look. Neither part landed. The delay rule was also made to pass over a doubled epoch's first
answers, to the requests the doubling sent at once: they wait behind the line of before only, and
the line the doubling makes is in the answers to the requests sent after them. (d)'s whole-run p99
fell in 6 interleaved pairs (median 97 ms against 144, peak in flight 128-161 against 192-248),
less so in later runs (179-276 ms in 3 traced ones), and passes of 4,096 objects over HTTP ran at
0.92 and 0.96 of the code before (2 of 6 pairs faster in each set; S3 0.98), with 6-15% more CPU
per sample: on the loopback store's two shared cores slow start then ended at 64 per worker on the
machine's own line instead of doubling on to 128-256, where more answers per turn of the loop
cost each less. Passing over them only while the worker's CPU was free kept HTTP (1.00) but not
(d) (median 159 ms against 172; the workers' start read as CPU-bound). It did not land
(2026-11-29). Not covered: a store at 500 ms that throttles synchronized bursts (0.56 of the rate;
pacing the sends would help).

Where it runs: ``_engine/slots.py`` sizes a worker's fetch slots with it (one controller per
worker, each sample one request; a storage attempt's throttle reaches it through
``_stats.note_throttle``); ``limiter.py`` has the asyncio semaphore built on it. What it takes
and gives (``Outcome``, ``ControlConfig``, ``LimitState``, ``LimitStats``) is ``values.py``'s,
the unloaded latency and its noise ``latency.py``'s.
"""

from __future__ import annotations

import math

from .latency import BaseLatency
from .values import ControlConfig, LimitState, LimitStats, Outcome

__all__ = ["LimitController"]


class LimitController:
    """The in-flight limit of one worker: pure, with the clock passed in.

    The caller reports each request's start (``started``) and answer (``finished``) with the
    time; the controller never sleeps, reads a clock, or does I/O, so it runs the same under
    a simulator as in a worker's event loop. ``limit`` is how many may be in flight now.

    Args:
        config: The control law's constants.
        cap: An explicit ``max_concurrency``: the limit never exceeds it.
        learned: What earlier workers learned about the store (a pass's configuration):
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
        >>> c.limit  # cut at once; in slow start, the doubling taken back
        8
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
        # A probe of the unloaded latency (module doc): the limit to go back to while one runs,
        # and whether the unloaded latency was ever measured at a load of probe_limit or less.
        self._probe_return: float | None = None
        self._probed = config.initial <= config.probe_limit
        self._probe_due = False
        # The unloaded latency (the least epoch median of the last base_window seconds) and
        # the noise around it, that a queue is measured by.
        self._latency = BaseLatency(config.base_window)
        self._streak = 0
        self._streak_latency = 0.0
        self._in_flight = 0
        self._peak = 0
        self._epoch_peak = 0
        self._epoch_start = now
        self._epoch_latencies: list[float] = []
        # Slow start's delay rule (ControlConfig.rise): the fastest answer of this epoch and
        # of the last one.
        self._epoch_fastest = math.inf
        self._last_fastest: float | None = None
        # Slow start's first epoch only measures when the pass starts above probe_limit (module
        # doc): a batch's requests at once, whose answers waited for the pass's new connections.
        self._first_epoch = config.initial > config.probe_limit
        # Whether this epoch runs at a limit slow start just doubled: only then can a rise in
        # its fastest answers be the doubling's (a held first epoch's queue lifts the next
        # epoch's fastest answers above the first ones, which found the store idle).
        self._doubled = False
        self._requests = self._throttled = self._failed = self._cuts = self._backoffs = 0
        self._cuts_exported = 0  # the cuts an export has told the other workers of (news)
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
        # Once per request: comparisons, not max() calls (a peak is never below the epoch's).
        n = self._in_flight = self._in_flight + 1
        if n > self._epoch_peak:
            self._epoch_peak = n
            if n > self._peak:
                self._peak = n

    def start_if_room(self, now: float) -> bool:
        """``started(now)`` if fewer than ``limit`` requests are in flight; whether it was:
        the check and the start in one call, for a caller that does both per request."""
        n = self._in_flight
        if n >= 1 and n >= int(self._limit):  # n >= limit, as the property has it
            return False
        self.started(now)
        return True

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
        if self._in_flight > 0:
            self._in_flight -= 1
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
        latencies = self._epoch_latencies
        latencies.append(latency)
        cfg = self.config
        if self._probe_return is not None:
            needed = cfg.probe_limit  # one round trip at the probe's load
        else:
            if self._slow_start:
                if latency < self._epoch_fastest:
                    self._epoch_fastest = latency
                if (
                    self._doubled
                    and self._last_fastest is not None
                    and len(latencies) >= cfg.rise_samples
                    and self._epoch_fastest > cfg.rise * self._last_fastest
                ):
                    self._rose(now)
                    return
            needed = int(self._limit)
            if needed < cfg.min_samples:
                needed = cfg.min_samples
            if needed > cfg.max_samples:
                needed = cfg.max_samples
        if len(latencies) >= needed:
            self._end_epoch(now)

    def returned(self) -> None:
        """A slot ``started`` but never used (nothing was sent, or it was cancelled before an
        answer): it is free again, and there is no answer to learn from."""
        if self._in_flight > 0:
            self._in_flight -= 1

    def throttled(self, now: float, sent: float, retry_after: float | None = None) -> None:
        """A request sent at *sent* was told "too many" at *now* and is being retried (or was
        one copy of a hedged read whose other copy answers): its final answer comes through
        ``finished`` (or ``returned``, if it gave its slot back while it waited), but the limit
        is cut now, as for a ``THROTTLED`` answer."""
        self._throttled += 1
        self._throttle(now, sent, retry_after)

    def cpu_bound(self, now: float, bound: bool) -> None:
        """Whether the worker's own CPU (its loop, its CPU lane) is what bounds it now.

        While it is, a rise in latency is (also) the worker's own queue: the law shrinks for it
        as for any queue, but does not probe the unloaded latency, which would idle that CPU.
        """
        self._cpu_bound = bound

    # ── sharing ─────────────────────────────────────────────────────────────────────────────

    @property
    def news(self) -> bool:
        """Whether the loader's other workers should hear at once rather than with the next
        stats (every 0.2 s): a cut for a throttle, which cuts theirs too (``merge``), that
        no ``export`` has told of yet."""
        return self._cuts != self._cuts_exported

    def export(self) -> LimitState:
        """What this controller learned, for the main process to pass on.

        During a probe, the limit it returns to: the probe's few in flight measure the
        store, they are no limit for a peer to move toward (``merge``). The cuts so far are
        told (``news``).
        """
        self._cuts_exported = self._cuts
        return LimitState(
            limit=self._limit if self._probe_return is None else self._probe_return,
            base_latency=self._latency.base,
            ceiling=self._ceiling,
            throttled_at=self._throttled_at,
            base_at=self._latency.base_at,
        )

    def merge(self, state: LimitState, now: float) -> None:
        """Take in what the loader's other workers learned of the same store during a pass.

        They read the same store, so a throttle one of them saw and this one has not answered
        yet is this one's too: cut. Otherwise move halfway to their limit, so that workers
        sharing a store's allowance converge to equal shares.
        """
        own = self._latency.base
        if state.base_latency is not None and (
            own is None or state.base_latency * self.config.high < own
        ):
            # Far below ours, theirs was measured at a lighter load (a probe), where ours was
            # taken under the pass's own: take it, at the time it was measured so that it ages
            # out here as it does there. A base within the band is noise, not news: the least
            # of both workers' medians would sit below the true one and read noise as a queue.
            at = now if state.base_at is None else min(now, state.base_at)
            self._latency.note(at, state.base_latency, self.config.max_samples)
        # A throttle within a round trip of our own last cut is the overload that cut already
        # answers (one cut per overload, as for our own answers): cutting again for it would
        # take a share of the store's allowance twice.
        rtt = self._latency.smoothed or 0.0
        if state.throttled_at is not None and state.throttled_at > self._cut_at + rtt:
            self._throttled_at = max(self._throttled_at or -math.inf, state.throttled_at)
            self._cut(now)
            return
        if self._probe_return is not None:
            self._probe_return = self._clamp((self._probe_return + state.limit) / 2)
        elif not self._slow_start:
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
            base_latency=self._latency.base,
            latency=self._latency.smoothed,
            phase=phase,
            cpu_bound=self._cpu_bound,
        )

    # ── the control law ─────────────────────────────────────────────────────────────────────

    def _clamp(self, limit: float) -> float:
        return min(self._max, max(self._min, limit))

    def _adopt(self, learned: LimitState, now: float) -> None:
        self._limit = learned.limit
        # Start where the others got to: no slow start (its overshoot is what throttles).
        self._slow_start = False
        if learned.base_latency is not None:
            # Measured by the last pass (its probe, or its slow start from a few in flight).
            self._latency.note(now, learned.base_latency, self.config.max_samples)
            self._probed = True
        if learned.ceiling is not None:
            # Back at the known ceiling, past the curve's concave part: grow past it while
            # latency shows no queue, until a throttle says where the room ends.
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
        if self._probe_return is not None:  # a throttle says more than the probe would
            self._limit, self._probe_return = self._probe_return, None
        limit = self._limit
        # CUBIC's fast convergence: throttled below the last ceiling means others took part of
        # the store's allowance; aim lower so that they can keep it.
        if not self._slow_start and self._ceiling is not None and limit < self._ceiling:
            self._ceiling = limit * (1 + cfg.backoff) / 2
        else:
            self._ceiling = limit
        # In slow start the last doubling is what overshot: take it back, as TCP's slow start
        # halves on a loss. A cut to 0.8 of it would leave workers that doubled together at 1.6
        # times what passed, to be throttled again in the next round trip (module doc).
        self._limit = self._clamp(
            limit / cfg.slow_start if self._slow_start else limit * cfg.backoff
        )
        self._cut_at = now
        self._quiet_until = now  # answers to requests sent before the cut do not cut again
        self._slow_start = False
        self._cuts += 1
        self._new_epoch(now)

    def _recovering(self, now: float) -> float:
        """Seconds on the recovery curve: since the last cut, but where a ``Retry-After`` held
        growth past the curve's concave part, back at the throttled limit when the hold ended
        (the clock run through a hold of 5 s put the curve at 37 times that limit)."""
        since = now - self._cut_at
        if self._hold_until > self._cut_at:
            since = min(since, self.config.recovery + max(0.0, now - self._hold_until))
        return since

    def _cubic(self, now: float) -> float:
        assert self._ceiling is not None
        cfg = self.config
        x = self._recovering(now) / cfg.recovery - 1.0
        # Concave back to the ceiling over `recovery` seconds, flat around it, convex beyond
        # (past the concave part _end_epoch grows at least 10% an epoch where latency shows no
        # queue, and the convex part by at most ControlConfig.convex_step).
        return self._ceiling * (1.0 + (1.0 - cfg.backoff) * x**3)

    def _rose(self, now: float) -> None:
        """Slow start's last doubling bought a queue (``ControlConfig.rise``): back to the limit
        before it, the end of slow start, and a probe if the unloaded latency was never
        measured at a light load (every answer so far came under the pass's own load)."""
        cfg = self.config
        self._slow_start = False
        self._backoffs += 1
        self._limit = self._clamp(self._limit / cfg.slow_start)
        self._new_epoch(now)
        self._probe_if_unmeasured()

    def _probe_if_unmeasured(self) -> None:
        if not self._probed:
            # The unloaded latency was taken under load: measure it (module doc), after one
            # epoch at the shrunk limit, so that whether the worker's own CPU is what queued
            # (``cpu_bound``, measured every 0.1 s) is known for that epoch.
            self._probe_due = True

    def _start_probe(self, now: float) -> bool:
        """Start the probe that is due, unless the limit is already that low, or the worker's
        CPU bounds it: the probe would idle that CPU for a round trip, so it stays due, for
        the next epoch whose CPU is free."""
        if self._probed or self._limit <= self.config.probe_limit:
            self._probe_due = False
            return False
        if self._cpu_bound:
            return False
        self._probe_due = False
        self._probed = True
        self._probe_return = self._limit
        self._limit = self._clamp(float(self.config.probe_limit))
        self._new_epoch(now)
        return True

    def _new_epoch(self, now: float) -> None:
        if self._epoch_fastest < math.inf:
            self._last_fastest = self._epoch_fastest
        self._epoch_fastest = math.inf
        self._epoch_start = now
        self._doubled = False
        self._epoch_latencies.clear()
        self._epoch_peak = self._in_flight

    def _end_epoch(self, now: float) -> None:
        cfg = self.config
        n = len(self._epoch_latencies)
        if self._probe_return is not None:
            # The probe's answers, sent with probe_limit in flight: their median is a
            # candidate for the unloaded latency; then back to where the limit was going.
            self._latency.epoch(now, self._epoch_latencies)
            self._limit, self._probe_return = self._probe_return, None
            self._new_epoch(now)
            return
        if self._probe_due and self._start_probe(now):
            return
        # The unloaded latency is lifted by the noise, and the band widened by it (``latency``).
        median, base, widen = self._latency.epoch(now, self._epoch_latencies)
        high = cfg.high * widen
        ratio = median / base if base > 0 else 1.0
        # Our requests waiting, by Little's law (Vegas's "diff"): the limit times the share of
        # the latency that is above the unloaded one.
        queued = self._limit * (1.0 - 1.0 / ratio) if ratio > 1 else 0.0
        # Whether the limit was what held the worker back: if it never filled it, the demand
        # (the sampler, the CPU lane) did, and a larger limit would be untested.
        used = self._epoch_peak >= 0.5 * self._limit
        limit = self._limit
        if ratio > high and queued > cfg.queue_floor:
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
                self._latency.rebase(now, median, n)
                self._streak = 0
            self._limit = self._clamp(limit)
            self._new_epoch(now)
            self._probe_if_unmeasured()
            return
        elif now < self._hold_until or not used:
            pass
        elif self._ceiling is not None:
            if self._recovering(now) < cfg.recovery:
                limit = max(limit, self._cubic(now))
            elif ratio < cfg.low or queued < cfg.queue_floor:
                # Back at the throttled limit with no queue: the store may have room that
                # another reader left (module doc); the next throttle says if not.
                # The convex part by one step an epoch at most (ControlConfig.convex_step).
                convex = min(self._cubic(now), self._limit * cfg.convex_step)
                grown = self._limit + max(1.0, self._limit * cfg.growth)
                limit = max(limit, convex, grown)
            if limit >= cfg.probe * self._ceiling:
                # Well past what was throttled and no throttle since: the allowance rose.
                self._ceiling = None
        elif self._slow_start and self._first_epoch:
            pass  # the first epoch's answers waited for new connections: measure once more
        elif ratio < cfg.low or queued < cfg.queue_floor:
            grow = cfg.slow_start - 1 if self._slow_start else cfg.growth
            limit += max(1.0, limit * grow)
        else:
            # Latency has started to rise: the knee. Hold here; slow start is over.
            self._slow_start = False
        self._streak = 0
        self._first_epoch = False
        doubled = self._slow_start and limit > self._limit
        self._limit = self._clamp(limit)
        self._new_epoch(now)
        self._doubled = doubled
