"""Whether this process's heap serves large blocks from mmap, before and after a loader pass.

Freeing an mmap'd block raises glibc's threshold to its size, so the probe after the pass uses
a larger block than the one before.

Usage: python heap_thresholds.py loader|none; prints a JSON line (tests/workers/test_tuning.py).
"""

import ctypes
import json
import sys

import asyncload


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


def mmapped(size: int) -> bool:
    """Whether glibc serves a fresh block of *size* bytes with mmap (its threshold is lower)."""
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _MallInfo2
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    before = libc.mallinfo2().hblks
    block = libc.malloc(size)
    is_mmapped = libc.mallinfo2().hblks > before
    libc.free(block)
    return bool(is_mmapped)


def main() -> None:
    out = {"before": mmapped(1 << 20)}
    if sys.argv[1] == "loader":
        loader = asyncload.DataLoader(list(range(8)), batch_size=4, num_workers=1)
        out["batches"] = sum(1 for _ in loader)
    out["after"] = mmapped(8 << 20)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
