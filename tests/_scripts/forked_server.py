"""The forkserver forked from the loader's process, observed from a fresh interpreter
(tests/workers/start_method/test_forkserver.py).

Usage: python forked_server.py default|explicit|thread|native|wait [MARKER]; prints a JSON line
(``wait`` prints it, then sleeps until killed).
"""

import gc
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time

import torch

import asyncload
from asyncload._workers.start_method.forkserver import server_pid

SET_BEFORE_THE_LOADER = 0


class Seen(asyncload.Dataset[tuple[int, int]]):
    """Sample i: i, and the script's global as the worker sees it."""

    def __len__(self) -> int:
        return 32

    async def __getitem__(self, index: int) -> tuple[int, int]:
        return index, SET_BEFORE_THE_LOADER


def grandchild() -> None:
    pass


def child() -> None:
    # A process of the script's own, forked from the server, that starts another: it must not
    # find the server's lock held or its start-up function replaced.
    p = multiprocessing.get_context("forkserver").Process(target=grandchild)
    p.start()
    p.join(30)
    sys.exit(p.exitcode)


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def main() -> None:
    global SET_BEFORE_THE_LOADER
    how = sys.argv[1]
    marker = sys.argv[2] if len(sys.argv) > 2 else os.devnull

    def save_checkpoint(*_: object) -> None:  # what a training script's handler might do
        with open(marker, "w") as f:
            f.write("the script's SIGTERM handler ran")

    signal.signal(signal.SIGTERM, save_checkpoint)
    stop = threading.Event()
    if how == "thread":
        threading.Thread(target=stop.wait, name="metrics").start()
    native = os_threads()
    if how == "native":  # torch's CPU pool starts on a large enough product
        torch.randn(512, 512) @ torch.randn(512, 512)
    native = os_threads() - native
    # A subprocess reading its stdin to EOF: closing our end after the fork must still end it.
    reader = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    SET_BEFORE_THE_LOADER = 7
    ctx = "forkserver" if how == "explicit" else None
    loader = asyncload.DataLoader(
        Seen(), batch_size=8, num_workers=2, collate_fn=list, multiprocessing_context=ctx
    )
    stop.set()
    assert reader.stdin is not None
    reader.stdin.close()
    try:
        reader.wait(20)
    except subprocess.TimeoutExpired:
        reader.kill()
        reader.wait()
    samples = [s for batch in loader for s in batch]
    pid = server_pid()
    assert pid is not None
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        server_cmd = f.read().split(b"\0")
    with open("/proc/self/cmdline", "rb") as f:
        own_cmd = f.read().split(b"\0")
    out = {
        "forked": server_cmd == own_cmd,
        "indices": sorted(i for i, _ in samples),
        "global": sorted({g for _, g in samples}),
        "server": pid,
        "native_threads_started": native,
        "reader_saw_eof": reader.returncode == 0,
    }
    if how == "wait":
        # The test kills this process with SIGKILL. A start of the next pass's processes
        # (standby, in a thread) cut off between a semaphore's sem_open() and its REGISTER to
        # the resource tracker leaves it in /dev/shm, a window in CPython's multiprocessing
        # no program can close; so the kill comes once that start has ended.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(
            t.name == "asyncload-standby" for t in threading.enumerate()
        ):
            time.sleep(0.01)
        print(json.dumps(out), flush=True)
        time.sleep(120)
        return
    if how == "default":
        nested = multiprocessing.get_context("forkserver").Process(target=child)
        nested.start()
        nested.join(60)
        out["nested_exitcode"] = nested.exitcode
        if nested.exitcode is None:
            nested.kill()
        del loader  # its next pass's processes go, so only the server is left to signal
        gc.collect()
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        while not (status := os.waitpid(pid, os.WNOHANG)[1]) and time.monotonic() < deadline:
            time.sleep(0.02)
        if not status:  # the signal did not end it
            os.kill(pid, signal.SIGKILL)
            status = os.waitpid(pid, 0)[1]
        out["server_signal"] = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        out["handler_ran"] = os.path.exists(marker)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
