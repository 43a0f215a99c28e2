"""Start-up in the background, observed from a fresh interpreter
(tests/workers/start_method/test_startup.py).

Usage: python startup.py loader|string|context; prints a JSON line.
"""

import gc
import json
import multiprocessing
import sys
import time
from multiprocessing import forkserver

import psutil

import asyncload
from asyncload._workers.start_method.context import resolve_context


def _command(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:  # exited a moment ago (a zombie until the server reaps it)
        return ""


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
        sum(len(b) for b in loader)  # the preload has run once a worker has
        # What the server imported for every worker: their extension modules are mapped in it.
        with open(f"/proc/{server._forkserver_pid}/maps") as maps:
            mapped = maps.read()
        out["server_has"] = [m for m in ("uvloop", "obstore") if f"/{m}/" in mapped]
        out["main_has_obstore"] = "obstore" in sys.modules  # kept out of it: see _guards
        del loader
        gc.collect()
        # What is left besides the server (forked from here, so its command line is ours, as
        # its workers' are) and the tracker: the dropped loader stops its next pass's standby
        # processes in the background, so they may take a moment to go.
        others = [
            p
            for p in psutil.Process().children(recursive=True)
            if p.pid != server._forkserver_pid and "resource_tracker" not in _command(p)
        ]
        _, alive = psutil.wait_procs(others, timeout=15)
        out["others"] = [" ".join(p.cmdline()) for p in alive]
    else:
        requested = "forkserver" if how == "string" else multiprocessing.get_context("forkserver")
        resolve_context(requested)
    out["preload"] = list(server._preload_modules)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
