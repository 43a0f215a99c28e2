"""What a hand-off to a worker's CPU lane and back costs: CPU per call, next to inline.

A worker runs decoders on its CPU lane (``asyncload.cpu``, ``decode_in_thread``) where it has
two cores or more: every sample then crosses from the event loop to a lane thread and back.
This measures that crossing alone, with a call that does nothing, in one process: 128 tasks on
uvloop each awaiting calls until 20,000 have run (``--quick``: 2,000), a lane of 2 threads, three
ways, each round in turn (median of ``--repeat`` rounds):

* ``inline``: the call on the loop's thread, no lane (the floor);
* ``asyncload.cpu``: the lane's ``schedule`` (its outcome goes to the loop's future in one
  ``call_soon_threadsafe``), as a worker's decoders use it;
* ``run_in_executor(lane)``: the same lane as a ``concurrent.futures.Executor``, whose
  future asyncio chains to one of its own (``asyncload.cpu`` until 2026-11-28).

    python benchmarks/bench_lane.py
    python benchmarks/bench_lane.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from typing import Any

import uvloop

import asyncload
from asyncload._dataset import cpu as _cpu

WAYS = ("inline", "asyncload.cpu", "run_in_executor(lane)")
TASKS = 128


def nothing(x: Any) -> Any:
    return x


async def _calls(way: str, n: int) -> tuple[float, float]:
    """*n* calls made *way*: (calls/s, CPU µs per call of this process, lane threads included)."""
    lane = _cpu.CpuLane(2, name="bench-lane")
    loop = asyncio.get_running_loop()
    todo = iter(range(n))

    async def task() -> None:
        for i in todo:
            await asyncio.sleep(0)  # as a sample does between its read and its decode
            if way == "inline":
                nothing(i)
            elif way == "asyncload.cpu":
                await asyncload.cpu(nothing, i)
            else:
                await loop.run_in_executor(lane, nothing, i)

    try:
        with _cpu.using(lane):
            t0, c0 = time.perf_counter(), time.process_time()
            await asyncio.gather(*(task() for _ in range(TASKS)))
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        lane.shutdown()
    return n / wall, cpu * 1e6 / n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 2,000 calls, 1 round")
    parser.add_argument("--repeat", type=int, help="rounds of every way (default 3, --quick 1)")
    args = parser.parse_args(argv)
    n = 2_000 if args.quick else 20_000
    rounds = args.repeat or (1 if args.quick else 3)
    got: dict[str, list[tuple[float, float]]] = {way: [] for way in WAYS}
    for _ in range(rounds):
        for way in WAYS:
            got[way].append(uvloop.run(_calls(way, n)))
    print(
        f"\n{n:,} calls of a function that does nothing, {TASKS} tasks, a lane of 2 threads, "
        f"median of {rounds} round(s)\n"
    )
    print("| way | calls/s | CPU µs per call | CPU over inline µs |")
    print("|---|---|---|---|")
    inline = statistics.median(c for _, c in got["inline"])
    for way in WAYS:
        rate = statistics.median(r for r, _ in got[way])
        cpu = statistics.median(c for _, c in got[way])
        print(f"| {way} | {rate:,.0f} | {cpu:.1f} | {cpu - inline:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
