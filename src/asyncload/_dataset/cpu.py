"""CPU work of a sample (decode, transforms) on its worker's CPU lane, the head batch first.

Requests in flight are sized for latency (hundreds per worker); CPU work is not: on a worker's
share of the cores, more threads than cores only contend for them (and for the GIL), and a
decoder that runs on the event loop's thread delays every request's next step. So each engine
has a *CPU lane*: a few threads, as many as the worker's share of the cores by default
(``default_threads``), that run what ``cpu()`` is given in order of need: the samples of the
batch sent first (the one the training loop waits for) before later batches', then first come,
first served. While the lane is busy the event loop goes on fetching.

``cpu()`` outside an engine (your own ``asyncio.run``) runs the call in the loop's default
executor. The lane is found through a ContextVar that the engine sets for its tasks, and the
priority through another that it sets for each sample (``priority``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import functools
import heapq
import inspect
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

__all__ = [
    "CpuLane",
    "cpu",
    "current",
    "decode_on_lane",
    "default_threads",
    "on_lane",
    "priority",
    "using",
]

T = TypeVar("T")


class _Waiter(Protocol):
    """Who waits for a lane call's outcome: a ``concurrent.futures.Future`` (``submit``) or the
    event loop's future behind a ``_LoopWaiter`` (``schedule``)."""

    def set_running_or_notify_cancel(self) -> bool: ...
    def set_result(self, result: Any) -> None: ...
    def set_exception(self, exception: BaseException | None) -> None: ...
    def cancel(self) -> bool: ...


# (priority, submission order, who waits, the call): the order makes every key unique, so
# waiters are never compared.
_Work = tuple[int, int, _Waiter, Callable[[], Any]]

_LAST = 1 << 62  # the priority of work outside any batch: after every batch's, in order

_lane: contextvars.ContextVar[CpuLane | None] = contextvars.ContextVar(
    "asyncload_cpu_lane", default=None
)
priority: contextvars.ContextVar[int] = contextvars.ContextVar(
    "asyncload_cpu_priority", default=_LAST
)
"""The batch (its send index) the running sample belongs to: lower runs first on the lane."""


def default_threads(num_workers: int) -> int:
    """A worker's share of the cores this process may use: at least one thread."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, num_workers))


async def cpu(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """Run ``fn(*args, **kwargs)`` on the worker's CPU lane and return its result.

    Use it in an ``async def __getitem__`` for the CPU-heavy part of a sample (decoding an
    image, augmenting it, tokenizing a document): the worker's event loop keeps fetching other
    samples meanwhile, the lane runs no more calls at once than the worker's share of the cores,
    and the samples of the batch the training loop waits for go first. Decoders that release
    the GIL (Pillow's, NumPy's, torch's) run in parallel with the loop.

    Outside a DataLoader worker it runs in the event loop's default executor.

    Examples:
        >>> import asyncload, io
        >>> from PIL import Image
        >>> class Photos(asyncload.Dataset):
        ...     def __init__(self, urls):
        ...         self.urls = urls
        ...     def __len__(self):
        ...         return len(self.urls)
        ...     async def __getitem__(self, i):
        ...         data = await asyncload.read(self.urls[i])
        ...         return await asyncload.cpu(decode_and_augment, data)  # doctest: +SKIP
    """
    call = functools.partial(fn, *args, **kwargs) if kwargs else fn
    return await on_lane(call, *(() if kwargs else args))


def on_lane(fn: Callable[..., T], /, *args: Any) -> asyncio.Future[T]:
    """``fn(*args)`` on the running engine's CPU lane (``CpuLane.schedule``), or in the event
    loop's default executor outside one; call it from the loop's thread."""
    lane = _lane.get()
    if lane is None:
        return asyncio.get_running_loop().run_in_executor(None, fn, *args)
    return lane.schedule(fn, *args)


def current() -> CpuLane | None:
    """The running engine's CPU lane (``None`` outside one: the loop's default executor)."""
    return _lane.get()


def decode_on_lane(setting: bool | None) -> bool:
    """Whether a dataset's decoder runs on the lane, given its ``decode_in_thread`` *setting*:
    ``True``/``False`` as said; ``None`` where it is faster than inline, which is where the
    worker has more than one core to itself (a lane of two threads or more).

    Measured with a JPEG decode + crop + flip (``benchmarks/bench_pipeline.py``,
    ``bench_gpu.py --pipeline jpeg``): with one core per worker, a lane thread competes with
    the loop for the core and the GIL, +0.26 ms of CPU per image (974 against 1,104 images/s on
    2 cores and 2 workers); with two per worker, Pillow's decode and resize (which release the
    GIL) run beside the loop, 2,978 against 1,831 images/s on 16 cores and 8 workers.
    """
    if setting is not None:
        return setting
    lane = _lane.get()
    return lane is not None and lane.size >= 2


@contextlib.contextmanager
def using(lane: CpuLane) -> Iterator[CpuLane]:
    """Send ``cpu()`` calls made in this context (and in tasks started from it) to *lane*."""
    token = _lane.set(lane)
    try:
        yield lane
    finally:
        _lane.reset(token)


def _resolve(future: asyncio.Future[Any], result: Any) -> None:
    if not future.done():  # (cancelled while its call ran)
        future.set_result(result)


def _fail(future: asyncio.Future[Any], exception: BaseException) -> None:
    if future.done():
        return
    if isinstance(exception, StopIteration):
        # A future refuses it (TypeError, in a loop callback: the awaiter would wait forever),
        # as a generator turns it into a RuntimeError (PEP 479).
        error = RuntimeError(f"a CPU-lane call raised StopIteration: {exception!r}")
        error.__cause__ = exception
        exception = error
    future.set_exception(exception)


def _cancel(future: asyncio.Future[Any], _: None) -> None:
    future.cancel()


class _LoopWaiter:
    """The event loop's future of a ``schedule``d call, as the lane's threads see it: its outcome
    goes to the loop in one ``call_soon_threadsafe``. (``run_in_executor`` chains a concurrent
    future to an asyncio one, with a lock, a condition and two callbacks per call: a call that
    does nothing cost 39-53 µs of CPU more than inline through it, 13-21 µs this way, on the
    2-core test VM: ``benchmarks/bench_lane.py``.)"""

    __slots__ = ("_future",)

    def __init__(self, future: asyncio.Future[Any]) -> None:
        self._future = future

    def set_running_or_notify_cancel(self) -> bool:
        # Read on a lane thread: a future once cancelled stays so (a cancel after this read
        # lets the call run, and its outcome is dropped: _resolve), and a closed loop closed.
        return not (self._future.cancelled() or self._future.get_loop().is_closed())

    def set_result(self, result: Any) -> None:
        self._post(_resolve, result)

    def set_exception(self, exception: BaseException | None) -> None:
        self._post(_fail, exception)

    def cancel(self) -> bool:
        self._post(_cancel, None)
        return True

    def _post(self, fn: Callable[[asyncio.Future[Any], Any], None], value: Any) -> None:
        try:
            self._future.get_loop().call_soon_threadsafe(fn, self._future, value)
        except RuntimeError:  # the loop is closed: nobody waits for it any more
            pass


class CpuLane(concurrent.futures.Executor):
    """A few threads running calls in order of ``priority``, then of submission.

    Each call runs in the context it was submitted from (as ``asyncio.to_thread`` does), so
    storage notes made inside count for the engine that asked. From the event loop, ``schedule``
    is the cheap way in; ``submit`` is the ``Executor``'s, for any thread.

    Args:
        threads: How many calls may run at once.
        name: The threads' name prefix.

    Examples:
        >>> lane = CpuLane(2, name="example-cpu")
        >>> lane.submit(sum, [1, 2, 3]).result()
        6
        >>> lane.shutdown()
    """

    def __init__(self, threads: int, *, name: str = "asyncload-cpu") -> None:
        if threads < 1:
            raise ValueError(f"a CPU lane needs at least one thread, got {threads}")
        self.size = threads
        self._name = name
        self._work: list[_Work] = []
        self._order = itertools.count()
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._closed = False
        self.running = 0  # calls running now
        self.most = 0  # the most that ran at once
        self.busy_s = 0.0  # CPU seconds its calls used (each thread's own clock)

    def submit(
        self, fn: Callable[..., T], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._queue(future, fn, *args, **kwargs)
        return future

    def schedule(self, fn: Callable[..., T], /, *args: Any) -> asyncio.Future[T]:
        """``fn(*args)`` on the lane, for a caller on the running event loop's thread: a future
        of that loop, resolved there. Cancelling it before the call starts skips the call."""
        if inspect.iscoroutine(fn) or inspect.iscoroutinefunction(fn):
            # As run_in_executor: a thread would only make the coroutine, never run it.
            raise TypeError(f"a coroutine cannot run on a CPU lane, await it instead: {fn!r}")
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._queue(_LoopWaiter(future), fn, *args)
        return future

    def _queue(self, waiter: _Waiter, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> None:
        """Queue ``fn(*args, **kwargs)``, run in a copy of the caller's context, for *waiter*."""
        call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
        with self._cond:
            if self._closed:
                raise RuntimeError("cannot submit to a CPU lane after shutdown")
            item: _Work = (priority.get(), next(self._order), waiter, call)
            heapq.heappush(self._work, item)
            if self._idle:
                self._cond.notify()
            elif len(self._threads) < self.size:
                thread = threading.Thread(
                    target=self._serve, name=f"{self._name}-{len(self._threads)}", daemon=True
                )
                self._threads.append(thread)
                thread.start()

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._work and not self._closed:
                    self._idle += 1
                    self._cond.wait()
                    self._idle -= 1
                if not self._work:  # closed, and nothing left
                    return
                _, _, waiter, call = heapq.heappop(self._work)
                if not waiter.set_running_or_notify_cancel():
                    continue
                self.running += 1
                self.most = max(self.most, self.running)
            began = time.thread_time()
            try:
                result = call()
            except BaseException as exc:
                waiter.set_exception(exc)
            else:
                waiter.set_result(result)
                del result  # a large result is not kept alive by this frame
            finally:
                with self._cond:
                    self.running -= 1
                    self.busy_s += time.thread_time() - began
                del waiter, call

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop taking calls; the threads end once what is queued has run (or was cancelled,
        with *cancel_futures*). A ``schedule``d call's future is cancelled on its loop's thread,
        when that loop next runs; once the loop is closed nothing reaches it."""
        with self._cond:
            self._closed = True
            if cancel_futures:
                for _, _, waiter, _ in self._work:
                    waiter.cancel()
                self._work.clear()
            self._cond.notify_all()
        if wait:
            for thread in self._threads:
                thread.join()
