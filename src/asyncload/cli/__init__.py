"""The ``asyncload`` command: ``asyncload demo``, ``asyncload bench`` and ``asyncload serve``.

``asyncload demo`` shows in under a minute, with nothing to set up, what an event loop per worker
buys over torch's one-request-at-a-time workers. ``asyncload bench URL`` measures a real store
and recommends ``max_concurrency`` and ``num_workers`` for it. ``asyncload serve DIR`` serves a
folder over loopback HTTP with a chosen latency, to try both without cloud credentials.
``--latency`` is in milliseconds in every command (``50``, ``0.5ms``, or seconds as ``0.05s``).

The options and their values are ``parser``'s; here each command's arguments become its config
for ``demo``, ``bench`` or ``serve``, and its outcome an exit status. Bad input (a malformed URL,
nothing under a prefix, an invalid option) prints one line and exits with status 2; a failure
while loading prints one line and exits with 1. Neither prints a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .._exceptions import LoadError
from .._redact import redact_url
from .bench import OBJECTIVES
from .console import UsageError, find_objects
from .parser import EXIT_USAGE, build_parser, show_progress

__all__ = ["main"]

EXIT_FAILURE = 1


def _demo(args: argparse.Namespace) -> int:
    from .demo import DemoConfig, run_demo

    if args.url is not None and (args.latency is not None or args.objects is not None):
        raise UsageError("--latency and --objects set up the embedded store; drop them with --url")
    if args.latency is not None and args.latency.old_seconds:
        print(
            f"asyncload demo: FutureWarning: --latency is in milliseconds now; "
            f"{args.latency.ms / 1e3:g} is read as seconds ({args.latency.ms:g} ms), the old "
            f"unit, until a later release reads it as milliseconds: write --latency "
            f"{args.latency.ms:g} (or {args.latency.ms / 1e3:g}s)",
            file=sys.stderr,
        )
    cfg = DemoConfig(
        url=args.url,
        steps=args.steps,
        batch_size=args.batch_size,
        workers=args.workers,
        max_concurrency=args.max_concurrency,
        latency=0.05 if args.latency is None else args.latency.ms / 1e3,
        objects=1024 if args.objects is None else args.objects,
        seed=args.seed,
        progress=show_progress(args.progress),
    )
    fast, slow, table = run_demo(cfg)
    print(table)
    honest = fast.exact and slow.exact and fast.checksums == slow.checksums
    if not honest:
        print("asyncload demo: the loaders did not deliver the same samples", file=sys.stderr)
        return EXIT_FAILURE
    return 0


def _bench(args: argparse.Namespace) -> int:
    from .bench import (
        BenchConfig,
        backlog_suspects,
        bench_table,
        check_plotting,
        fmt_ms,
        label,
        limit_lines,
        plot,
        recommend,
        run_bench,
        throttle_notes,
    )

    if args.plot:
        check_plotting(args.plot)
    urls = find_objects(args.url)
    cfg = BenchConfig(
        concurrency=args.concurrency,
        workers=args.workers,
        batch_size=args.batch_size,
        samples=args.samples,
        seconds=args.seconds,
        progress=show_progress(args.progress),
    )
    print(
        f"asyncload bench: {len(urls)} objects under {redact_url(args.url)}; up to "
        f"{cfg.samples} samples or {cfg.seconds:g} s per setting",
        file=sys.stderr,
    )
    results = run_bench(urls, cfg)
    print(bench_table(results))
    for line in limit_lines(results) + throttle_notes(results):
        print(line)
    for r in backlog_suspects(results):
        assert r.stats is not None
        print(
            f"note: at num_workers={r.workers}, max_concurrency={label(r.concurrency)} fetch "
            "latencies "
            f"sit at the kernel's SYN retry marks, 1 s, 3 s, 7 s... above the store's own "
            f"(p50 {fmt_ms(r.stats.latency_p50)} ms, p99 {fmt_ms(r.stats.latency_p99)} ms): the "
            "server's listen backlog looks full, and dropped connections wait to be retried. "
            "Raise the server's backlog (python -m http.server's is 5) or lower "
            "max_concurrency; see Troubleshooting in the docs."
        )
    best = recommend(results, args.objective)
    if best is None:
        print("recommended: none (every setting failed)")
        return EXIT_FAILURE
    assert best.stats is not None
    setting = (
        "max_concurrency unset (auto)"
        if best.concurrency is None
        else f"max_concurrency={best.concurrency}"
    )
    print(
        f"recommended: num_workers={best.workers}, {setting} "
        f"({best.samples_per_s:,.0f} samples/s, p50 {fmt_ms(best.stats.latency_p50)} ms; "
        f"objective {args.objective})"
    )
    print(f"  {args.objective}: {OBJECTIVES[args.objective]}")
    if args.plot:
        plot(results, args.plot)
        print(f"plot: {args.plot}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    import asyncio
    from pathlib import Path

    from .demo_server import make_record, object_name
    from .serve import FolderObjects, serve_folder

    root = Path(args.dir)
    if args.demo_data is not None:
        root.mkdir(parents=True, exist_ok=True)
        for i in range(args.demo_data):
            (root / object_name(i)).write_bytes(make_record(i, seed=0))
    objects = FolderObjects(root)
    try:
        asyncio.run(
            serve_folder(objects, latency=args.latency.ms / 1e3, host=args.host, port=args.port)
        )
    except OSError as exc:
        raise UsageError(
            f"can't listen on {args.host}:{args.port}: {exc.strerror or exc}"
        ) from None
    return 0


_COMMANDS = {"demo": _demo, "bench": _bench, "serve": _serve}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``asyncload`` command; returns the exit status (the console script exits with it).

    Args:
        argv: Arguments without the program name; ``sys.argv[1:]`` when ``None``.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return _COMMANDS[args.command](args)
    except UsageError as exc:
        print(f"asyncload {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except LoadError as exc:
        print(f"asyncload {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print(f"asyncload {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
