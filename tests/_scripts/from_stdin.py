"""Run as `python - < from_stdin.py [threads]`: __main__.__file__ is "<stdin>", not a file."""

import sys
import threading

sys.path.insert(0, sys.argv[1])

from tests._datasets import SyncNumbers

import asyncload

if "threads" in sys.argv:
    stop = threading.Event()
    threading.Thread(target=stop.wait, name="user-thread", daemon=True).start()
loader = asyncload.DataLoader(SyncNumbers(6), batch_size=3, num_workers=1)
print([b.tolist() for b in loader])
