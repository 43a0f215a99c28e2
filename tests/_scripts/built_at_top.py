"""A loader built at the top level, iterated under the guard (argument: the start method).

The forkserver imports this script again and builds the loader again in its own process; that
copy must start nothing (no second forkserver, no workers). Prints one JSON line: the batches,
and the forkservers among this process's descendants once the loader and its workers are gone.
"""

import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import psutil
from tests._datasets import SyncNumbers

import asyncload

loader = asyncload.DataLoader(
    SyncNumbers(6), batch_size=3, num_workers=1, multiprocessing_context=sys.argv[1]
)

if __name__ == "__main__":
    batches = [b.tolist() for b in loader]
    del loader  # its workers stop (a forked worker's command line is the server's)
    gc.collect()
    time.sleep(0.5)  # what the server's copy of the loader would start, it has started now
    servers = [
        p.pid
        for p in psutil.Process().children(recursive=True)
        if "forkserver import main" in " ".join(p.cmdline())
    ]
    print(json.dumps({"batches": batches, "servers": len(servers)}))
