"""Choosing the start method for worker processes, and explaining pickling failures.

asyncload starts workers with ``forkserver`` by default on Linux (and ``spawn`` elsewhere):

* a forked child inherits the parent's threads' locks but not the threads. Async clients with a
  background runtime (obstore's Tokio runtime among them) and CUDA hang in such a child; so does
  any library holding a lock at fork time. ``forkserver`` forks from a clean server process.
* it is Python 3.14's default on Linux, so code written for it keeps working.
* the forkserver preloads torch and asyncload once (and uvloop and obstore, see
``start_method.preload``),
  so each worker starts in milliseconds
  rather than re-importing torch as ``spawn`` would. That holds however the start method is
  named (default, ``"forkserver"``, or a context object), and ``start_early`` starts the
  forkserver as soon as a loader exists: forked from this process when that is safe
  (``start_method.forkserver``, default start method only), else afresh in the background, so that
  the one-time import overlaps the user's model building instead of delaying the first batch.

In an interactive session ``__main__`` has no file, so functions and classes defined there can't
be found by a worker that didn't fork from it: asyncload then falls back to ``fork`` and warns
once. ``multiprocessing_context="fork"`` asks for fork explicitly.
"""

from __future__ import annotations

import multiprocessing
import pickle
import threading
import warnings
from multiprocessing.context import BaseContext
from typing import Any

from ..._exceptions import AsyncloadWarning, NotPicklable, user_stacklevel
from . import forkserver as _forkserver
from . import guards as _guards

__all__ = [
    "AsyncloadWarning",
    "diagnose_pickling",
    "early_context",
    "find_unpicklable",
    "resolve_context",
    "start_early",
]


# Per process: the fall-back to 'fork' in a notebook warns once per process, not per loader.
_warned_interactive = False


def _interactive() -> bool:
    """No file a worker could re-import ``__main__`` from: a notebook, the REPL, ``-c``, stdin."""
    return _guards.main_file() is None


def resolve_context(requested: Any, objects: dict[str, Any] | None = None) -> BaseContext:
    """Return the multiprocessing context workers are started with.

    *objects* (dataset, collate_fn, worker_init_fn) are checked against the start method: an
    unguarded script, or functions only defined under ``if __name__ == "__main__":``, fail here
    with the reason rather than in the worker (see :mod:`._guards`).
    """
    _guards.refuse_during_bootstrap()
    ctx = _choose(requested, objects or {})
    _guards.check_main_module(ctx.get_start_method(), objects or {})
    return ctx


def _choose(requested: Any, objects: dict[str, Any]) -> BaseContext:
    global _warned_interactive
    if requested is not None:
        ctx = _named(requested)
        if ctx.get_start_method() == "forkserver":
            _preload(ctx)  # an explicit forkserver deserves the preloaded torch too
        return ctx
    methods = multiprocessing.get_all_start_methods()
    if "forkserver" not in methods:
        return multiprocessing.get_context("spawn")
    if _interactive() and "fork" in methods:
        unsafe = _guards.fork_unsafe_reason()
        if unsafe is None:
            if not _warned_interactive:
                _warned_interactive = True
                warnings.warn(
                    "asyncload: __main__ has no file (notebook, REPL or stdin), so workers are "
                    "started with 'fork' instead of 'forkserver'. Avoid using obstore or CUDA "
                    "in this process before the loader starts, or move the dataset to a module "
                    "and pass multiprocessing_context='forkserver'.",
                    AsyncloadWarning,
                    stacklevel=user_stacklevel(),
                )
            return multiprocessing.get_context("fork")
        # Forking now would hang the workers: forkserver works if nothing the workers need
        # lives in __main__ (which they can't import).
        _guards.refuse_main_objects(objects, unsafe)
        warnings.warn(
            f"asyncload: {unsafe}, so forking workers could hang them; starting them with "
            "'forkserver' instead (the dataset and functions come from importable modules).",
            AsyncloadWarning,
            stacklevel=user_stacklevel(),
        )
    ctx = multiprocessing.get_context("forkserver")
    _preload(ctx)
    return ctx


def _named(requested: Any) -> multiprocessing.context.BaseContext:
    if isinstance(requested, str):
        return multiprocessing.get_context(requested)
    return requested  # type: ignore[no-any-return]


# Per process: the forkserver is one per process (multiprocessing's), so only the first loader
# starts it early.
_early = False


def early_context(requested: Any) -> BaseContext | None:
    """The forkserver context a loader built with *requested* will use, when starting its
    processes before ``iter()`` is safe; else ``None``.

    Only for ``forkserver``: its children fork from the server, which imports ``__main__``
    once (``spawn`` would import it in every child, before ``iter()`` could check the guard).
    Not for a loader built outside the main guard or while ``__main__`` is being imported
    again (the server would build that loader too), not with the default start method in a
    notebook (workers are forked there), not from a daemonic process (a worker), and not for a
    name that is wrong (``iter()`` reports it).
    """
    if multiprocessing.current_process().daemon or _guards.built_outside_the_guard():
        return None
    try:
        if requested is None:
            if "forkserver" not in multiprocessing.get_all_start_methods() or _interactive():
                return None
            return multiprocessing.get_context("forkserver")
        ctx = _named(requested)
    except (ValueError, AttributeError):
        return None
    return ctx if ctx.get_start_method() == "forkserver" else None


def start_early(ctx: BaseContext, *, fork: bool = False) -> bool:
    """Start the forkserver, with torch and asyncload preloaded, ahead of ``iter()``.

    Called when a loader with workers is built, with its ``early_context``. With *fork* (the
    default start method), the server is forked from this process when that is safe
    (``start_method.forkserver``): it serves at once. Otherwise it starts afresh in a background
    thread, and its one-time imports (1-5 s) overlap whatever the program does before
    ``iter(loader)``. The loader then starts its first pass's processes from it, also in the
    background (``_workers._standby``), so the first batch waits for neither. Returns whether
    it started the server (once per process; multiprocessing stops it at exit).
    """
    global _early
    if _early:
        return False
    _early = True
    _preload(ctx)
    if fork and _forkserver.fork_server():
        return True

    def run() -> None:
        from multiprocessing import forkserver

        try:
            forkserver.ensure_running()
        except Exception:  # iter() starts it again, and reports what fails
            pass

    threading.Thread(target=run, name="asyncload-forkserver-start", daemon=True).start()
    return True


def _preload(ctx: BaseContext) -> None:
    from multiprocessing import forkserver

    server = forkserver._forkserver
    if getattr(server, "_forkserver_pid", 0) is None:  # not started: preload still takes effect
        modules = list(getattr(server, "_preload_modules", ["__main__"]))
        if _interactive() and "__main__" in modules:
            # A notebook, -c or stdin has no file to run again in the server.
            modules.remove("__main__")
        for name in ("asyncload._workers.child", "asyncload._workers.start_method.preload"):
            if name not in modules:
                modules.append(name)
        ctx.set_forkserver_preload(modules)


def _describe(obj: Any) -> str:
    name = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    return f"{name!s} ({type(obj).__module__}.{type(obj).__qualname__})"


def _culprit(obj: Any, path: str, depth: int = 0) -> tuple[str, Any, BaseException] | None:
    """Find the innermost attribute of *obj* that fails to pickle."""
    try:
        pickle.dumps(obj)
        return None
    except Exception as exc:
        found: tuple[str, Any, BaseException] = (path, obj, exc)
    if depth < 3:
        attrs = getattr(obj, "__dict__", None)
        if isinstance(attrs, dict):
            for key, value in attrs.items():
                inner = _culprit(value, f"{path}.{key}", depth + 1)
                if inner is not None:
                    return inner
    return found


def diagnose_pickling(objects: dict[str, Any], method: str, cause: BaseException) -> NotPicklable:
    """Build a ``NotPicklable`` naming the object that can't be sent to a worker."""
    found = find_unpicklable(objects, method)
    if found is not None:
        return found
    return NotPicklable(
        f"starting a DataLoader worker with {method!r} failed while pickling its arguments: "
        f"{type(cause).__name__}: {cause}"
    )


def find_unpicklable(objects: dict[str, Any], method: str) -> NotPicklable | None:
    """A ``NotPicklable`` naming the object of *objects* that can't be pickled; ``None`` if
    each of them pickles."""
    for name, obj in objects.items():
        hit = _culprit(obj, name)
        if hit is None:
            continue
        path, bad, exc = hit
        return NotPicklable(
            f"{path} = {_describe(bad)} can't be pickled, so it can't reach DataLoader workers "
            f"started with {method!r}: {type(exc).__name__}: {exc}. Define functions and classes "
            "at module level (not lambdas, nested functions or classes defined in __main__ of a "
            "notebook), create unpicklable resources (open files, sessions, locks) lazily inside "
            "the worker, or pass multiprocessing_context='fork'."
        )
    return None
