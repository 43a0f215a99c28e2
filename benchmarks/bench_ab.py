"""Which of two versions of asyncload is faster: interleaved whole runs, compared in pairs.

On a shared machine the same code's whole runs move by 10-30% between minutes, more than most
changes do, so two versions measured one after the other say little. This script runs
``bench_wholerun.py``'s loader row (4,096 objects of 100 KB at 50 ms, 2 workers, built 2 s
before ``iter()``, each run in a fresh interpreter) under every version in turn, round after
round, in forward and then reverse order, against one loopback server; and compares each
version with the first one *pair by pair* (the runs of one round, a minute apart at most):
the median of the ratios and how many pairs it won, beside the median rates and the workers'
CPU per sample (``loader.stats()``) and their in-flight limits at the end.

A version is a source tree: ``--tree NAME=DIR`` (the folder holding the ``asyncload`` package,
put first on ``PYTHONPATH``) or ``--rev NAME=REV`` (``src/`` of a git revision of this
repository, exported to a temporary folder). ``--options NAME=JSON`` gives a version's loader
keyword arguments (``'{"max_concurrency": 128}'``), so one tree can also be compared with
itself under other settings::

    .venv/bin/python benchmarks/bench_ab.py --rev base=HEAD~1 --tree new=src --rounds 10
    .venv/bin/python benchmarks/bench_ab.py --tree auto=src --tree fixed=src \\
        --options 'fixed={"max_concurrency": 128}'
    .venv/bin/python benchmarks/bench_ab.py --quick      # smoke run: src against itself

Read a difference as real only where most pairs agree (2026-11-28, 2-core machine: a change
that ran faster over S3 in 21 of 30 pairs ran 0.94-1.16x in four sets of 6-8).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_wholerun as wholerun
from _children import result, spawn
from _peers import BUCKET, CREDS
from _server import ObjectServerProcess

ROOT = Path(__file__).resolve().parent.parent


def _child(transport: str, base: str, n: int, options: dict[str, Any]) -> None:
    """One whole run of the loader row with *options*; prints the row's figures."""
    import asyncload

    if transport == "s3":
        asyncload.configure(f"s3://{BUCKET}", endpoint=base, region="us-east-1", credentials=CREDS)
    loader = asyncload.DataLoader(
        asyncload.RemoteFiles(wholerun._urls(transport, base, n)),
        batch_size=wholerun.BATCH,
        num_workers=2,
        collate_fn=list,
        **options,
    )
    time.sleep(wholerun.BUILD_S)  # the user builds the model
    t0 = time.perf_counter()
    seen = sum(len(batch) for batch in loader)
    elapsed = time.perf_counter() - t0
    if seen != n:
        raise AssertionError(f"{seen} samples of {n}")
    stats = loader.stats()
    result(
        rate=n / elapsed,
        cpu_us=stats.worker_cpu_s / n * 1e6,
        limit=sum(stats.concurrency),
        version=asyncload.__file__,
    )


def _export(rev: str, into: Path) -> Path:
    """``src/`` of git revision *rev* of this repository, unpacked under *into*."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "src"], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "src"


def _pairs(
    runs: dict[str, list[dict[str, Any] | None]], base: str, name: str
) -> tuple[list[float], float | None]:
    """The ratios of *name*'s rate to *base*'s in each round both finished; CPU ratio median."""
    rates, cpus = [], []
    for mine, theirs in zip(runs[name], runs[base], strict=True):
        if mine is not None and theirs is not None:
            rates.append(mine["rate"] / theirs["rate"])
            cpus.append(mine["cpu_us"] / theirs["cpu_us"])
    return rates, (statistics.median(cpus) if cpus else None)


def _report(runs: dict[tuple[str, str], list[dict[str, Any] | None]], names: list[str]) -> None:
    base = names[0]
    print(
        "| transport | version | median samples/s | workers' CPU µs/sample | limits at the end, "
        f"summed | over {base}, median of pairs | pairs faster | CPU over {base} |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for transport in dict.fromkeys(t for t, _ in runs):
        per = {name: runs[transport, name] for name in names}
        for name in names:
            done = [r for r in per[name] if r is not None]
            if not done:
                print(f"| {transport} | {name} | failed | | | | | |")
                continue
            rate = statistics.median(r["rate"] for r in done)
            cpu = statistics.median(r["cpu_us"] for r in done)
            limit = statistics.median(r["limit"] for r in done)
            ratio = wins = cpu_ratio = ""
            if name != base:
                rates, cpu_over = _pairs(per, base, name)
                if rates:
                    low, high = min(rates), max(rates)
                    ratio = f"{statistics.median(rates):.3f} ({low:.2f}-{high:.2f})"
                    wins = f"{sum(r > 1 for r in rates)} of {len(rates)}"
                    cpu_ratio = f"{cpu_over:.3f}" if cpu_over is not None else ""
            print(
                f"| {transport} | {name} | {rate:,.0f} | {cpu:,.0f} | {limit:,.0f} | {ratio} "
                f"| {wins} | {cpu_ratio} |"
            )


def _tagged(kind: str) -> Callable[[str], tuple[str, str]]:
    """An argparse type: the option's value, with which option gave it."""

    def tag(spec: str) -> tuple[str, str]:
        return kind, spec

    return tag


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # One list in the command line's order: the first version is what the others are paired with.
    for flag, metavar in (("--tree", "NAME=DIR"), ("--rev", "NAME=REV")):
        parser.add_argument(
            flag,
            action="append",
            dest="versions",
            default=[],
            metavar=metavar,
            type=_tagged(flag[2:]),
        )
    parser.add_argument("--options", action="append", default=[], metavar="NAME=JSON")
    parser.add_argument("--transports", default=None, help="http,s3 (default both; --quick http)")
    parser.add_argument("--rounds", type=int, default=None, help="default 8, --quick 1")
    parser.add_argument("--samples", type=int, default=None, help="default 4096, --quick 128")
    parser.add_argument("--quick", action="store_true", help="smoke run: src against itself")
    parser.add_argument("--json", help="write every run's figures here")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        transport, base, n, options = args.child
        _child(transport, base, int(n), json.loads(options))
        return 0
    rounds = args.rounds or (1 if args.quick else 8)
    n = args.samples or (128 if args.quick else 4096)
    transports = (args.transports or ("http" if args.quick else "http,s3")).split(",")
    options = {k: json.loads(v) for k, _, v in (o.partition("=") for o in args.options)}
    with tempfile.TemporaryDirectory(prefix="asyncload-ab-") as tmp:
        trees: dict[str, Path] = {}
        for kind, spec in args.versions:
            name, _, where = spec.partition("=")
            if kind == "tree":
                trees[name] = Path(where).resolve()
            else:
                (Path(tmp) / name).mkdir()
                trees[name] = _export(where, Path(tmp) / name)
        if not trees:
            if not args.quick:
                parser.error("give two versions or more (--tree, --rev), or --quick")
            trees = {"a": ROOT / "src", "b": ROOT / "src"}
        unknown = set(options) - set(trees)
        if unknown:
            parser.error(f"--options for versions not given: {', '.join(sorted(unknown))}")
        names = list(trees)
        runs: dict[tuple[str, str], list[dict[str, Any] | None]] = {
            (t, name): [] for t in transports for name in names
        }
        environ = dict(os.environ)
        with ObjectServerProcess() as server:
            for transport in transports:  # the server's first requests are slower: warm it
                spawn(__file__, transport, server.base_url, "256", "{}", what="warm-up")
            for k in range(rounds):
                for transport in transports:
                    # Forward, then reverse: a drift over the round falls on every version.
                    for name in names if k % 2 == 0 else names[::-1]:
                        path = [str(trees[name]), environ.get("PYTHONPATH", "")]
                        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
                        try:
                            got: dict[str, Any] | None = spawn(
                                __file__,
                                transport,
                                server.base_url,
                                str(n),
                                json.dumps(options.get(name, {})),
                                what=f"{name} over {transport}",
                            )
                        except SystemExit as exc:  # one failed run: say so, keep the rest
                            print(f"round {k}, {name} over {transport}: {exc}", file=sys.stderr)
                            got = None
                        finally:
                            os.environ.clear()
                            os.environ.update(environ)
                        runs[transport, name].append(got)
    print(
        f"\nWhole runs of the loader row ({n} x 100 KB at 50 ms, 2 workers), {rounds} round(s), "
        f"versions in turn; pairs against {names[0]}:\n"
    )
    _report(runs, names)
    for name in names:  # what each version's children imported, as a check on PYTHONPATH
        ran = next((r for t in transports for r in runs[t, name] if r is not None), None)
        print(f"{name}: {ran['version'] if ran else 'no run finished'}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({f"{t} {name}": got for (t, name), got in runs.items()}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
