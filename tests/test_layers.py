"""The package's shape: no module imports a higher layer, and no import circle.

Reads every module's imports with ``ast`` (function-level and ``TYPE_CHECKING`` imports count
too: a circle hidden from the interpreter is still one for the reader). A new module needs a
line in ``LAYERS``; see shared/design.md §5 for the intent of each layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "asyncload"

# Lower layers never import higher ones. A name matches the module and everything under it.
LAYERS: dict[str, int] = {
    # 0: leaves every layer may use
    "_exceptions": 0,
    "_redact": 0,
    "_stats": 0,  # counters the storage layer notes into, and LoaderStats
    "_metrics": 0,
    # 1: values and rules with no I/O
    "_sharding": 1,
    "_resume": 1,
    "_budget": 1,  # the per-sample error budget
    "_fingerprint": 1,  # what a checkpoint depends on
    "_elastic": 1,  # resume across world sizes
    "_elastic_iter": 1,  # iterable datasets re-dealt over other readers
    "_spec": 1,
    "_lookahead": 1,
    "_datapipes": 1,
    "_context": 1,
    "_forkserver": 1,  # the forkserver forked from the loader's process
    "_dataset": 1,
    "_sync": 1,  # coroutines from sync code; knows nothing of what runs on its loop
    "_plain": 1,  # asyncload datasets under torch's own DataLoader
    "_guards": 1,  # start-up mistakes, checked in the main process
    "_watchdog": 1,  # blocked loops, parent death, forgotten awaits
    "_tuning": 1,  # heap and collector thresholds of a loader's processes
    "_shm": 1,
    "_shm_mirror": 1,
    "_shm_pool": 1,  # a worker's BlockPool; _shm re-exports it
    # 2: storage
    "sources": 2,
    "_storage": 2,
    "_storage_config": 2,  # per-prefix options; _storage re-exports it
    "_retry": 2,
    "_hedge": 2,
    "_cache": 2,
    "_cache_dir": 2,
    "_concurrency": 2,  # the adaptive in-flight limit: a pure control law (issue 33)
    # 3: datasets over storage; the wire messages
    "datasets": 3,
    "_protocol": 3,
    # 4: what runs inside a worker, and how batches cross to the main process
    "_queues": 4,
    "_engine": 4,
    "_shipping": 4,
    # 5: where engines run
    "_pin_memory": 5,
    "_worker": 5,
    "_preload": 5,  # imported by the forkserver only
    "_workers": 5,
    # 6: one pass over the data
    "_pass": 6,
    "_dispatch": 6,  # the pass's traffic with its workers: dispatch, reorder, timeout
    # 7: the loader
    "_loader": 7,
    "_checkpoint": 7,  # the loader's state_dict / load_state_dict
    # 8: the facade and the tools on top
    "__init__": 8,
    "__main__": 8,
    "cli": 8,
    "_bench": 8,
    "_console": 8,
    "_demo": 8,
    "_demo_data": 8,  # the demo's records, datasets and embedded store
    "_demo_server": 8,
    "_serve": 8,
}

# Narrower rules inside the table (design.md §5): the engine fetches and collates only; the
# pass talks to workers through their protocol and never sees the loader.
_PASS_MAY_NOT = (
    "_loader",
    "_shm",
    "_shm_pool",
    "_queues",
    "_worker",
    "_context",
    "_storage",
    "_storage_config",
)
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "_engine": (
        "sources",
        "_storage",
        "_storage_config",
        "_retry",
        "_queues",
        "_shm",
        "_shm_pool",
        "_workers",
        "_worker",
    ),
    "_pass": _PASS_MAY_NOT,
    "_dispatch": _PASS_MAY_NOT,
    "_workers": ("_pass", "_loader"),
    "_protocol": ("_shm", "_shm_pool", "_queues"),
}


def _name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """The package modules *path* imports, as names relative to the package."""
    name = _name(path)
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
                is_module = (SRC.joinpath(*sub).with_suffix(".py")).exists() or SRC.joinpath(
                    *sub
                ).is_dir()
                found.add(".".join(sub if is_module else target) or "__init__")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("asyncload"):
            found.add(node.module.removeprefix("asyncload").lstrip(".") or "__init__")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("asyncload"):
                    found.add(alias.name.removeprefix("asyncload").lstrip(".") or "__init__")
    found.discard(name)
    return found


def _top(name: str) -> str:
    return name.split(".")[0]


GRAPH = {_name(p): _imports(p) for p in sorted(SRC.rglob("*.py"))}


def test_every_module_has_a_layer() -> None:
    missing = sorted(n for n in GRAPH if _top(n) not in LAYERS)
    assert not missing, f"add these modules to LAYERS in tests/test_layers.py: {missing}"


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_no_module_imports_a_higher_layer(module: str) -> None:
    own = LAYERS.get(_top(module))
    if own is None:
        pytest.fail(f"{module} has no layer in tests/test_layers.py")
    upward = sorted(
        dep
        for dep in GRAPH[module]
        if _top(dep) != _top(module) and LAYERS.get(_top(dep), 99) > own
    )
    assert not upward, f"{module} (layer {own}) imports higher layers: {upward}"
    banned = sorted(d for d in GRAPH[module] if _top(d) in FORBIDDEN.get(_top(module), ()))
    assert not banned, f"{module} must not import {banned}"


def test_no_import_circle() -> None:
    # Depth-first search over module → module edges; a package counts as its __init__.
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(GRAPH.get(node, ())):
            if dep not in GRAPH:
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

    for start in sorted(GRAPH):
        if start not in state:
            circle = visit(start)
            assert circle is None, "import circle: " + " -> ".join(circle or [])


def test_the_layer_test_sees_imports() -> None:
    # Guards the reader itself: a change in how imports are resolved must not make it blind.
    assert "_pass" in GRAPH["_loader"]
    assert "_workers" in GRAPH["_pass"]
    assert "sources._base" in GRAPH["_storage"]
    assert "_loader" in GRAPH["__init__"]
