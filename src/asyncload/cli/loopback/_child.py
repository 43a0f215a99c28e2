"""The loopback store in a child process: ``python _child.py [options]`` (``run.build_parser``).

Run as a script, not as ``python -m asyncload.cli.loopback``: importing ``asyncload`` would
import torch, seconds before the child could print its port. So this file loads its own folder
as a top-level package named ``loopback`` (its modules import each other relatively), with the
standard library behind it, and aiohttp or uvloop only where they serve.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load() -> ModuleType:
    """This folder imported as the package ``loopback``."""
    here = Path(__file__).resolve().parent
    # Python put this folder first on sys.path; its modules (web.py, run.py, ...) must not be
    # found as top-level modules by whatever imports a module of the same name.
    if sys.path and Path(sys.path[0] or ".").resolve() == here:
        del sys.path[0]
    spec = importlib.util.spec_from_file_location(
        "loopback", here / "__init__.py", submodule_search_locations=[str(here)]
    )
    assert spec is not None
    assert spec.loader is not None
    package = importlib.util.module_from_spec(spec)
    sys.modules["loopback"] = package
    spec.loader.exec_module(package)
    return package


def main() -> None:
    loopback = load()
    args = loopback.build_parser().parse_args()
    loopback.run_child(loopback.store_from_args(args), fast=args.fast)


if __name__ == "__main__":
    main()
