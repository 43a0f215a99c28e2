"""Start-up in the background, observed from a fresh interpreter (tests/test_startup.py).

Usage: python startup.py loader|string|context; prints a JSON line.
"""

import json
import multiprocessing
import sys
import time
from multiprocessing import forkserver

import psutil

import asyncload
from asyncload._context import resolve_context


def main() -> None:

    how = sys.argv[1]
    server = forkserver._forkserver
    out = {}
    if how == "loader":
        loader = asyncload.DataLoader(list(range(8)), num_workers=2)
        deadline = time.monotonic() + 30
        while server._forkserver_pid is None and time.monotonic() < deadline:
            time.sleep(0.01)
        out["started"] = server._forkserver_pid is not None
        del loader
        kids = psutil.Process().children(recursive=True)
        out["others"] = [
            " ".join(p.cmdline())
            for p in kids
            if "forkserver" not in " ".join(p.cmdline())
            and "resource_tracker" not in " ".join(p.cmdline())
        ]
    else:
        requested = "forkserver" if how == "string" else multiprocessing.get_context("forkserver")
        resolve_context(requested)
    out["preload"] = list(server._preload_modules)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
