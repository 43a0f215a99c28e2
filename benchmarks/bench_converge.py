"""How fast the default in-flight limit follows a store whose allowance changes (issue 33).

``bench_autotune.py`` (c)'s store and loaders: a token bucket of 2,000 GETs/s per prefix (burst
200) answering ``503`` with S3's ``SlowDown`` body, 10 KB objects after 50 ms, read by TWO
loaders of 2 workers each at once, with default settings. While they read, the store's rate
changes (``GET /throttle-rate/<n>``): 2,000/s for the first 6 s, then 1,000/s, then 2,000/s
again, 6 s each (``--phases``). For the start and for each change, the table gives:

* converged after: the least time after it from which every 2 s window of the phase (sliding
  by 0.1 s; ``--window``) delivered >= 0.9 of the store's rate, with <= 5% of the store's
  answers throttled (the simulated figure of ``tests/control/test_law.py`` (g), end to end,
  where samples count when their batch reaches the training loop); ``never`` if no such time
  leaves a whole window in the phase. Two seconds, where the simulation takes one: at 500/s a
  batch of 32 is 1/16 of a 1 s window, so one batch early or late moves a 1 s window by 6%;
* of which: the same for each condition alone (goodput, throttled share);
* goodput over the phase's last 2 s, as a share of the rate; throttled share over the phase.

Every object arrives exactly once (the children check order and bytes); the loaders stop
after the last phase (``capped``). Target: converged within 3 s of the start and of each
change.

    .venv/bin/python benchmarks/bench_converge.py            # ~25 s
    .venv/bin/python benchmarks/bench_converge.py --quick    # smoke run, ~10 s
    .venv/bin/python benchmarks/bench_converge.py --phases 2000:6,500:6,3000:6
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_autotune import SIZE_CD, THROTTLE, WORKERS, Store, _launch, _wait_line

BATCH = 32
LOADERS = 2
STEP = 0.1
POLL = 0.1  # seconds between two readings of the store's counters
GOAL, MOST_THROTTLED, WITHIN = 0.9, 0.05, 3.0


def _get(store: Store, path: str) -> str:
    with urllib.request.urlopen(f"{store.base_url}/{path}", timeout=10) as resp:
        return str(resp.read().decode())


def _run(store: Store, phases: list[tuple[float, float]], build_s: float) -> dict[str, Any]:
    """Both loaders over the store while its rate follows *phases*; marks and counters."""
    total = sum(d for _, d in phases)
    # More objects than the phases can deliver at their rates: the loaders stop at the cap.
    n = int(sum(r * d for r, d in phases) * 1.5) // LOADERS * LOADERS
    share = n // LOADERS
    base = {
        "scenario": "c",
        "batch": BATCH,
        "size": SIZE_CD,
        "build_s": build_s,
        "cap_s": total,
        "base": store.base_url,
        "prefix": store.prefix(SIZE_CD, 0.05),
        "concurrency": None,
    }
    procs = [_launch({**base, "lo": k * share, "hi": (k + 1) * share}) for k in range(LOADERS)]
    counters: list[tuple[float, int, int]] = []  # (time, requests, throttled)
    changes: list[float] = []
    try:
        for proc in procs:
            if not _wait_line(proc, 120.0).startswith("READY"):
                proc.kill()
                raise SystemExit(f"a loader did not start: {proc.communicate(timeout=30)[1]}")
        _get(store, f"throttle-rate/{phases[0][0]:g}")
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("GO\n")
            proc.stdin.flush()
        t0 = time.time()
        changes.append(t0)
        stop = threading.Event()

        def poll() -> None:
            while not stop.is_set():  # bounded: stopped when the loaders are done
                counters.append((time.time(), store.requests(), store.throttled()))
                stop.wait(POLL)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        at = t0
        for (_, before), (rate, _) in itertools.pairwise(phases):
            at += before
            time.sleep(max(0.0, at - time.time()))
            _get(store, f"throttle-rate/{rate:g}")
            changes.append(time.time())
        results = []
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=total + 120)
            line = next((ln for ln in stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                raise SystemExit(f"a loader died: {stderr.strip()[-400:]}")
            results.append(json.loads(line.removeprefix("RESULT ")))
        stop.set()
        poller.join(10)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
    _get(store, f"throttle-rate/{THROTTLE[0]:g}")
    return {"results": results, "counters": counters, "changes": changes, "end": changes[0] + total}


def _arrivals(results: list[dict[str, Any]]) -> list[tuple[float, int]]:
    """(time, samples) of every batch of both loaders, in time order."""
    out = []
    for got in results:
        prev = 0
        for total, t in got["marks"]:
            out.append((t, int(total) - prev))
            prev = int(total)
    return sorted(out)


def _samples(arrivals: list[tuple[float, int]], lo: float, hi: float) -> int:
    return sum(s for t, s in arrivals if lo <= t < hi)


def _count_at(counters: list[tuple[float, int, int]], t: float) -> tuple[int, int]:
    """The store's (requests, throttled) at the last reading before *t*."""
    last = counters[0]
    for reading in counters:
        if reading[0] > t:
            break
        last = reading
    return last[1], last[2]


def _throttled(counters: list[tuple[float, int, int]], lo: float, hi: float) -> float:
    (r0, t0), (r1, t1) = _count_at(counters, lo), _count_at(counters, hi)
    return (t1 - t0) / (r1 - r0) if r1 > r0 else 0.0


def _settled(windows: list[tuple[float, bool]], start: float) -> float | None:
    """Seconds after *start* from which every window is met; ``None`` if never."""
    for i, (t, _) in enumerate(windows):
        if all(met for _, met in windows[i:]):
            return t - start
    return None


def analyse(
    run: dict[str, Any], phases: list[tuple[float, float]], window: float
) -> list[dict[str, Any]]:
    """One row per phase: its rate, when it converged, its tail goodput and throttled share."""
    arrivals, counters = _arrivals(run["results"]), run["counters"]
    bounds = [*run["changes"], run["end"]]
    rows = []
    for k, (rate, _) in enumerate(phases):
        start, end = bounds[k], bounds[k + 1]
        windows = []  # (start, goodput met, throttled met)
        t = start
        while t + window <= end + 1e-9:
            good = _samples(arrivals, t, t + window) / window >= GOAL * rate
            windows.append((t, good, _throttled(counters, t, t + window) <= MOST_THROTTLED))
            t += STEP
        converged = _settled([(t, g and q) for t, g, q in windows], start)
        goodput_at = _settled([(t, g) for t, g, _ in windows], start)
        throttled_at = _settled([(t, q) for t, _, q in windows], start)
        tail = max(start, end - 2.0)
        rows.append(
            {
                "rate": rate,
                "converged": converged,
                "goodput_at": goodput_at,
                "throttled_at": throttled_at,
                "tail": _samples(arrivals, tail, end) / (end - tail) / rate,
                "throttled": _throttled(counters, start, end),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 2000:3,1000:3")
    parser.add_argument(
        "--phases", help="rate:seconds, ... (default 2000:6,1000:6,2000:6; --quick 2000:3,1000:3)"
    )
    parser.add_argument("--repeat", type=int, default=1, help="runs (each its own table)")
    parser.add_argument("--window", type=float, default=2.0, help="seconds per window (2)")
    parser.add_argument("--build-s", type=float, default=1.0, help="loader built before iter()")
    args = parser.parse_args(argv)
    spec = args.phases or ("2000:3,1000:3" if args.quick else "2000:6,1000:6,2000:6")
    phases = [(float(r), float(s)) for r, s in (p.split(":") for p in spec.split(","))]
    build_s = 0.5 if args.quick else args.build_s
    print(
        f"issue 33: default settings, {LOADERS} loaders of {WORKERS} workers, batch {BATCH}, "
        f"10 KB after 50 ms; the store's rate by phase: "
        + ", ".join(f"{r:,.0f}/s for {s:g} s" for r, s in phases),
        flush=True,
    )
    with Store(throttle=THROTTLE) as store:
        for _ in range(args.repeat):
            run = _run(store, phases, build_s)
            errors = [got["error"] for got in run["results"] if got["error"]]
            bad = sum(got["bad"] for got in run["results"])
            print(
                "\n| phase | store rate | converged after | of which goodput >= 0.9 "
                "| throttled <= 5% | goodput, last 2 s | throttled |"
            )
            print("|---" * 7 + "|")
            verdicts = []
            for k, row in enumerate(analyse(run, phases, args.window)):
                when = "start" if k == 0 else f"change {k}"
                conv = row["converged"]
                cells = [
                    "never" if v is None else f"{v:.1f} s"
                    for v in (conv, row["goodput_at"], row["throttled_at"])
                ]
                print(
                    f"| {when} | {row['rate']:,.0f}/s | {' | '.join(cells)} | {row['tail']:.2f} "
                    f"| {100 * row['throttled']:.1f}% |"
                )
                met = conv is not None and conv <= WITHIN
                verdicts.append(f"target ({when}): converged within {WITHIN:g} s: "
                                + ("met" if met else "MISSED"))  # fmt: skip
            once = "each once" if not bad else f"WRONG ({bad} out of place or corrupt)"
            print(f"objects: {once}; loader errors: {'; '.join(errors) or 'none'}")
            for line in verdicts:
                print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
