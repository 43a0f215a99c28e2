"""The package's shape: one layer per package, no upward import, no import circle; and tests/
mirrors it.

Reads every module's imports with ``ast``: function-level and ``TYPE_CHECKING`` imports and
package ``__init__`` files count too (a circle hidden from the interpreter is still one for the
reader). A new top-level package or module needs a line in ``LAYERS``; docs/concepts.md has
the map of the packages.

The mirror: each directory under tests/ is named for a package (``tests/workers/start_method``
for ``_workers/start_method``, the leading underscore dropped), and each test module in it for
a module or subpackage of that package; a few modules that test something larger are listed
in ``EXTRAS`` with their reason, and the whole-library tests at the top in ``WHOLE_LIBRARY``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src" / "asyncload"

# Lower layers never import higher ones; a package and everything under it has one layer.
LAYERS: dict[str, int] = {
    # 0: leaves every layer may use
    "_exceptions": 0,  # every error and warning
    "_redact": 0,
    "_stats": 0,  # the recorder storage calls note into, and LoaderStats
    "_control": 0,  # control laws (the adaptive in-flight limit): pure, the clock passed in
    # 1: storage: read, stream, stat, list over every scheme
    "_storage": 1,
    "sources": 1,  # the public face of _storage.backends
    # 2: datasets and checkpoints, as values
    "_dataset": 2,
    "_checkpoint": 2,
    # 3: the wire between processes; ready datasets
    "_protocol": 3,
    "datasets": 3,
    # 4: what runs inside a worker, and how batches cross to the main process
    "_transfer": 4,
    "_engine": 4,
    # 5: where engines run, and how their processes start and stop
    "_workers": 5,
    # 6: the loader and its passes
    "_loader": 6,
    # 7: the facade and the tools on top
    "__init__": 7,
    "__main__": 7,
    "cli": 7,
}

# Narrower rules inside the table: the engine fetches and collates only (storage comes to it
# through the dataset); a pass talks to its workers through their protocol.
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "_engine": ("_storage", "sources", "_transfer", "_workers"),
    "_protocol": ("_transfer",),
}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, root: Path) -> set[str]:
    """The package modules *path* imports, as names relative to the package."""
    name = module_name(path, root)
    package = name.split(".") if path.name == "__init__.py" and name != "__init__" else []
    if not package:
        package = name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
            target = [*base, *(node.module.split(".") if node.module else [])]
            for alias in node.names:
                sub = [*target, alias.name]
                is_module = (
                    root.joinpath(*sub).with_suffix(".py").exists() or root.joinpath(*sub).is_dir()
                )
                found.add(".".join(sub if is_module else target) or "__init__")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("asyncload"):
            found.add(node.module.removeprefix("asyncload").lstrip(".") or "__init__")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("asyncload"):
                    found.add(alias.name.removeprefix("asyncload").lstrip(".") or "__init__")
    found.discard(name)
    return found


def graph_of(root: Path) -> dict[str, set[str]]:
    return {module_name(p, root): imports_of(p, root) for p in sorted(root.rglob("*.py"))}


def _top(name: str) -> str:
    return name.split(".")[0]


def _parents(name: str) -> list[str]:
    """A module's packages, outermost first: importing ``a.b.c`` runs ``a`` and ``a.b``."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def upward(graph: dict[str, set[str]], module: str) -> list[str]:
    """What *module* imports from a higher layer, or a package it may not use."""
    own = LAYERS[_top(module)]
    bad = sorted(
        dep
        for dep in graph[module]
        if _top(dep) != _top(module) and LAYERS.get(_top(dep), 99) > own
    )
    bad += sorted(d for d in graph[module] if _top(d) in FORBIDDEN.get(_top(module), ()))
    return bad


def circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle, if any. Importing a module runs its packages' ``__init__`` first, so
    an edge to ``a.b.c`` is also an edge to ``a`` and ``a.b``."""
    edges = {
        node: {p for dep in deps for p in [*_parents(dep), dep] if p in graph and p != node}
        for node, deps in graph.items()
    }
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(edges.get(node, ())):
            if node.startswith(dep + "."):  # a package's own __init__ runs before its modules
                continue
            if state.get(dep) == 1:
                return [*path[path.index(dep) :], dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None


GRAPH = graph_of(SRC)


def test_every_package_has_a_layer() -> None:
    missing = sorted({_top(n) for n in GRAPH if _top(n) not in LAYERS})
    assert not missing, f"add these to LAYERS in tests/test_layers.py: {missing}"


def test_the_top_level_stays_small() -> None:
    entries = [
        p.name for p in SRC.iterdir() if not p.name.startswith(".") and p.name != "__pycache__"
    ]
    assert len(entries) <= 20, sorted(entries)


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_no_module_imports_a_higher_layer(module: str) -> None:
    bad = upward(GRAPH, module)
    assert not bad, f"{module} (layer {LAYERS[_top(module)]}) imports {bad}"


def test_no_import_circle() -> None:
    found = circle(GRAPH)
    assert found is None, "import circle: " + " -> ".join(found or [])


def _plant(tmp_path: Path, files: dict[str, str]) -> dict[str, set[str]]:
    root = tmp_path / "asyncload"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return graph_of(root)


def test_the_checks_fail_on_a_planted_upward_import_and_circle(tmp_path: Path) -> None:
    """The reader and the rules themselves: a storage module that imports the loader inside a
    function, and a backend that imports its own package's api (e28034f's ``_s3`` →
    ``_storage``), are both found."""
    graph = _plant(
        tmp_path,
        {
            "__init__.py": "",
            "_loader/__init__.py": "",
            "_loader/loader.py": "X = 1\n",
            "_storage/__init__.py": "",
            "_storage/api.py": "from .backends import s3\n",
            "_storage/backends/__init__.py": "",
            "_storage/backends/s3.py": "def f():\n    from .. import api\n",
            "_storage/cache.py": "def g():\n    from .._loader.loader import X\n",
        },
    )
    assert upward(graph, "_storage.cache") == ["_loader.loader"]
    found = circle(graph)
    assert found is not None
    assert {"_storage.api", "_storage.backends.s3"} <= set(found)


def test_the_layer_test_sees_imports() -> None:
    # Guards the reader itself: a change in how imports are resolved must not make it blind.
    assert "_loader.pass_iterator" in GRAPH["_loader.loader"]
    assert "_workers" in GRAPH["_loader.pass_iterator"]
    assert "_storage.backends.base" in GRAPH["_storage.api"]
    assert "_loader.loader" in GRAPH["__init__"]


# ── tests/ mirrors the packages ─────────────────────────────────────────────────────────────

# Whole-library tests: at the top of tests/, named for no module.
WHOLE_LIBRARY: dict[str, str] = {
    "test_benchmarks.py": "benchmarks/ scripts run with --quick",
    "test_distributed.py": "torchrun and resume in a new process, across the loader's layers",
    "test_docs.py": "the documentation site builds and its examples run",
    "test_docstrings.py": "the examples in every module's docstrings run (doctest)",
    "test_dropin.py": "torch DataLoader behaviours that code swapping in asyncload relies on",
    "test_examples.py": "examples/*.py run to completion",
    "test_exports.py": "the public facade (__init__.py's __all__)",
    "test_layers.py": "the package's shape, and this mirror",
}

# Test modules inside a package's directory that are named for no module of it.
EXTRAS: dict[str, str] = {
    "cli/test_cli.py": "the asyncload command end to end (cli/__init__.py dispatches)",
    "cli/test_loopback_throttle.py": "loopback/store.py's token bucket and line, over HTTP",
    "datasets/test_mix_elastic.py": "_mix.py resumed with other worker or rank counts",
    "datasets/test_tar_elastic.py": "_tar.py resumed with other worker or rank counts",
    "datasets/test_tar_formats.py": "_tar.py over gzip, brace patterns and broken shards",
    "loader/test_autotune.py": "the adaptive default in-flight limit end to end, real workers",
    "sources/test_azure.py": "az:// of _storage/backends/cloud.py, against Azurite",
    "sources/test_gcs.py": "gs:// of _storage/backends/cloud.py, against fake-gcs-server",
    "workers/start_method/test_startup.py": "start-up in the background: a loader's forkserver",
}

# A package whose modules live elsewhere: asyncload.sources is the face of _storage.backends.
MODULES_ALSO_IN: dict[str, str] = {"sources": "_storage/backends"}


def package_of(test_dir: Path, src: Path) -> Path | None:
    """The package a directory of tests mirrors: ``a/b`` is ``src/(_)a/(_)b``, or None."""
    here = src
    for part in test_dir.parts:
        found = [here / n for n in (part, "_" + part) if (here / n / "__init__.py").exists()]
        if not found:
            return None
        here = found[0]
    return here


def _is_test_dir(path: Path) -> bool:
    return path.is_dir() and not path.name.startswith(("_", "."))


def names_in(package: Path, tests_of_package: Path) -> set[str]:
    """The names a test module of *package* may have: ``test_<name>.py`` for its modules, and
    for its subpackages that have no test directory of their own (leading ``_`` dropped)."""
    names: set[str] = set()
    for path in package.iterdir():
        name = path.name.removeprefix("_")
        if path.suffix == ".py" and not path.name.startswith("__"):
            names.add(path.stem.removeprefix("_"))
        elif (path / "__init__.py").exists() and not _is_test_dir(tests_of_package / name):
            names.add(name)
    return names


def mirror_errors(
    tests: Path,
    src: Path,
    extras: dict[str, str],
    also_in: dict[str, str] | None = None,
) -> list[str]:
    """Test directories that mirror no package (or are no package themselves), and test
    modules named for nothing in theirs; *extras* are test modules allowed anyway."""
    errors: list[str] = []
    dirs = [tests, *sorted(p for p in tests.rglob("*") if _is_test_dir(p))]
    for folder in dirs:
        rel = folder.relative_to(tests)
        if any(part.startswith(("_", ".")) for part in rel.parts):
            continue  # helpers: tests/_scripts and what is under it
        where = rel.as_posix() + "/" if rel.parts else ""
        package = package_of(rel, src)
        if package is None:
            errors.append(f"tests/{where}: no package src/asyncload/(_){rel.as_posix()}")
            continue
        if not (folder / "__init__.py").exists():
            errors.append(f"tests/{where}: no __init__.py")
        names = names_in(package, folder)
        for other in (also_in or {}).get(rel.as_posix(), "").split():
            names |= names_in(src / other, folder)
        for module in sorted(folder.glob("test_*.py")):
            key = where + module.name
            if module.stem.removeprefix("test_") not in names and key not in extras:
                errors.append(
                    f"tests/{key}: src/{package.relative_to(src.parent).as_posix()} has no "
                    "module or subpackage of that name: rename it, move it, or list it with "
                    "its reason in tests/test_layers.py (WHOLE_LIBRARY or EXTRAS)"
                )
    return errors


def test_tests_mirror_the_packages() -> None:
    errors = mirror_errors(TESTS, SRC, {**WHOLE_LIBRARY, **EXTRAS}, MODULES_ALSO_IN)
    assert not errors, "\n".join(errors)


def test_every_listed_extra_exists() -> None:
    stale = sorted(k for k in {**WHOLE_LIBRARY, **EXTRAS} if not (TESTS / k).exists())
    assert not stale, f"remove from WHOLE_LIBRARY or EXTRAS in tests/test_layers.py: {stale}"


def test_the_mirror_check_fails_on_misnamed_and_misplaced_tests(tmp_path: Path) -> None:
    """On a planted tree: a misnamed module, a directory for no package, one without
    ``__init__.py``, and a top-level test of a package that has its own directory are found;
    helpers, extras, modules and subpackages named by their test modules are not."""
    files = [
        "src/asyncload/__init__.py",
        "src/asyncload/_redact.py",
        "src/asyncload/_loader/__init__.py",
        "src/asyncload/_loader/loader.py",
        "src/asyncload/_loader/_core.py",
        "src/asyncload/_loader/sub/__init__.py",
        "src/asyncload/_storage/__init__.py",
        "src/asyncload/_storage/backends/__init__.py",
        "src/asyncload/_storage/backends/http.py",
        "src/asyncload/sources/__init__.py",
        "tests/__init__.py",
        "tests/_helpers.py",
        "tests/_scripts/test_not_a_test.py",
        "tests/test_redact.py",
        "tests/test_whole.py",
        "tests/test_loader.py",  # _loader has tests/loader/: its tests go there
        "tests/loader/__init__.py",
        "tests/loader/test_loader.py",
        "tests/loader/test_core.py",
        "tests/loader/test_sub.py",
        "tests/loader/test_extra.py",
        "tests/loader/test_loadr.py",
        "tests/looder/__init__.py",
        "tests/looder/test_loader.py",
        "tests/sources/__init__.py",
        "tests/sources/test_http.py",
        "tests/storage/test_backends.py",
    ]
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    errors = mirror_errors(
        tmp_path / "tests",
        tmp_path / "src" / "asyncload",
        {"test_whole.py": "", "loader/test_extra.py": ""},
        {"sources": "_storage/backends"},
    )
    assert [e.split(":")[0] for e in errors] == [
        "tests/test_loader.py",
        "tests/loader/test_loadr.py",
        "tests/looder/",
        "tests/storage/",
    ]
    assert "no package src/asyncload/(_)looder" in errors[2]
    assert errors[3] == "tests/storage/: no __init__.py"
