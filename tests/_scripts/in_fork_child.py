"""A loader built and iterated here, then used in a child made by ``os.fork()`` (a
fork-context ``Process``), as a program that forks after building its loaders does.

Usage: ``in_fork_child.py persistent|plain``. Prints one JSON object: the parent's pass
before the child, the child's pass, what ``next()`` on the parent's live iterator raised in
the child, the child's exit code, and the parent's pass after the child.
"""

from __future__ import annotations

import json
import multiprocessing
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests._guard_datasets import Blocking

import asyncload


def child(loader: Any, live: Any, out: Any) -> None:
    try:
        next(live)
        stolen = "no error"
    except RuntimeError as exc:
        stolen = str(exc)
    out.put({"child": [b.tolist() for b in loader], "stolen": stolen})


if __name__ == "__main__":
    loader = asyncload.DataLoader(
        Blocking(16, slow=(), delay=0.0),
        batch_size=4,
        num_workers=2,
        persistent_workers=sys.argv[1] == "persistent",
    )
    before = [b.tolist() for b in loader]
    live = iter(loader)
    first = next(live).tolist()
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    proc = context.Process(target=child, args=(loader, live, out))
    proc.start()
    got = out.get(timeout=60)
    proc.join(30)
    rest = [b.tolist() for b in live]  # the parent's workers still serve the parent
    after = [b.tolist() for b in loader]
    print(
        json.dumps(
            {
                "before": before,
                "live": [first, *rest],
                **got,
                "exitcode": proc.exitcode,
                "after": after,
            }
        ),
        flush=True,
    )
