"""Which processes a test left behind: workers count, the shared forkserver and tracker don't."""

from __future__ import annotations

import os

import psutil


def _is_helper(p: psutil.Process, me: int) -> bool:
    """multiprocessing's forkserver and resource tracker live for the whole test session."""
    try:
        cmd = " ".join(p.cmdline())
        return p.ppid() == me and ("forkserver" in cmd or "resource_tracker" in cmd)
    except psutil.Error:
        return True


def worker_processes() -> list[psutil.Process]:
    """Live descendants of this process other than the forkserver and resource tracker.

    Workers started by the forkserver are its children, so they are found through it.
    """
    me = os.getpid()
    found = []
    for p in psutil.Process(me).children(recursive=True):
        try:
            if _is_helper(p, me) or p.status() == psutil.STATUS_ZOMBIE:
                continue
        except psutil.Error:
            continue
        found.append(p)
    return found
