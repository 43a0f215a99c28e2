"""The loopback object store (``asyncload.cli.loopback``) in its own process, for benchmarks.

The store runs in a child process (``python src/asyncload/cli/loopback/_child.py --fast``)
so that its CPU time is not mixed into the client's: a benchmark measures the loader, and on a
2-core machine the server competing for the client's interpreter would skew every ratio. For
the same reason it speaks HTTP through its hand-written front end (``loopback/fast.py``), not
aiohttp.web: a third of the CPU per response.

Objects are generated, not stored: ``GET /obj/{size}/{latency_ms}/{i}`` answers ``size`` bytes
that depend only on ``i`` (:func:`object_bytes`) after sleeping ``latency_ms`` milliseconds (or a
latency drawn from a distribution, see ``loopback.latency_seconds``). Encoding size and latency
in the path keeps the server stateless, so one server serves every scenario of a run and other
benchmark scripts can reuse it. ``GET /count`` answers how many object requests were served
(hedges show up there). ``Range`` and ``HEAD`` are honoured (storage benchmarks need them).

Two stores that push back, off unless asked for (``ObjectServerProcess(throttle=..., queue=...)``),
each per prefix (``/obj/{size}/{latency_ms}``):

* ``throttle=(rate, burst)``: a token bucket of *rate* requests per second with bursts of
  *burst*; a request without a token is answered at once with ``503`` and S3's ``SlowDown``
  XML body, or with ``429`` and ``Retry-After`` (``throttle_status=429, retry_after=1``).
  ``GET /throttled`` answers how many were.
* ``queue=(slots, service_ms)``: after the path's latency, at most *slots* requests are served
  at once, each for *service_ms* more; the others wait in line, so latency grows with the
  number of requests being served once they exceed *slots* (a store with a queue in front).

Usage from a benchmark::

    with ObjectServerProcess() as server:
        url = server.url_for(index=7, size=100_000, latency=0.05)
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from asyncload.cli.loopback import ServerProcess, object_bytes, object_view

__all__ = ["ObjectServerProcess", "object_bytes", "object_view"]


class ObjectServerProcess(ServerProcess):
    """The loopback store of generated objects, in a child process on an ephemeral port.

    Use as a context manager; the child exits when the context closes or when this process
    dies (it watches its stdin).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        *,
        throttle: tuple[float, float] | None = None,
        throttle_status: int = 503,
        retry_after: float | None = None,
        queue: tuple[int, float] | None = None,
        fast: bool = True,
    ) -> None:
        """*throttle* is ``(rate per second, burst)`` per prefix, *queue* ``(slots,
        service_ms)`` per prefix (see the module doc); both off by default. *fast*: the
        hand-written HTTP front end (``loopback/fast.py``), whose lower CPU per response leaves
        more of the machine to the client being measured; ``False``: aiohttp.web."""
        args = ["--generated", "--control"]
        if throttle is not None:
            args += ["--throttle", f"{throttle[0]:g}:{throttle[1]:g}"]
            args += ["--throttle-status", str(throttle_status)]
            if retry_after is not None:
                args += ["--retry-after", f"{retry_after:g}"]
        if queue is not None:
            args += ["--queue", f"{queue[0]}:{queue[1]:g}"]
        super().__init__(args, host=host, fast=fast)

    def prefix(self, size: int, latency: float) -> str:
        """URL prefix of objects of *size* bytes served after *latency* seconds; add ``/{i}``."""
        return f"{self.base_url}/obj/{size}/{latency * 1000:g}"

    def url_for(self, index: int, size: int, latency: float) -> str:
        return f"{self.prefix(size, latency)}/{index}"

    def prefix_spec(self, size: int, spec: str) -> str:
        """Like :meth:`prefix` with a latency distribution (``loopback.latency_seconds``):
        ``"50"``, ``"50x10p1"`` (1% of requests 10x slower), ``"ln40-400"`` (log-normal)."""
        return f"{self.base_url}/obj/{size}/{spec}"

    def requests(self) -> int:
        """Object requests served so far (a blocking GET /count)."""
        return self.count("count")

    def throttled(self) -> int:
        """Requests answered with a throttle so far (a blocking GET /throttled)."""
        return self.count("throttled")

    def cpu(self) -> float:
        """CPU seconds the server process has used so far, from ``/proc`` (nan where there is
        none: psutil is not needed, so that ``bench_gpu.py`` runs without it)."""
        try:
            fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return math.nan
        # utime and stime, fields 14 and 15 of stat(5), counted after the ")" closing the name
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
