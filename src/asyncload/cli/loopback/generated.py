"""What a generated object's path means: ``/obj/{size}/{latency}/{index}``.

The body depends only on the index and the size (:func:`object_view`), the latency spec is
drawn per request (:func:`latency_seconds`). Encoding both in the path keeps the store
stateless, so one store serves every scenario of a benchmark run.
"""

from __future__ import annotations

import math
import random

__all__ = ["latency_seconds", "object_bytes", "object_view"]

# Every generated object is a window into one fixed pseudo-random pool, so a response costs a
# slice, not a random-number draw, and bodies differ from index to index (no accidental caching).
_POOL_SIZE = 1 << 22
_STRIDE = 4099  # prime: consecutive indices start at unrelated offsets
_POOL: bytes | None = None


def object_view(index: int, size: int) -> memoryview:
    """The body of generated object *index* of *size* bytes, without a copy.

    Args:
        index: The object's index (the last field of its path).
        size: Its size in bytes.
    """
    global _POOL
    if _POOL is None:
        # Seeded rather than os.urandom: the same bytes in every process, so a client can
        # check what it received without asking the server.
        _POOL = random.Random(20240601).randbytes(_POOL_SIZE + (1 << 20))
    start = (index * _STRIDE) % _POOL_SIZE
    if size <= len(_POOL) - start:
        return memoryview(_POOL)[start : start + size]
    # Larger than the pool's tail: repeat it (objects that big are only used for throughput).
    reps = size // len(_POOL) + 2
    return memoryview(_POOL * reps)[start : start + size]


def object_bytes(index: int, size: int) -> bytes:
    """The body the store sends for generated object *index* of *size* bytes (to check reads).

    Args:
        index: The object's index.
        size: Its size in bytes.
    """
    return bytes(object_view(index, size))


def latency_seconds(spec: str, rng: random.Random) -> float:
    """Seconds for one request, drawn from the latency spec of a generated object's path.

    ``50``: always 50 ms. ``50x10p1``: 50 ms, but 1% of requests take 10x as long.
    ``ln40-400``: log-normal with median 40 ms and 99th percentile 400 ms. Drawn per request,
    so a repeated (hedged) request of the same object gets its own latency, as on S3.

    Args:
        spec: The spec, in milliseconds.
        rng: Where the draws come from.

    Raises:
        ValueError: *spec* is none of these.
    """
    if "x" in spec:
        base, _, rest = spec.partition("x")
        factor, _, percent = rest.partition("p")
        slow = rng.random() * 100 < float(percent)
        return float(base) * (float(factor) if slow else 1.0) / 1e3
    if spec.startswith("ln"):
        median, _, p99 = spec[2:].partition("-")
        sigma = math.log(float(p99) / float(median)) / 2.3263
        return float(median) * math.exp(rng.gauss(0.0, sigma)) / 1e3
    return float(spec) / 1e3
