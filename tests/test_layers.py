"""The package's shape: one layer per package, no upward import, no import circle.

Reads every module's imports with ``ast``: function-level and ``TYPE_CHECKING`` imports and
package ``__init__`` files count too (a circle hidden from the interpreter is still one for the
reader). A new top-level package or module needs a line in ``LAYERS``; docs/concepts.md has
the map of the packages.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "asyncload"

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
