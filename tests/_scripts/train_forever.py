"""Iterate a long loader; print the worker pids once the first batch arrived.

With the argument ``epochs``, iterate short epochs for ever instead: each new pass's processes
start in the background during the last one (standby workers). Run by tests/workers/test_stop.py,
which then kills or interrupts this process.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests._datasets import SyncNumbers

import asyncload

if __name__ == "__main__":
    # This is a training program in a terminal, where Ctrl-C raises KeyboardInterrupt. A shell
    # that starts a command in the background without job control (`make test &`, some CI
    # launchers) has it ignore SIGINT, and Python keeps an inherited SIG_IGN: the test would
    # wait for a Ctrl-C that can't arrive.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    epochs = sys.argv[1:] == ["epochs"]
    dataset = SyncNumbers(64 if epochs else 10**6, delay=0.01)
    loader = asyncload.DataLoader(dataset, batch_size=4, num_workers=2)
    it = iter(loader)
    next(it)
    print(" ".join(str(pid) for pid in it.worker_pids), flush=True)
    for _ in it:
        pass
    while epochs:
        for _ in loader:
            pass
