"""The ``asyncload`` command line's words: every command's options, and how their text becomes
values.

``build_parser`` holds the whole surface, ``asyncload demo``, ``bench`` and ``serve`` with their
options and help; the value types above it read one option each and refuse bad text with a
one-line error (exit status 2, no usage dump). ``--latency`` is in milliseconds in every command
(``50``, ``0.5ms``, or seconds as ``0.05s``); what each command then does with the values is
``asyncload.cli``'s ``main``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import NamedTuple, NoReturn, TypeVar

from .. import __version__
from .bench import OBJECTIVES

__all__ = ["EXIT_USAGE", "Latency", "build_parser", "show_progress"]

EXIT_USAGE = 2
"""The exit status of bad input: an invalid option here, a ``UsageError`` in a command."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad option is one line (and exit status 2), not usage plus error."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _int_at_least(minimum: int, what: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


T = TypeVar("T")

_positive_int = _int_at_least(1, "a positive integer")
_count = _int_at_least(0, "an integer ≥ 0")


def _concurrency(text: str) -> int | None:
    """A ``max_concurrency`` value: a positive integer, or ``auto`` (the default, ``None``)."""
    return None if text.strip().lower() == "auto" else _positive_int(text)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds ≥ 0, got {text!r}")
    return value


class Latency(NamedTuple):
    """A ``--latency`` value: milliseconds, and whether it was the demo's old seconds spelling."""

    ms: float
    old_seconds: bool = False


def _latency(*, bare_below_one_is_seconds: bool) -> Callable[[str], Latency]:
    """Parse ``--latency``: milliseconds (``50``, ``50ms``, ``0.5ms``) or seconds (``0.05s``).

    ``demo --latency`` took seconds before it took milliseconds, so for it a bare number below 1
    written with a decimal point (``0.05``) is still read as seconds, and flagged: no store is
    meant to answer in a twentieth of a millisecond, and ``0.5ms`` says that when it is.

    Examples:
        >>> _latency(bare_below_one_is_seconds=False)("0.5s")
        Latency(ms=500.0, old_seconds=False)
        >>> _latency(bare_below_one_is_seconds=True)("0.5")
        Latency(ms=500.0, old_seconds=True)
    """

    def parse(text: str) -> Latency:
        raw = text.strip().lower()
        unit = "ms" if raw.endswith("ms") else "s" if raw.endswith("s") else ""
        try:
            value = float(raw[: len(raw) - len(unit)])
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected milliseconds (50, 0.5ms) or seconds (0.05s), got {text!r}"
            ) from None
        if not value >= 0 or value == float("inf"):
            raise argparse.ArgumentTypeError(f"expected a finite latency ≥ 0, got {text!r}")
        if unit == "s":
            return Latency(value * 1e3)
        if not unit and bare_below_one_is_seconds and "." in raw and 0 < value < 1:
            return Latency(value * 1e3, old_seconds=True)
        return Latency(value)

    return parse


def _int_list(parse: Callable[[str], T]) -> Callable[[str], tuple[T, ...]]:
    def parse_list(text: str) -> tuple[T, ...]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
        return tuple(parse(t) for t in items)

    return parse_list


def _add_progress(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--progress",
        choices=("auto", "always", "never"),
        default="auto",
        help="progress bar on stderr: auto draws it when stderr is a terminal (default: auto)",
    )


def show_progress(choice: str) -> bool | None:
    """A ``--progress`` choice as the ``progress`` setting of a command's config: ``None`` is
    auto (drawn when stderr is a terminal)."""
    return {"auto": None, "always": True, "never": False}[choice]


def build_parser() -> argparse.ArgumentParser:
    """The ``asyncload`` command's parser, with its ``demo``, ``bench`` and ``serve`` commands."""
    parser = _Parser(
        prog="asyncload",
        description="PyTorch's DataLoader with an event loop in every worker.",
    )
    parser.add_argument("--version", action="version", version=f"asyncload {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    demo = sub.add_parser(
        "demo",
        help="train a small model from a loopback store with asyncload, then with torch's loader",
        description=(
            "Start a loopback object store with a synthetic labelled image dataset (or use "
            "--url), train a small CNN for --steps steps streaming from it with "
            "asyncload.DataLoader, then the same steps with torch.utils.data.DataLoader at the "
            "same worker count, and compare throughput and time spent waiting for data."
        ),
    )
    demo.add_argument(
        "--url",
        help=(
            "a prefix of CIFAR-10 binary records (3,073 bytes each: a label byte, then 3×32×32 "
            "uint8 pixels), one per object: s3://, gs://, az://, file:// or a directory; for "
            "http(s):// a prefix holding manifest.txt, or the manifest's URL"
        ),
    )
    demo.add_argument(
        "--steps", metavar="N", type=_positive_int, default=20, help="training steps (default: 20)"
    )
    demo.add_argument(
        "--batch-size", metavar="N", type=_positive_int, default=32, help="default: 32"
    )
    demo.add_argument(
        "--workers", type=_count, default=2, help="num_workers of both loaders (default: 2)"
    )
    demo.add_argument(
        "--max-concurrency", metavar="N", type=_positive_int, default=64,
        help="asyncload's samples in flight per worker (default: 64)",
    )  # fmt: skip
    demo.add_argument(
        "--latency", metavar="MS", type=_latency(bare_below_one_is_seconds=True), default=None,
        help=(
            "embedded store: milliseconds before each response, or seconds with an s suffix "
            "(0.05s); a bare number below 1 such as 0.05 is the old seconds spelling, still "
            "read as seconds with a warning (default: 50)"
        ),
    )  # fmt: skip
    demo.add_argument(
        "--objects", metavar="N", type=_positive_int, default=None,
        help="embedded store: number of records (default: 1024)",
    )  # fmt: skip
    demo.add_argument(
        "--seed", metavar="N", type=_count, default=0, help="data, order and weights (default: 0)"
    )
    _add_progress(demo)

    bench = sub.add_parser(
        "bench",
        help="sweep max_concurrency and num_workers against a store and recommend a setting",
        description=(
            "Read the objects under URL with asyncload.DataLoader for each max_concurrency and "
            "num_workers, print samples/s, MB/s and fetch latency percentiles per setting, and "
            "recommend a setting for --objective."
        ),
    )
    bench.add_argument(
        "url", metavar="URL_OR_PREFIX",
        help="s3://, gs://, az://, file:// or a directory; http(s):// needs a manifest.txt",
    )  # fmt: skip
    bench.add_argument(
        "--concurrency", metavar="N,N,...", type=_int_list(_concurrency),
        default=(8, 32, 128, 256, None),
        help="max_concurrency values; auto is the default, a limit found while reading "
        "(default: 8,32,128,256,auto)",
    )  # fmt: skip
    bench.add_argument(
        "--workers", metavar="N,N,...", type=_int_list(_count), default=(1, 2),
        help="num_workers values (default: 1,2)",
    )  # fmt: skip
    bench.add_argument(
        "--batch-size", metavar="N", type=_positive_int, default=32, help="default: 32"
    )
    bench.add_argument(
        "--samples", metavar="N", type=_positive_int, default=2000,
        help="samples per setting at most (default: 2000)",
    )  # fmt: skip
    bench.add_argument(
        "--seconds", metavar="SECONDS", type=_seconds, default=10.0,
        help="seconds per setting at most, after start-up (default: 10)",
    )  # fmt: skip
    bench.add_argument(
        "--objective", choices=tuple(OBJECTIVES), default="balanced",
        help="; ".join(f"{k}: {v}" for k, v in OBJECTIVES.items()).replace("%", "%%")
        + " (default: balanced)",
    )  # fmt: skip
    bench.add_argument("--plot", metavar="OUT.png", help="draw samples/s against concurrency")
    _add_progress(bench)

    serve = sub.add_parser(
        "serve",
        help="serve a folder over loopback HTTP with latency, manifest.txt included",
        description=(
            "Serve every file under DIR at http://HOST:PORT/<relative path>, each response "
            "after --latency ms, with a generated manifest.txt listing them (unless DIR has "
            "one), until Ctrl-C. For trying asyncload bench, the examples and your own "
            "datasets without cloud credentials."
        ),
    )
    serve.add_argument("dir", metavar="DIR", help="the folder to serve")
    serve.add_argument(
        "--latency", metavar="MS", type=_latency(bare_below_one_is_seconds=False),
        default=Latency(0.0),
        help=(
            "milliseconds before each response, a storage round trip, or seconds with an s "
            "suffix (default: 0)"
        ),
    )  # fmt: skip
    serve.add_argument(
        "--port", metavar="N", type=_count, default=8000,
        help="TCP port; 0 picks a free one (default: 8000)",
    )  # fmt: skip
    serve.add_argument("--host", default="127.0.0.1", help="address (default: 127.0.0.1)")
    serve.add_argument(
        "--demo-data", metavar="N", type=_positive_int, default=None,
        help="first write N of the demo's records (CIFAR-10 layout) into DIR, for demo --url",
    )  # fmt: skip
    return parser
