"""How many samples one engine fetches at once: a fixed count, or a limit it finds itself.

``max_concurrency=N`` is a plain semaphore of N slots. ``max_concurrency=None`` (the default)
sizes the slots with ``_control``'s ``LimitController``, from what the samples'
answers say (issue #33):

* each sample is one "request" to the controller: its latency from the slot's grant to its
  result. Latency that rises without goodput means the samples queue somewhere, at the store
  or on this worker's own loop (decoding, collating), and the limit shrinks; flat latency
  lets it grow. So one law covers a slow store (grow to hide the round trip), a CPU-bound
  pipeline (shrink: more in flight only holds memory and delays the head batch), and a store
  whose latency grows with load (stop at the knee);
* a throttle (``503 SlowDown``, ``429``, ``Retry-After``) met by any storage attempt of a
  sample is told at once (``_stats.note_throttle``): the limit is cut multiplicatively, once per
  overload, and recovers along CUBIC's curve. A retry's backoff waits outside its slot
  (``Held``, ``_control/aside.py``), so the retries too come back within the cut limit;
* a sample that fails is neither goodput nor a latency sample.

The limit starts at ``initial`` (a batch's worth, at least 8) or where the last pass's workers
got to (``learned``), and never exceeds ``auto_ceiling``: 512 per worker, 1,024 per loader.
Which samples are fetched, and in which batches, does not depend on it: only when.
"""

from __future__ import annotations

import asyncio
import time

from .._control import (
    AdaptiveLimiter,
    ControlConfig,
    LimitController,
    LimitState,
    Outcome,
)
from .cpu_load import CpuLoad

__all__ = [
    "AUTO_CEILING",
    "LOADER_CEILING",
    "Held",
    "Slots",
    "auto_ceiling",
    "initial_limit",
    "learned_from",
    "most_in_flight",
]

AUTO_CEILING = 512
"""The most samples one worker may have in flight with ``max_concurrency=None``."""
LOADER_CEILING = 1024
"""... and all the workers of a loader together, so that each of many workers gets a share
(at least ``MIN_CEILING``): 8 workers reaching 512 each asked one loopback host for 4,096
samples at once, a whole epoch of ``bench_gpu``, and trained 0.62 of the GPU's ceiling where a
fixed 128 each trained 0.71 (H200, 2026-11-26)."""
MIN_CEILING = 64
# Read once per sample: module constants, not an Enum's attribute lookups.
_OK, _FAILED = Outcome.OK, Outcome.FAILED


def auto_ceiling(num_workers: int) -> int:
    """The most samples one of *num_workers* workers may have in flight by default."""
    return max(MIN_CEILING, min(AUTO_CEILING, LOADER_CEILING // max(1, num_workers)))


def most_in_flight(max_concurrency: int | None, num_workers: int) -> int:
    """The most samples a worker may have in flight: what its pools are sized for."""
    return auto_ceiling(num_workers) if max_concurrency is None else max_concurrency


def learned_from(states: list[object], workers: int) -> LimitState | None:
    """What a pass's workers learned (their ``RecorderSnapshot.learned``), for *workers* new
    ones: the mean limit rescaled to their number (what the store allows is for all of them
    together), the least unloaded latency, the last throttle. ``None`` if nothing was learned.
    """
    learned = [s for s in states if isinstance(s, LimitState)]
    if not learned:
        return None
    return LimitState.combine(learned).for_workers(max(1, workers))


def initial_limit(batch_size: int | None) -> int:
    """Where an adaptive limit starts: a batch's worth (the head batch in one round trip), at
    least the controller's own start, at most a quarter of the ceiling."""
    return max(ControlConfig().initial, min(batch_size or 1, AUTO_CEILING // 4))


class Slots:
    """The engine's fetch slots. ``acquire`` before a sample, ``release`` after it;
    ``handoff`` lets a slot's holder take the next sample itself, if the limit still allows.

    Args:
        cap: ``max_concurrency``: a fixed number of slots; ``None``: an adaptive limit.
        initial: Where an adaptive limit starts.
        learned: What an earlier pass's workers learned (an adaptive limit starts there).
        ceiling: The most an adaptive limit may reach (``auto_ceiling``).

    Examples:
        >>> import asyncio
        >>> async def main() -> tuple[int, int]:
        ...     fixed, auto = Slots(2), Slots(None, initial=16)
        ...     await fixed.acquire()
        ...     return fixed.limit, auto.limit
        >>> asyncio.run(main())
        (2, 16)
    """

    __slots__ = ("_ceiling", "_fixed", "_limiter", "_load", "cap")

    def __init__(
        self,
        cap: int | None,
        *,
        initial: int = 8,
        learned: LimitState | None = None,
        ceiling: int = AUTO_CEILING,
    ) -> None:
        self.cap = cap
        self._ceiling = ceiling
        self._fixed: asyncio.Semaphore | None = None
        self._limiter: AdaptiveLimiter | None = None
        # Whether this worker's own CPU bounds it: an adaptive limit makes no probe then
        # (cpu_load.py), and the stats say so (``LoaderStats.cpu_bound_s``).
        self._load = CpuLoad()
        if cap is not None:
            self._fixed = asyncio.Semaphore(cap)
        else:
            config = ControlConfig(initial=min(max(initial, 1), ceiling))
            controller = LimitController(config, cap=ceiling, learned=learned, now=time.monotonic())
            # time.monotonic, not the loop's clock: storage notes a throttle's send time with it.
            self._limiter = AdaptiveLimiter(controller, clock=time.monotonic)

    def renewed(self) -> Slots:
        """Slots for a new pass: all free; an adaptive limit starts where this one got to."""
        if self._limiter is None:
            return Slots(self.cap)
        return Slots(None, learned=self._limiter.controller.export(), ceiling=self._ceiling)

    @property
    def limit(self) -> int:
        """Samples that may be in flight now."""
        if self._limiter is not None:
            return self._limiter.controller.limit
        assert self.cap is not None
        return self.cap

    @property
    def controller(self) -> LimitController | None:
        """The adaptive limit's controller (its figures, its state to pass on), if adaptive."""
        return self._limiter.controller if self._limiter is not None else None

    async def acquire(self, *, first: bool = False) -> float:
        """Wait for a slot; when it was granted (``time.monotonic``). *first*: ahead of the
        others waiting for an adaptive limit (a sample that gave its slot back for a while)."""
        if self._fixed is not None:
            await self._fixed.acquire()
            now = time.monotonic()
            self._load.sample(now)
            return now
        assert self._limiter is not None
        await self._limiter.acquire(first=first)
        now = time.monotonic()
        self._note_load(now)  # from the pass's first request on
        return now

    def release(self, granted: float | None = None, ok: bool | None = None) -> None:
        """Give a slot back. *granted* and *ok* tell an adaptive limit the sample's latency
        and outcome (``ok=None``: it was not fetched, or was cancelled: nothing to learn)."""
        if self._fixed is not None:
            # No measure here: each sample starts with acquire or handoff, which measure with
            # the clock they read anyway.
            self._fixed.release()
            return
        assert self._limiter is not None
        if granted is None or ok is None:
            self._limiter.returned()  # nothing to learn from
            return
        now = time.monotonic()
        self._note_load(now)
        self._limiter.release(_OK if ok else _FAILED, now - granted)

    def handoff(self, granted: float, ok: bool | None) -> float | None:
        """The holder of a slot finished a sample (granted at *granted*): may it take the next
        one in line without giving the slot back? The new grant time if so; ``None`` if the
        limit shrank below what is in flight, or a sample that gave its slot back for a while
        waits to take one again (it goes first): the slot is then given back.

        Others waiting for a slot (the engine's starter) do not stop a handoff: the sample it
        takes is the one next in line, which they would have taken. Deferring to them cost a
        task and two wake-ups per sample whenever the line was long (every sample, where the
        limit bounds the worker).
        """
        if self._fixed is not None:
            now = time.monotonic()
            self._load.sample(now)
            return now
        limiter = self._limiter
        assert limiter is not None
        c = limiter.controller
        now = time.monotonic()
        if ok is None:
            c.returned()
        else:
            self._note_load(now)
            c.finished(now, _OK if ok else _FAILED, now - granted)
        kept = not limiter.rejoining and c.start_if_room(now)
        # The answer may have ended an epoch that raised the limit: wake() gives the room it
        # made to those waiting (the starter), who have no release to wake them.
        limiter.wake()
        return now if kept else None

    @property
    def cpu_bound_s(self) -> float:
        """Wall seconds of this pass during which the worker's own CPU bounded it."""
        return self._load.bound_s

    def _note_load(self, now: float) -> None:
        assert self._limiter is not None
        bound = self._load.sample(now)
        if bound is not None:
            self._limiter.controller.cpu_bound(now, bound)

    def merge(self, peers: LimitState) -> None:
        """Take in what the loader's other workers learned during this pass (a ``Peers``
        message): their unloaded latency, a throttle they met, their limit
        (``LimitController.merge``)."""
        if self._limiter is not None:
            self._limiter.controller.merge(peers, time.monotonic())
            self._limiter.wake()

    def throttled(self, sent: float, retry_after: float | None) -> None:
        """A storage attempt sent at *sent* was told "too many" (``Recorder.on_throttle``)."""
        if self._limiter is not None:
            self._limiter.throttled(sent, retry_after)


class Held:
    """The slot an engine task holds for the samples it fetches one after another: when it was
    granted, and whether it is held now. It is the ``aside.Seat`` the task lends its samples:
    a retry's backoff gives an adaptive slot back and takes one again, ahead of samples not
    yet started, before the retry is sent. (A fixed ``max_concurrency`` keeps its slot.)

    Args:
        slots: The engine's slots, one of which was granted.
        granted: When (``Slots.acquire``'s answer).

    Examples:
        >>> import asyncio
        >>> async def main() -> list[int]:
        ...     slots = Slots(None, initial=8)
        ...     held = Held(slots, await slots.acquire())
        ...     seen = [slots.controller.in_flight]
        ...     assert held.leave()  # a retry waits: its slot goes back meanwhile
        ...     seen.append(slots.controller.in_flight)
        ...     await held.rejoin()
        ...     held.release(True)
        ...     return [*seen, slots.controller.in_flight]
        >>> asyncio.run(main())
        [1, 0, 0]
    """

    __slots__ = ("_joining", "_slots", "closed", "granted", "held")

    def __init__(self, slots: Slots, granted: float) -> None:
        self._slots = slots
        self.granted = granted
        self.held = True
        # Released or handed over: its task is done with it. A task that a sample started and
        # left running inherits the seat, and may back off and rejoin later: it must not take
        # a slot that nobody would give back.
        self.closed = False
        # A sample's reads gathered at once share this: one takes the slot again, the others
        # wait for it (two acquires would hold two).
        self._joining: asyncio.Lock | None = None

    def leave(self) -> bool:
        """Give an adaptive slot back for a wait; whether it was given."""
        if not self.held or self.closed or self._slots.cap is not None:
            return False
        self.held = False
        self._slots.release()  # nothing to learn from a sample that has not finished
        return True

    async def rejoin(self) -> None:
        """Hold a slot again (first in line), if this one was given back and is still in
        use."""
        if self.held or self.closed:
            return
        if self._joining is None:
            self._joining = asyncio.Lock()
        async with self._joining:
            if not self.held and not self.closed:
                granted = await self._slots.acquire(first=True)
                if self._let_go():  # its task let go meanwhile: nobody would give it back
                    self._slots.release()
                else:
                    self.granted, self.held = granted, True

    def _let_go(self) -> bool:
        return self.closed  # a call: read after an await, not narrowed by the check before

    def keep(self, ok: bool | None) -> bool:
        """A sample (outcome *ok*) finished and others wait in line: whether this holder keeps
        the slot for the next one (``Slots.handoff``). If not, the slot was given back (or was
        not held: its sample left it for a wait) and this ``Held`` takes none again: the
        samples in line go to whoever the freed slots go to.

        A holder that waited for a slot again, holding the sample it took next, kept every
        later holder waiting too: each one that finished gave its slot to the one waiting and
        waited in turn, a task switch and two wake-ups per sample for as long as the pass ran.
        """
        if self.held and not self.closed:
            granted = self._slots.handoff(self.granted, ok)
            if granted is not None:
                self.granted = granted
                return True
            self.held = False
        self.closed = True
        return False

    def hand_over(self) -> float:
        """Pass the slot to another task (which makes its own ``Held``); when it was granted."""
        assert self.held
        self.held, self.closed = False, True
        return self.granted

    def release(self, ok: bool | None) -> None:
        """Give the slot back, if held, telling the limit the last sample's outcome *ok*;
        this ``Held`` takes none again."""
        self.closed = True
        if self.held:
            self.held = False
            self._slots.release(self.granted, ok)
