"""The examples in the package's docstrings run and show what they say (doctest).

An example that needs a store, a GPU or a worker process is marked ``# doctest: +SKIP``; the
rest run here, so that an example can't drift from the code (one did: the law's throttle in
slow start, which takes the doubling back, still showed the cut to 0.8 of the steady state).
"""

from __future__ import annotations

import doctest
import importlib
import io
import pkgutil

import pytest

import asyncload


def _modules() -> list[str]:
    names = (m.name for m in pkgutil.walk_packages(asyncload.__path__, "asyncload."))
    # Scripts, not modules: importing them runs them.
    return sorted(n for n in names if not n.endswith(("__main__", "._child")))


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples_run(name: str) -> None:
    module = importlib.import_module(name)
    tests = doctest.DocTestFinder().find(module, name, extraglobs={"asyncload": asyncload})
    out = io.StringIO()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in tests:
        runner.run(test, out=out.write)
    assert runner.failures == 0, out.getvalue()
