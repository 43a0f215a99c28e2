"""A worker's watch on the main process: it exits when that process dies, whatever its event
loop is doing (NOTE [ Data flow and shutdown ])."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

__all__ = ["ORPHAN_GRACE", "parent_alive", "watch_parent"]


def parent_alive(main_pid: int, ppid: int) -> bool:
    """Whether the main process *main_pid* lives (our parent *ppid* unchanged, not a zombie)."""
    # Under forkserver our parent is the server, which outlives the main process while any
    # worker lives; so check the main process itself, and count a zombie (dead, not yet reaped
    # by its own parent) as dead.
    if os.getppid() != ppid:
        return False
    try:
        os.kill(main_pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:
        with open(f"/proc/{main_pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no procfs (macOS): the kill() probe above is all we have
    return state not in (b"Z", b"X")


# Once the main process is gone the worker's own shutdown gets this long, then it is cut short.
ORPHAN_GRACE = 2.0
_PR_SET_PDEATHSIG = 1


def _set_pdeathsig() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        pass


# The main process this one watches (watch_parent), once. Per process: the watch thread and
# PR_SET_PDEATHSIG are the process's, and a standby worker starts them before its config comes.
_watching = 0


def watch_parent(main_pid: int, interval: float = 0.25) -> None:
    """Exit this worker process when the main process dies, whatever its event loop does.

    Under ``forkserver`` our parent is the server, which exits with the main process: the kernel
    then kills us at once (``PR_SET_PDEATHSIG``). A thread also polls the main process, and
    ends the process ``ORPHAN_GRACE`` seconds after its death, time for a clean shutdown.
    """
    global _watching
    if _watching == main_pid:  # a standby worker started watching before its config came
        return
    _watching = main_pid
    ppid = os.getppid()
    if sys.platform == "linux" and ppid != main_pid:
        # Only when the parent is the forkserver: under fork the signal would follow the
        # *thread* that started us, which may end long before the main process does.
        _set_pdeathsig()
    if not parent_alive(main_pid, ppid):
        os._exit(0)

    def watch() -> None:
        while parent_alive(main_pid, ppid):
            time.sleep(interval)
        time.sleep(ORPHAN_GRACE)
        os._exit(0)

    threading.Thread(target=watch, name="asyncload-parent-watch", daemon=True).start()
