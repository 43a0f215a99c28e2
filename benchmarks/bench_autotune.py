"""Requests in flight that tune themselves (issue 33): the default against a sweep of fixed values.

Each scenario runs the loader with ``max_concurrency`` fixed at 4, 8, 16, 32, 64, 128, 256 and
512 (per worker), and once built WITHOUT a ``max_concurrency`` argument: the ``default`` row,
whatever the default is (adaptive once issue 33 lands; a fixed 128 before). The stores are the
loopback object server of ``_server.py`` (its own process, here with a counter of the requests
it holds at once, so the peak in flight at the store is known):

* (a) ``50 ms``: 100 KB objects after a constant 50 ms, ``asyncload.RemoteFiles``, 2 workers,
  batch 32. Target: default >= 0.95 of the best fixed value.
* (b) ``jpeg``: ``bench_pipeline.py``'s photo-like JPEGs (~75 KB) behind the same 50 ms, its
  ``AsyncDecoded`` dataset (``await asyncload.read`` then decode + RandomResizedCrop inline),
  2 workers, batch 64: CPU-bound. Target: default >= 0.95 of the best fixed value.
* (c) ``throttled``: a token bucket of 2,000 GETs/s, burst 200, answering ``503`` with S3's
  ``SlowDown`` body (10 KB objects, 50 ms), read by TWO loaders of 2 workers each at once (two
  processes, disjoint halves of the objects), only the default and 128 unless ``--c-sweep``.
  Targets: goodput >= 0.9 of the limit, <= 2% of requests throttled, no loader fails. A loader
  that raises is recorded (and the row marked failed), not fatal to the benchmark.
* (d) ``queue``: a store whose latency grows with load: 10 KB objects after 20 ms, then at
  most 8 served at once for 5 ms each (``queue=(8, 5)``: 1,600/s, so the knee is at ~40 in
  flight in all, 20 per worker), 2 workers, batch 32. Target: default >= 0.9 of the best fixed
  value with p99 <= 2x the unloaded latency (the p99 of the lowest fixed value, 4: far below
  the knee).

Every row runs in a fresh interpreter (no tuning learnt by another row), its loader built
``--build-s`` (1 s) before ``iter()`` so its workers are up, and is bounded: at most
``--cap-s`` (5 s) of iteration (the slow rows stop there, with what they read checked; 60 s
for (c), which must read every object), a 30 s batch timeout, and a hard timeout on each
process. Columns:

* goodput: samples / seconds from ``iter()`` to the last batch; ``/ best fixed``: over the
  best fixed value's (``/ limit`` in (c)); ``2nd half``: the rate over the second half of the
  samples, after any ramp-up (``-`` where that half came in under 8 batches or in a burst that
  took under a quarter of the run: in-order delivery held it behind a late batch);
* throttled: the server's throttled answers / the requests it got (``GET /throttled``,
  ``GET /count``); req/sample: requests per sample delivered (retries and hedges show here);
* p99: ``loader.stats().latency_p99`` (of the two loaders' worse in (c)); in (d) also over the
  unloaded p99, and ``p99 after 1 s``: the p99 of the samples the workers had reported by the
  last batch, less those they had reported by the first batch delivered after ``SETTLE_S``
  (1 s), so roughly the samples answered after the first second, once the first batches and
  the limit's start are over (the target is the whole run's; this one says how much of it the
  start is);
* peak: the most requests the store held at once during the row (its own count);
* every row checks that each object arrived exactly once and, for (a)/(c)/(d), its bytes.

The default and the best fixed value of the first round run ``--repeat`` times in all (3; 1
with ``--quick``), alternated, and show their median run: the ratio default / best fixed is
the one figure the issue's targets are about. The other fixed values run once.

    .venv/bin/python benchmarks/bench_autotune.py                   # all four, ~5 minutes
    .venv/bin/python benchmarks/bench_autotune.py --quick           # smoke run, ~1 minute
    .venv/bin/python benchmarks/bench_autotune.py --scenarios c,d   # some of them
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_pipeline
from _server import ObjectServerProcess, object_view

import asyncload
from asyncload._stats import loader_stats as _loader_stats
from asyncload.cli import loopback

SWEEP = (4, 8, 16, 32, 64, 128, 256, 512)
WORKERS = 2
SIZE_A = 100_000  # (a)
SIZE_CD = 10_000  # (c), (d): small, so the store, not the client's CPU, is the limit
THROTTLE = (2000.0, 200.0)  # (c): GETs per second, burst
QUEUE = (8, 5.0)  # (d): slots, service ms (1,600/s)
QUEUE_LATENCY = 0.020  # (d): before the line
SETTLE_S = 1.0  # (d): "p99 after 1 s" counts the samples answered after this much of the pass
BATCH_TIMEOUT = 30.0


@dataclass(frozen=True)
class Scenario:
    key: str
    title: str
    loaders: int  # loaders reading at once (each WORKERS workers, its share of the objects)
    batch: int
    target: str


SCENARIOS = {
    "a": Scenario(
        "a", "50 ms store, 100 KB objects, RemoteFiles", 1, 32, "default >= 0.95 of best fixed"
    ),
    "b": Scenario(
        "b",
        "JPEG pipeline (bench_pipeline's AsyncDecoded: read, decode, crop) over the 50 ms store",
        1,
        bench_pipeline.BATCH,
        "default >= 0.95 of best fixed",
    ),
    "c": Scenario(
        "c",
        f"store limited to {THROTTLE[0]:,.0f} GETs/s (burst {THROTTLE[1]:.0f}, 503 SlowDown), "
        f"{SIZE_CD // 1000} KB after 50 ms, TWO loaders of {WORKERS} workers at once",
        2,
        32,
        "goodput >= 0.9 of the limit, throttled <= 2%, nothing fails",
    ),
    "d": Scenario(
        "d",
        f"store whose latency grows with load: {SIZE_CD // 1000} KB after "
        f"{QUEUE_LATENCY * 1000:g} ms, then {QUEUE[0]} served at once for {QUEUE[1]:g} ms each "
        f"({QUEUE[0] * 1000 / QUEUE[1]:,.0f}/s)",
        1,
        32,
        "default >= 0.9 of best fixed with p99 <= 2x unloaded",
    ),
}


# ── the store: _server.py's, and the JPEG corpus ────────────────────────────────────────────


def _serve(argv: list[str]) -> None:
    """The loopback store of ``_server.py``, serving ``bench_pipeline``'s JPEG corpus too."""
    parser = loopback.build_parser()
    parser.add_argument("--files")
    args = parser.parse_args(argv)
    store = loopback.store_from_args(args)
    if args.files:
        files = sorted(p for p in Path(args.files).iterdir() if p.name != "done")
        store.corpora[bench_pipeline.CORPUS_ID["images"]] = [p.read_bytes() for p in files]
    loopback.run_child(store, fast=args.fast)


class Store(ObjectServerProcess):
    """``_server.ObjectServerProcess`` run by this script's ``--serve``: it also serves the
    JPEG corpus in *files* (``/obj/1/...``); the peak of requests in flight is the store's."""

    def __init__(self, *, files: Path | None = None, **kw: Any) -> None:
        super().__init__(**kw)
        if files is not None:
            self._args += ["--files", str(files)]

    start_timeout = 60.0

    def command(self) -> list[str]:
        return [sys.executable, str(Path(__file__).resolve()), "--serve", *self._args]

    def peak(self) -> int:
        """Most object requests held at once since the last call (a blocking GET /peak)."""
        return self.count("peak")


# ── one loader, in its own interpreter ───────────────────────────────────────────────────────


def _child(spec: dict[str, Any]) -> None:
    """Build the loader, say READY, wait for GO on stdin, read; print RESULT (never raises)."""
    lo, hi, scenario = spec["lo"], spec["hi"], spec["scenario"]
    if scenario == "b":
        urls = bench_pipeline._urls("http", spec["base"], "images", "50", hi)[lo:hi]
        dataset: Any = bench_pipeline.AsyncDecoded(urls, bench_pipeline.decode_image)
        collate: Any = None
    else:
        urls = [f"{spec['prefix']}/{i}" for i in range(lo, hi)]
        dataset, collate = asyncload.RemoteFiles(urls), list
    extra = {} if spec["concurrency"] is None else {"max_concurrency": spec["concurrency"]}
    loader = asyncload.DataLoader(
        dataset,
        batch_size=spec["batch"],
        num_workers=WORKERS,
        collate_fn=collate,
        timeout=BATCH_TIMEOUT,
        **extra,
    )
    time.sleep(spec["build_s"])  # the user builds the model; the loader's workers start
    print("READY", flush=True)
    sys.stdin.readline()
    out: dict[str, Any] = {"samples": 0, "bad": 0, "error": None, "capped": False}
    marks: list[tuple[int, float]] = []  # (samples so far, time) per batch
    t0 = time.time()
    settled: list[int] | None = None  # the latency histogram at SETTLE_S
    deadline = time.perf_counter() + spec["cap_s"]
    size = spec.get("size", 0)
    try:
        for batch in loader:
            now = time.time()
            if scenario == "b":
                data, index = batch
                got = index.tolist()
                expect = list(range(lo + out["samples"], lo + out["samples"] + len(got)))
                if got != expect or tuple(data.shape[1:]) != (3, 224, 224):
                    out["bad"] += len(got)
            else:
                got = batch
                for k, blob in enumerate(batch):
                    i = lo + out["samples"] + k
                    view = memoryview(blob)
                    if len(view) != size or view[:64] != object_view(i, size)[:64]:
                        out["bad"] += 1
            out["samples"] += len(got)
            marks.append((out["samples"], now))
            if settled is None and now - t0 >= SETTLE_S:
                settled = _latency_hist(loader)
            if time.perf_counter() > deadline:
                out["capped"] = True
                break
    except Exception as exc:  # a loader that dies is a result here
        out["error"] = f"{type(exc).__name__}: {exc}"[:400]
    out["t0"], out["marks"] = t0, marks
    try:
        stats = loader.stats()
        out |= {
            "p50": stats.latency_p50,
            "p99": stats.latency_p99,
            "retries": sum(stats.retries.values()),
            "hedges": stats.hedges_sent,
            "errors": dict(stats.errors),
        }
        if settled is not None:
            after = [b - a for a, b in zip(settled, _latency_hist(loader), strict=True)]
            out["p99_settled"] = _loader_stats._percentile(after, 0.99) if sum(after) else 0.0
    except Exception as exc:
        out["stats_error"] = f"{type(exc).__name__}: {exc}"[:200]
    print("RESULT " + json.dumps(out), flush=True)


def _latency_hist(loader: Any) -> list[int]:
    """The loader's sample-latency histogram so far, all workers together: private, as the
    windowed p99 it gives is this benchmark's own question (the workers' counters as they rode
    in on their last batch)."""
    hist = [0] * _loader_stats._NUM_BUCKETS
    for snap in loader._tally.snapshots():
        for i, n in enumerate(snap.latency_hist):
            hist[i] += n
    return hist


# ── the driver ────────────────────────────────────────────────────────────────────────────────


@dataclass
class Run:
    """One row's run: what its loaders and the store said."""

    concurrency: int | None
    goodput: float = 0.0
    second_half: float = 0.0
    samples: int = 0
    expected: int = 0
    requests: int = 0
    throttled: int = 0
    peak: int = 0
    p99: float = 0.0
    p99_settled: float = 0.0
    capped: bool = False
    errors: list[str] = field(default_factory=list)
    bad: int = 0
    retries: int = 0
    hedges: int = 0

    @property
    def failed(self) -> bool:
        return bool(self.errors)

    @property
    def throttled_share(self) -> float:
        return self.throttled / self.requests if self.requests else 0.0


def _get(store: Store, path: str) -> int:
    with urllib.request.urlopen(f"{store.base_url}/{path}", timeout=10) as resp:
        return int(resp.read())


def _launch(spec: dict[str, Any]) -> subprocess.Popen[str]:
    # A script file, not ``-c``: the forkserver re-imports __main__ (and its sys.path) from it.
    return subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )


def _wait_line(proc: subprocess.Popen[str], timeout: float) -> str:
    out: list[str] = []
    assert proc.stdout is not None
    stdout = proc.stdout
    reader = threading.Thread(target=lambda: out.append(stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    return out[0] if out else ""


def run_row(
    store: Store, scenario: Scenario, concurrency: int | None, n: int, base: dict[str, Any]
) -> Run:
    """One row: *scenario*'s loaders (fresh interpreters) over *n* objects, read at once."""
    share = n // scenario.loaders
    procs = [
        _launch({**base, "concurrency": concurrency, "lo": k * share, "hi": (k + 1) * share})
        for k in range(scenario.loaders)
    ]
    run = Run(concurrency, expected=share * scenario.loaders)
    results: list[dict[str, Any]] = []
    try:
        for proc in procs:
            if not _wait_line(proc, 120.0).startswith("READY"):
                proc.kill()
                _, err = proc.communicate(timeout=30)
                run.errors.append(f"loader did not start: {err.strip()[-400:]}")
        if run.errors:
            return run
        requests0, throttled0 = store.requests(), store.throttled()
        store.peak()  # resets the peak
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("GO\n")
            proc.stdin.flush()
        for proc in procs:
            try:
                stdout, stderr = proc.communicate(timeout=base["cap_s"] + 120)
            except subprocess.TimeoutExpired:
                proc.kill()
                stdout, stderr = proc.communicate(timeout=30)
                run.errors.append("loader process timed out (killed)")
            line = next((ln for ln in stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                run.errors.append(f"loader process died: {stderr.strip()[-400:]}")
                continue
            results.append(json.loads(line.removeprefix("RESULT ")))
        run.requests = store.requests() - requests0
        run.throttled = store.throttled() - throttled0
        run.peak = store.peak()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
    for got in results:
        run.samples += got["samples"]
        run.bad += got["bad"]
        run.capped |= got["capped"]
        run.p99 = max(run.p99, got.get("p99", 0.0))
        run.p99_settled = max(run.p99_settled, got.get("p99_settled", 0.0))
        run.retries += got.get("retries", 0)
        run.hedges += got.get("hedges", 0)
        if got["error"]:
            run.errors.append(got["error"])
    marks = sorted((t, s) for got in results for s, t in _increments(got["marks"]))
    if results and marks:
        t0 = min(got["t0"] for got in results)
        end = marks[-1][0]
        run.goodput = run.samples / max(end - t0, 1e-9)
        # The second half of the samples: from when half had arrived (all loaders together).
        half, acc, t_half, after = run.samples / 2, 0, end, 0
        for k, (t, s) in enumerate(marks):
            acc += s
            if acc >= half:
                t_half, after = t, len(marks) - k - 1
                break
        # Too few batches after the half mark (a small epoch), or a second half that came in
        # a burst (in-order delivery held it behind a late batch), say nothing about a rate.
        if after >= 8 and end - t_half >= 0.25 * (end - t0):
            run.second_half = (run.samples - acc) / (end - t_half)
    return run


def _increments(marks: list[list[float]]) -> list[tuple[int, float]]:
    """(samples, time) marks of one loader -> (samples in this batch, time) pairs."""
    prev, out = 0, []
    for total, t in marks:
        out.append((int(total) - prev, t))
        prev = int(total)
    return out


def _median(runs: list[Run]) -> Run:
    """The run with the median goodput (its other figures with it)."""
    return sorted(runs, key=lambda r: r.goodput)[len(runs) // 2]


def _label(concurrency: int | None) -> str:
    return "default" if concurrency is None else str(concurrency)


def measure(
    store: Store,
    scenario: Scenario,
    values: list[int],
    n: int,
    repeat: int,
    base: dict[str, Any],
) -> dict[int | None, list[Run]]:
    """Every fixed value once and the default, then the default and the best fixed value
    again, alternated, until each has *repeat* runs."""
    runs: dict[int | None, list[Run]] = {}
    for concurrency in [*values, None]:
        run = run_row(store, scenario, concurrency, n, base)
        runs[concurrency] = [run]
        _progress(scenario, run)
    fixed = [c for c in values if not runs[c][0].failed]
    best = max(fixed, key=lambda c: runs[c][0].goodput) if fixed else None
    again: list[int | None] = [None] if scenario.key == "c" or best is None else [best, None]
    for _ in range(repeat - 1):
        for concurrency in again:
            run = run_row(store, scenario, concurrency, n, base)
            runs[concurrency].append(run)
            _progress(scenario, run)
    return runs


def _progress(scenario: Scenario, run: Run) -> None:
    failed = f", FAILED: {run.errors[0][:120]}" if run.failed else ""
    print(
        f"  ({scenario.key}) {_label(run.concurrency):>7}: {run.goodput:7,.0f}/s, "
        f"p99 {run.p99 * 1000:5.0f} ms, peak {run.peak}, "
        f"throttled {100 * run.throttled_share:.1f}%{failed}",
        flush=True,
    )


def _objects(run: Run) -> str:
    """What the exactly-once check found."""
    if run.bad:
        return f"WRONG ({run.bad} out of place or corrupt)"
    if run.samples == run.expected:
        return "all once"
    why = "capped" if run.capped and not run.failed else "failed"
    # The children check order and bytes: what arrived is a clean prefix of each share.
    return f"{run.samples:,} of {run.expected:,}, each once ({why})"


def _print(scenario: Scenario, runs: dict[int | None, list[Run]], extra: str) -> list[str]:
    """The scenario's table, then its target lines (returned, for the summary)."""
    med = {c: _median(r) for c, r in runs.items()}
    fixed = [r.goodput for c, r in med.items() if c is not None and not r.failed]
    best = THROTTLE[0] if scenario.key == "c" else max(fixed, default=0.0)
    unloaded = _unloaded(med)
    print(f"\n({scenario.key}) {scenario.title}; {extra}")
    vs = "/ limit" if scenario.key == "c" else "/ best fixed"
    p99x = " p99 / unloaded | p99 after 1 s, ms |" if scenario.key == "d" else ""
    print(
        f"| max_concurrency | runs | goodput/s | {vs} | 2nd half/s | throttled | req/sample "
        f"| p99 ms |{p99x} peak in flight | objects | failed |"
    )
    print("|---" * (11 + 2 * bool(p99x)) + "|")
    for c, run in med.items():
        per = run.requests / run.samples if run.samples else 0.0
        half = f"{run.second_half:,.0f}" if run.second_half else "-"
        ratio = f"{run.goodput / best:.2f}" if best else "-"
        cell = f" {run.p99 / unloaded:.1f} |" if p99x and unloaded else (" - |" if p99x else "")
        if p99x:
            cell += f" {run.p99_settled * 1000:.0f} |" if run.p99_settled else " - |"
        print(
            f"| {_label(c)} | {len(runs[c])} | {run.goodput:,.0f} | {ratio} | {half} "
            f"| {100 * run.throttled_share:.1f}% | {per:.2f} | {run.p99 * 1000:.0f} |{cell} "
            f"{run.peak} | {_objects(run)} "
            f"| {'; '.join(run.errors)[:200] if run.failed else 'no'} |"
        )
    return _targets(scenario, med)


def _unloaded(med: dict[int | None, Run]) -> float:
    """p99 of the lowest fixed value that ran (the store unloaded), 0.0 if none."""
    fixed = [c for c, r in med.items() if c is not None and not r.failed and r.p99]
    return med[min(fixed)].p99 if fixed else 0.0


def _targets(scenario: Scenario, med: dict[int | None, Run]) -> list[str]:
    default = med.get(None)
    if default is None:
        return []
    fixed = {c: r for c, r in med.items() if c is not None and not r.failed}
    lines: list[str] = []

    def verdict(ok: bool) -> str:
        return "met" if ok else "MISSED"

    if scenario.key == "c":
        limit = THROTTLE[0]
        share = default.throttled_share
        once = default.bad == 0 and default.samples == default.expected
        ok = default.goodput >= 0.9 * limit and share <= 0.02 and not default.failed and once
        lines.append(
            f"target (c): default goodput {default.goodput:,.0f}/s = "
            f"{default.goodput / limit:.2f} of the limit (>= 0.9), throttled "
            f"{100 * share:.1f}% (<= 2%), failed: {'yes' if default.failed else 'no'}, "
            f"objects: {_objects(default)}: {verdict(ok)}"
        )
        for c, run in med.items():
            if c is not None:
                lines.append(
                    f"  for comparison, fixed {c}: {run.goodput / limit:.2f} of the limit, "
                    f"throttled {100 * run.throttled_share:.1f}%, "
                    f"failed: {'yes' if run.failed else 'no'}"
                )
    elif fixed:
        best = max(fixed, key=lambda c: fixed[c].goodput)
        ratio = default.goodput / fixed[best].goodput
        goal = 0.95 if scenario.key in ("a", "b") else 0.9
        text = f"target ({scenario.key}): default / best fixed ({best}) = {ratio:.2f}"
        if default.second_half and fixed[best].second_half:
            text += f" (2nd half {default.second_half / fixed[best].second_half:.2f})"
        text += f", >= {goal}"
        ok = ratio >= goal and not default.failed
        if scenario.key == "d":
            low = min(fixed)
            unloaded = _unloaded(med)
            text += (
                f"; p99 {default.p99 * 1000:.0f} ms = {default.p99 / unloaded:.2f}x unloaded "
                f"(p99 of the {low} row, {unloaded * 1000:.0f} ms; <= 2x)"
            )
            if default.p99_settled:
                text += (
                    f"; after the first {SETTLE_S:g} s p99 {default.p99_settled * 1000:.0f} ms = "
                    f"{default.p99_settled / unloaded:.2f}x"
                )
            ok = ok and default.p99 <= 2 * unloaded
            within = [c for c in fixed if fixed[c].p99 <= 2 * unloaded]
            if within:
                top = max(within, key=lambda c: fixed[c].goodput)
                text += (
                    f"; best fixed within 2x: {top} "
                    f"({fixed[top].goodput / fixed[best].goodput:.2f} of best)"
                )
        lines.append(f"{text}: {verdict(ok)}")
    for line in lines:
        print(line)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run (~1 minute)")
    parser.add_argument("--scenarios", default="a,b,c,d", help="which of a,b,c,d (default all)")
    parser.add_argument(
        "--sweep", help=f"fixed max_concurrency values (default {','.join(map(str, SWEEP))})"
    )
    parser.add_argument("--c-sweep", action="store_true", help="(c): the whole sweep, not 128")
    parser.add_argument("--repeat", type=int, help="runs of default and best (3; --quick 1)")
    parser.add_argument("--samples", type=int, help="objects per row (a, c, d; b: the corpus)")
    parser.add_argument("--cap-s", type=float, help="seconds of iteration per row, at most")
    parser.add_argument("--build-s", type=float, help="loader built before iter() (1 s)")
    parser.add_argument("--json", help="write every run's figures here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args(argv)
    if "--serve" in rest:
        rest.remove("--serve")
        _serve(rest)
        return 0
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.child:
        _child(json.loads(args.child))
        return 0
    keys = [k for k in args.scenarios.split(",") if k]
    unknown = set(keys) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}; known: a,b,c,d")
    sweep = [int(c) for c in args.sweep.split(",")] if args.sweep else list(SWEEP)
    if args.quick and not args.sweep:
        sweep = [8, 32, 128]
    repeat = args.repeat or (1 if args.quick else 3)
    cap_s = args.cap_s or (2.0 if args.quick else 5.0)
    build_s = args.build_s if args.build_s is not None else (0.5 if args.quick else 1.0)
    samples = {
        "a": args.samples or (1000 if args.quick else 10000),
        "b": args.samples or (128 if args.quick else 2048),
        "c": args.samples or (2000 if args.quick else 8000),
        "d": args.samples or (1000 if args.quick else 6000),
    }
    common = {"build_s": build_s, "cap_s": cap_s}
    load0 = os.getloadavg()
    t_start = time.perf_counter()
    print(
        f"issue 33: fixed max_concurrency {sweep} per worker vs the default, {WORKERS} workers "
        f"per loader; default and best fixed: median of {repeat} run(s); "
        f"{os.cpu_count()} CPUs, load {load0[0]:.2f}",
        flush=True,
    )
    summary: list[str] = []
    dump: dict[str, Any] = {}
    for key in keys:
        scenario = SCENARIOS[key]
        n = samples[key]
        if key in ("a", "b"):
            root = Path(tempfile.gettempdir()) / "asyncload-bench-pipeline"
            files = bench_pipeline.ensure_corpus(root, "images", n) if key == "b" else None
            store = Store(files=files)
            prefix_size, latency = SIZE_A, 0.05
            extra = f"{WORKERS} workers, batch {scenario.batch}"
        elif key == "c":
            store = Store(throttle=THROTTLE)
            prefix_size, latency = SIZE_CD, 0.05
            extra = f"each loader {WORKERS} workers, batch {scenario.batch}, half the objects"
        else:
            store = Store(queue=QUEUE)
            prefix_size, latency = SIZE_CD, QUEUE_LATENCY
            extra = f"{WORKERS} workers, batch {scenario.batch}"
        values = sweep if key != "c" or args.c_sweep else [128]
        base = {
            **common,
            "scenario": key,
            "batch": scenario.batch,
            "size": prefix_size,
            "cap_s": cap_s if key != "c" else max(cap_s, 60.0),
        }
        print(f"({key}) {scenario.title}: {n} objects per row", flush=True)
        with store:
            base |= {"base": store.base_url, "prefix": store.prefix(prefix_size, latency)}
            runs = measure(store, scenario, values, n, repeat, base)
        extra += f", {n} objects per row (at most {base['cap_s']:g} s)"
        summary += _print(scenario, runs, extra)
        dump[key] = {_label(c): [vars(r) for r in rs] for c, rs in runs.items()}
    load1 = os.getloadavg()
    print(
        f"\nTargets (issue 33); {time.perf_counter() - t_start:.0f} s in all, "
        f"load {load0[0]:.2f} before, {load1[0]:.2f} after"
    )
    for line in summary:
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(dump, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
