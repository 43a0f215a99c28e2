"""Start-up mistakes caught in the main process, before a worker dies of them.

* A script without ``if __name__ == "__main__":`` runs its whole body again in every worker
  started with ``spawn`` or ``forkserver`` (they import the main module): refused with Python's own
  "bootstrapping phase" error, in the main process (:func:`check_main_module`), and in a process
  that is re-importing the main module (:func:`refuse_during_bootstrap`).
* A function or class defined only under that guard can't be found by such a worker when it
  unpickles its arguments: :func:`check_main_module` names it.
* ``fork`` after a runtime with threads started (obstore's Tokio runtime, CUDA, the user's own
  threads) hangs the workers: :func:`fork_unsafe_reason` says when, and
  :func:`refuse_main_objects` when no other start method can work either.
"""

from __future__ import annotations

import ast
import functools
import inspect
import multiprocessing.process
import os
import pickle
import sys
import threading
from types import FrameType
from typing import Any

from ..._exceptions import NotPicklable, add_note

__all__ = [
    "check_main_module",
    "fork_unsafe_reason",
    "main_file",
    "refuse_during_bootstrap",
    "refuse_main_objects",
]


_GUARD_HINT = (
    "asyncload: the main module is run again in every worker started with 'spawn' or "
    "'forkserver', so a DataLoader must be created and iterated under "
    "`if __name__ == '__main__':` (or in a function called from there)."
)


def main_file() -> str | None:
    """The main module's file, if a worker could import it (not a notebook, ``-c`` or stdin)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    return path if isinstance(path, str) and os.path.isfile(path) else None


def _bootstrap_error() -> RuntimeError:
    """Python's own "bootstrapping phase" error, with its text (whichever Python this is)."""
    from multiprocessing import spawn

    proc = multiprocessing.process.current_process()
    had = "_inheriting" in vars(proc)
    previous = vars(proc).get("_inheriting")
    proc._inheriting = True  # type: ignore[attr-defined]
    try:
        spawn._check_not_importing_main()  # type: ignore[attr-defined]
    except RuntimeError as exc:
        return RuntimeError(*exc.args)  # raised afresh: a traceback that ends at our caller
    finally:
        if had:
            proc._inheriting = previous  # type: ignore[attr-defined]
        else:
            del proc._inheriting  # type: ignore[attr-defined]
    return RuntimeError(  # pragma: no cover - a Python without the check
        "An attempt has been made to start a new process before the current process has "
        "finished its bootstrapping phase. Use `if __name__ == '__main__':`."
    )


def refuse_during_bootstrap() -> None:
    """Raise Python's bootstrapping error in a process that is re-importing the main module."""
    if getattr(multiprocessing.process.current_process(), "_inheriting", False):
        exc = _bootstrap_error()
        add_note(exc, _GUARD_HINT)
        raise exc


def built_outside_the_guard() -> bool:
    """Whether a loader is being built while this process re-imports the main module, or at
    the main module's top level outside ``if __name__ == "__main__":``.

    Nothing may start before ``iter()`` then: a forkserver would import that script again and
    build the loader again in its own process (``iter()`` raises the error that says so).
    """
    if getattr(multiprocessing.process.current_process(), "_inheriting", False):
        return True
    path, line = main_file(), _module_level_call()
    if path is None or line is None:
        return False
    tree = _parse(path)
    return tree is None or not _guarded(tree.body, line)


# ── the main module's source ──────────────────────────────────────────────────────────────────


def _is_main_test(test: ast.expr) -> bool:
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return False
    if not isinstance(test.ops[0], ast.Eq):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s.id for s in sides if isinstance(s, ast.Name)]
    consts = [s.value for s in sides if isinstance(s, ast.Constant)]
    return names == ["__name__"] and consts == ["__main__"]


def _children(node: ast.stmt) -> list[list[ast.stmt]]:
    blocks = []
    for field in ("body", "orelse", "finalbody"):
        block = getattr(node, field, None)
        if isinstance(block, list) and not isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            blocks.append(block)
    for handler in getattr(node, "handlers", []):
        blocks.append(handler.body)
    return blocks


def _mentions_name(test: ast.expr) -> bool:
    return any(isinstance(n, ast.Name) and n.id == "__name__" for n in ast.walk(test))


def _guarded(body: list[ast.stmt], lineno: int) -> bool:
    """Whether line *lineno* of the module lies under an ``if __name__ == "__main__":``.

    Any ``if`` that tests ``__name__`` counts (``!=``, ``in``, ``else:`` branches): when in
    doubt, the script is taken to be guarded.
    """
    for node in body:
        if not node.lineno <= lineno <= (node.end_lineno or node.lineno):
            continue
        if isinstance(node, ast.If) and _mentions_name(node.test):
            return True
        return any(_guarded(block, lineno) for block in _children(node))
    return False


def _unguarded_names(body: list[ast.stmt]) -> set[str]:
    """Names a re-import of the module defines (everything outside main guards)."""
    names: set[str] = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.For, ast.With)):
            names.update(n.id for n in ast.walk(node) if isinstance(n, ast.Name))
        if isinstance(node, ast.If) and _is_main_test(node.test):
            names |= _unguarded_names(node.orelse)
            continue
        for block in _children(node):
            names |= _unguarded_names(block)
    return names


def _parse(path: str) -> ast.Module | None:
    try:
        return _parse_version(path, os.stat(path).st_mtime_ns)
    except OSError:
        return None


@functools.lru_cache(maxsize=4)
def _parse_version(path: str, mtime_ns: int) -> ast.Module | None:
    # Each pass starts workers anew (without persistent_workers): parse the script once.
    try:
        with open(path, "rb") as f:
            return ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return None


def _module_level_call() -> int | None:
    """The line of the main module's top level that led to this call, if any."""
    namespace = getattr(sys.modules.get("__main__"), "__dict__", None)
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals is namespace:
            return frame.f_lineno
        frame = frame.f_back
    return None


class _MainRefs(pickle.Pickler):
    """Pickles into nothing, noting the classes and functions taken from ``__main__``."""

    def __init__(self) -> None:
        super().__init__(_Discard(), protocol=pickle.HIGHEST_PROTOCOL)
        self.found: dict[str, Any] = {}

    def persistent_id(self, obj: Any) -> None:
        if isinstance(obj, type) or callable(obj):
            if getattr(obj, "__module__", None) == "__main__":
                qualname = getattr(obj, "__qualname__", "")
                if qualname and "<" not in qualname:
                    self.found.setdefault(qualname.split(".")[0], obj)
        return None


class _Discard:
    def write(self, data: bytes) -> int:
        return len(data)


def _main_refs(objects: dict[str, Any]) -> dict[str, str]:
    """``{name in __main__: which argument uses it}`` for the objects sent to workers."""
    refs: dict[str, str] = {}
    for label, obj in objects.items():
        pickler = _MainRefs()
        try:
            pickler.dump(obj)
        except Exception:
            continue  # unpicklable for another reason: diagnose_pickling reports it later
        for name in pickler.found:
            refs.setdefault(name, label)
    return refs


def check_main_module(method: str, objects: dict[str, Any]) -> None:
    """Refuse, in the main process, what would kill ``spawn``/``forkserver`` workers at start-up."""
    if method not in ("spawn", "forkserver"):
        return
    path = main_file()
    if path is None:
        return
    tree = _parse(path)
    if tree is None:
        return
    line = _module_level_call()
    if line is not None and not _guarded(tree.body, line):
        exc = _bootstrap_error()
        add_note(
            exc,
            f"{_GUARD_HINT} The loader was started from line {line} of {path}, outside such a "
            "block: every worker would run the script again (and fail this way).",
        )
        raise exc
    defined = _unguarded_names(tree.body)
    # Pickling the arguments again costs time: only when __main__ has candidates.
    main = sys.modules["__main__"]
    candidates = {
        name
        for name, value in vars(main).items()
        if name not in defined
        and (isinstance(value, type) or inspect.isfunction(value))
        and getattr(value, "__module__", None) == "__main__"
    }
    if not candidates:
        return
    missing = {n: label for n, label in _main_refs(objects).items() if n in candidates}
    if missing:
        listed = ", ".join(f"{n} (used by the {label})" for n, label in sorted(missing.items()))
        raise NotPicklable(
            f"{listed} is defined in {path} only under `if __name__ == '__main__':` or "
            f"not at its top level, so DataLoader workers started with {method!r} (which import "
            f"{os.path.basename(path)} again, without that block) can't find it when they "
            "unpickle their arguments. Define it at the top level of the module, above the "
            "guard, or in a module of its own."
        )


# ── fork after threads ────────────────────────────────────────────────────────────────────────

# Threads of notebook kernels and debuggers: always there, and harmless in a forked worker.
_INFRA_MODULES = ("ipykernel", "IPython", "zmq", "jupyter", "tornado", "debugpy", "pydevd")


def _foreign_threads() -> list[threading.Thread]:
    found = []
    for t in threading.enumerate():
        if t is threading.main_thread() or not t.is_alive():
            continue
        if t.name.startswith("asyncload-"):
            continue  # our own loop thread and pools: a forked worker never touches them
        if type(t).__module__.startswith(_INFRA_MODULES):
            continue
        found.append(t)
    return found


def fork_unsafe_reason() -> str | None:
    """Why forking this process now could hang the child, or ``None``."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA is initialised in this process"
    if "obstore" in sys.modules:
        return "obstore (s3://, gs://, az://) has been used in this process"
    threads = _foreign_threads()
    if threads:
        names = ", ".join(repr(t.name) for t in threads[:3])
        return f"{len(threads)} other thread(s) run in this process ({names})"
    return None


def refuse_main_objects(objects: dict[str, Any], reason: str) -> None:
    """Raise when the workers need something only ``fork`` could give them (see module doc)."""
    refs = _main_refs(objects)
    main = sys.modules.get("__main__")
    bogus_file = getattr(main, "__file__", None) is not None and main_file() is None
    if not refs and not bogus_file:
        return
    if refs:
        listed = ", ".join(f"{n} (used by the {label})" for n, label in sorted(refs.items()))
        what = (
            f"{listed} is defined in __main__ (a notebook or an interactive session), which "
            "workers started another way can't import"
        )
    else:
        what = (
            f"a script read from {main.__file__} can't be run again by workers started another way"  # type: ignore[union-attr]
        )
    raise NotPicklable(
        f"asyncload can't start DataLoader workers: {reason}, so forked workers would hang, and "
        f"{what}. Move the dataset and its functions to a module (a .py file next to the "
        "notebook) and import them; or create and iterate the DataLoader before anything starts "
        "threads or uses s3://, gs:// or az:// in this process; or save the script to a file."
    )
