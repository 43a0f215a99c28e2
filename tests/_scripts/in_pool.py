"""A loader inside a ``multiprocessing.Pool`` worker: a daemonic process, as in a
hyperparameter search or a data-preparation pool.

Usage: ``in_pool.py METHOD pass`` (two pool workers each run a pass of 2 workers; prints their
batches as JSON) or ``in_pool.py METHOD terminate OUT`` (one pool worker runs a long pass and,
once batches arrive, writes its pid and its descendants' to OUT; this process then terminates
the pool, which SIGTERMs the worker mid-pass, and prints those pids).
"""

from __future__ import annotations

import json
import multiprocessing
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests._guard_datasets import Blocking

import asyncload


def one_pass(_: int) -> list[list[int]]:
    loader = asyncload.DataLoader(Blocking(8, slow=(), delay=0.0), batch_size=4, num_workers=2)
    return [batch.tolist() for batch in loader]


def long_pass(out: str) -> None:
    loader = asyncload.DataLoader(Blocking(10**6, slow=(), delay=0.0), batch_size=4, num_workers=2)
    for k, _ in enumerate(loader):
        if k == 3:
            me = psutil.Process()
            pids = [me.pid] + [p.pid for p in me.children(recursive=True)]
            Path(out).write_text(json.dumps(pids))


if __name__ == "__main__":
    context = multiprocessing.get_context(sys.argv[1])
    if sys.argv[2] == "pass":
        with context.Pool(2) as pool:
            print(json.dumps(pool.map(one_pass, [0, 1])), flush=True)
    else:
        out = Path(sys.argv[3])
        pool = context.Pool(1)
        pending = pool.apply_async(long_pass, (str(out),))
        deadline = time.monotonic() + 60
        while not out.exists() or not out.read_text():
            if pending.ready():
                pending.get()  # raises what the pool worker raised
            assert time.monotonic() < deadline, "no batch within 60 s"
            time.sleep(0.05)
        pool.terminate()
        pool.join()
        print(out.read_text(), flush=True)
