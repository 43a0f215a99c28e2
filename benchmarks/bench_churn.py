"""Loaders built and dropped by the thousand, with the machine's cores busy: what stays alive.

Programs build many loaders (a validation loader per evaluation, a loader per test) and drop
them at odd moments. Each loader here is one of: never iterated, one batch then dropped, a
whole epoch, an exception out of the loop; persistent or not; 2 or 4 workers; every other one
in a reference cycle. While it runs, ``--hogs`` processes spin on the CPU. The script samples
the worker processes, asyncload threads, open descriptors, /dev/shm entries and RSS of this
process every few loaders, and prints the baseline, the peaks, what is left once the collector
and the reaper have run, and the tracebacks that reached stderr (a worker's included).

    .venv/bin/python benchmarks/bench_churn.py                   # 2,000 loaders, 2 hogs
    .venv/bin/python benchmarks/bench_churn.py --loaders 200 --hogs 0   # a quick look

``--json PATH`` also writes the figures, and the tracebacks counted, as JSON
(``tests/workers/test_reaper.py`` runs 160 loaders that way).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import psutil
import torch

import asyncload
from asyncload._workers.reaper import reaper
from asyncload._workers.start_method.forkserver import server_pid

WAYS = ("never", "one", "epoch", "raise")
warnings.filterwarnings("ignore", message="This DataLoader will create")  # 4 workers, 2 cores


class Numbers(torch.utils.data.Dataset[int]):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> int:
        return index


def _workers() -> int:
    """Live descendants other than the forkserver and the resource tracker."""
    me = os.getpid()
    count = 0
    for p in psutil.Process(me).children(recursive=True):
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            cmd = " ".join(p.cmdline())
            if p.ppid() == me and (
                p.pid == server_pid() or "forkserver" in cmd or "resource_tracker" in cmd
            ):
                continue
        except psutil.Error:
            continue
        count += 1
    return count


def _shm_names() -> set[str]:
    """multiprocessing's semaphores (``sem.mp-*``) and torch's shared-memory blocks."""
    try:
        return {n for n in os.listdir("/dev/shm") if "mp-" in n or "torch" in n}
    except OSError:
        return set()


def measure() -> dict[str, float]:
    me = psutil.Process()
    return {
        "processes": _workers(),
        "threads": sum(t.name.startswith("asyncload") for t in threading.enumerate()),
        "fds": me.num_fds(),
        "shm": len(_shm_names()),
        "rss_mib": round(me.memory_info().rss / 2**20, 1),
    }


def _in_a_cycle(obj: Any) -> None:
    cycle: list[Any] = [obj]
    cycle.append(cycle)


def one_loader(way: str, workers: int, persistent: bool, cycle: bool) -> None:
    loader = asyncload.DataLoader(
        Numbers(), batch_size=8, num_workers=workers, persistent_workers=persistent
    )
    if way == "one":
        it = iter(loader)
        next(it)
        if cycle:
            _in_a_cycle(it)
        del it
    elif way == "epoch":
        assert sum(len(b) for b in loader) == 64
    elif way == "raise":
        try:
            for _ in loader:
                raise KeyError("the training step failed")
        except KeyError:
            pass
    if cycle:
        _in_a_cycle(loader)


def run(count: int) -> dict[str, Any]:
    one_loader("epoch", 2, False, False)  # the forkserver and resource tracker start here
    gc.collect()
    reaper.drain(30)
    time.sleep(1.0)
    base = measure()
    base_shm = _shm_names()
    peak = dict(base)
    t0 = time.monotonic()
    combos = itertools.cycle(itertools.product(WAYS, (2, 4), (False, True), (False, True)))
    for i, (way, workers, persistent, cycle) in enumerate(itertools.islice(combos, count)):
        one_loader(way, workers, persistent, cycle)
        if i % 4 == 0:
            now = measure()
            peak = {k: max(v, now[k]) for k, v in peak.items()}
    took = time.monotonic() - t0
    deadline = time.monotonic() + 30
    while True:
        # What a program's own collections and the reaper leave, after they have run as often
        # as cleanup takes: a pass the collector found in a cycle is stopped by the reaper,
        # which then drops its objects, and those in a cycle of their own (holding a queue's
        # semaphores, say) wait for the next collection.
        gc.collect()
        reaper.drain(60)
        after = measure()
        settled = after["processes"] <= base["processes"] and after["shm"] <= base["shm"]
        if settled or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return {
        "loaders": count,
        "seconds": round(took, 1),
        "base": base,
        "peak": peak,
        "after": after,
        "shm_left": sorted(_shm_names() - base_shm),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loaders", type=int, default=2000)
    parser.add_argument("--hogs", type=int, default=2, help="CPU-spinning processes meanwhile")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(run(args.loaders)), flush=True)
        return 0
    spin = "import time\nend = time.time() + 3600\nwhile time.time() < end:\n    pass"
    hogs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(args.hogs)]
    try:
        with tempfile.TemporaryFile("w+") as err:
            done = subprocess.run(
                [sys.executable, __file__, "--child", "--loaders", str(args.loaders)],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                timeout=3600,
                check=False,
            )
            err.seek(0)
            stderr = err.read()
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    if done.returncode != 0:
        print(stderr, file=sys.stderr)
        return done.returncode
    out = json.loads(done.stdout.strip().splitlines()[-1])
    # A traceback of a worker or the fork server, or from a finalizer, says something failed.
    out["tracebacks"] = stderr.count("Traceback") + stderr.count("Exception ignored")
    out["stderr_tail"] = stderr[-4000:]
    if args.json:
        Path(args.json).write_text(json.dumps(out))
    print(f"{out['loaders']} loaders in {out['seconds']} s, {args.hogs} CPU hogs")
    print(f"{'':10}" + "".join(f"{k:>11}" for k in out["base"]))
    for row in ("base", "peak", "after"):
        print(f"{row:10}" + "".join(f"{v:>11}" for v in out[row].values()))
    if out["shm_left"]:
        print(f"/dev/shm entries left: {', '.join(out['shm_left'])}")
    print(f"tracebacks on stderr: {out['tracebacks']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
