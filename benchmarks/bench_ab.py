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

Each run checks its first batch's bytes, and which package it imported: a run of another
package than its version's counts as failed. A revision must have ``asyncload.cli.loopback``
and ``LoaderStats.worker_cpu_s`` (the run imports the benchmarks' server and reads the stats
from the version under test). Give an even number of rounds, so that each order runs as often.

Read a difference as real only where the pairs agree more than chance would: 21 wins of 30 has
a one-sided sign test's p of about 0.02, 12 of 18 about 0.12 (2026-11-28, 2-core machine: a
change that won 21 of 30 pairs over S3 gave set medians of 0.94-1.16x in four sets of 6-8).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_wholerun as wholerun
from _children import spawn
from _server import ObjectServerProcess

ROOT = Path(__file__).resolve().parent.parent


# Settings of the loader row that a version's options may not change: what it measures.
FIXED_ROW = ("batch_size", "num_workers", "collate_fn")


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
        "| transport | version | runs | median samples/s | workers' CPU µs/sample | limits at "
        f"the end, summed | over {base}, median of pairs | pairs faster | CPU over {base} |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for transport in dict.fromkeys(t for t, _ in runs):
        per = {name: runs[transport, name] for name in names}
        for name in names:
            done = [r for r in per[name] if r is not None]
            count = f"{len(done)} of {len(per[name])}"
            if not done:
                print(f"| {transport} | {name} | {count} | failed | | | | | |")
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
                f"| {transport} | {name} | {count} | {rate:,.0f} | {cpu:,.0f} | {limit:,.0f} "
                f"| {ratio} | {wins} | {cpu_ratio} |"
            )


def _tagged(kind: str) -> Callable[[str], tuple[str, str]]:
    """An argparse type: the option's value, with which option gave it."""

    def tag(spec: str) -> tuple[str, str]:
        return kind, spec

    return tag


def _run(tree: Path, transport: str, base: str, n: int, options: dict[str, Any]) -> dict[str, Any]:
    """One whole run of the loader row with *tree* first on ``PYTHONPATH``; raises
    ``RuntimeError`` when it failed or ran another package than *tree*'s."""
    environ = dict(os.environ)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(tree), environ.get("PYTHONPATH", "")) if p
    )
    try:
        got = spawn(__file__, transport, base, str(n), json.dumps(options), what="the run")
    except (SystemExit, subprocess.TimeoutExpired, StopIteration) as exc:
        raise RuntimeError(str(exc) or "no result") from exc
    finally:
        os.environ.clear()
        os.environ.update(environ)
    if not Path(got["version"]).resolve().is_relative_to(tree):
        raise RuntimeError(f"ran {got['version']}, not the package under {tree}")
    return got


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
    parser.add_argument(
        "--quick", action="store_true", help="smoke run (without versions: src against itself)"
    )
    parser.add_argument("--json", help="write every run's figures here, after each round")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        transport, base, n, keywords = args.child
        wholerun._child_loader(transport, base, int(n), **json.loads(keywords))
        return 0
    rounds = args.rounds or (1 if args.quick else 8)
    n = args.samples or (128 if args.quick else 4096)
    transports = (args.transports or ("http" if args.quick else "http,s3")).split(",")
    if not set(transports) <= {"http", "s3"}:
        parser.error(f"--transports: http and s3 only, not {args.transports}")
    if "s3" in transports:
        try:
            import obstore  # noqa: F401
        except ImportError:
            print("s3:// runs skipped: obstore is not installed (the `s3` extra)")
            transports.remove("s3")
    options: dict[str, dict[str, Any]] = {}
    for spec in args.options:
        name, eq, text = spec.partition("=")
        try:
            given = json.loads(text) if eq else None
        except json.JSONDecodeError as exc:
            parser.error(f"--options {spec}: {exc}")
        if not isinstance(given, dict) or set(given) & set(FIXED_ROW):
            parser.error(
                f"--options {spec}: give NAME={{JSON object}} of DataLoader keywords other than "
                f"{', '.join(FIXED_ROW)}"
            )
        options[name] = given
    with tempfile.TemporaryDirectory(prefix="asyncload-ab-") as tmp:
        trees: dict[str, Path] = {}
        for kind, spec in args.versions:
            name, eq, where = spec.partition("=")
            if not name or not eq or not where or name in trees:
                parser.error(f"--{kind} {spec}: give NAME={kind.upper()}, each NAME once")
            if kind == "tree":
                trees[name] = Path(where).resolve()
            else:
                (Path(tmp) / name).mkdir()
                try:
                    trees[name] = _export(where, Path(tmp) / name)
                except subprocess.CalledProcessError as exc:
                    parser.error(f"--rev {spec}: {(exc.stderr or b'').decode().strip()}")
        if not trees and args.quick:
            trees = {"a": ROOT / "src", "b": ROOT / "src"}
        if len(trees) < 2:
            parser.error("give two versions or more (--tree, --rev), or --quick alone")
        for name, tree in trees.items():
            if not (tree / "asyncload" / "__init__.py").is_file():
                parser.error(f"{name}: no asyncload package under {tree} (give its src folder)")
        unknown = set(options) - set(trees)
        if unknown:
            parser.error(f"--options for versions not given: {', '.join(sorted(unknown))}")
        names = list(trees)
        runs: dict[tuple[str, str], list[dict[str, Any] | None]] = {
            (t, name): [] for t in transports for name in names
        }
        with ObjectServerProcess() as server:
            for transport in transports:  # the server's first requests are slower: warm it
                _run(trees[names[0]], transport, server.base_url, 256, options.get(names[0], {}))
            for k in range(rounds):
                for transport in transports:
                    # Forward, then reverse: a drift over the round falls on every version.
                    for name in names if k % 2 == 0 else names[::-1]:
                        try:
                            got: dict[str, Any] | None = _run(
                                trees[name], transport, server.base_url, n, options.get(name, {})
                            )
                        except RuntimeError as exc:  # one failed run: say so, keep the rest
                            print(f"round {k}, {name} over {transport}: {exc}", file=sys.stderr)
                            got = None
                        runs[transport, name].append(got)
                if args.json:  # after every round: an interrupted session keeps what it ran
                    meta = {"versions": {k: str(v) for k, v in trees.items()}, "options": options}
                    meta |= {"samples": n, "rounds": k + 1, "transports": transports}
                    by = {t: {m: runs[t, m] for m in names} for t in transports}
                    Path(args.json).write_text(json.dumps({"meta": meta, "runs": by}, indent=1))
    print(
        f"\nWhole runs of the loader row ({n} x 100 KB at 50 ms, 2 workers), {rounds} round(s), "
        f"versions in turn; pairs against {names[0]}:\n"
    )
    _report(runs, names)
    for name in names:
        print(f"{name}: {trees[name]} {json.dumps(options.get(name, {}))}")
    # Every version must have finished a run over every transport, or the table compares little.
    return 0 if all(any(r is not None for r in got) for got in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
