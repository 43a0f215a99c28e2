"""The loader's arguments that every worker reads as given: ``WorkerOptions``.

A ``DataLoader`` argument that the workers read goes here, in two places only: a field of
``WorkerOptions`` (with its check in ``__post_init__``), and ``DataLoader.__init__``, which takes
the argument and builds the options. The pass's settings carry them whole to each worker's
``WorkerConfig`` (``_loader/start.py`` and ``_loader/spec.py`` do not change), where the worker
reads ``cfg.options.<name>``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["WorkerOptions"]


def _positive(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True, slots=True)
class WorkerOptions:
    """What each worker of a loader is told, the same for all of them.

    Examples:
        >>> WorkerOptions(max_concurrency=64).cpu_threads is None
        True
        >>> WorkerOptions(cpu_threads=0)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: cpu_threads must be a positive integer, or None for each worker's ... got 0
    """

    max_concurrency: int | None = None
    """Samples in flight at most; ``None``: a limit the engine finds itself (``slots``)."""
    cpu_threads: int | None = None
    """Threads of the worker's CPU lane (``_dataset.cpu``); ``None``: its share of the cores."""
    skip_sample_errors: bool = False
    """Leave a failing sample out of its batch instead of failing the batch (``sample_errors``)."""

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and not _positive(self.max_concurrency):
            raise ValueError(
                "max_concurrency must be a positive integer, or None (or 'auto') for a limit "
                f"each worker finds itself, got {self.max_concurrency!r}"
            )
        if self.cpu_threads is not None and not _positive(self.cpu_threads):
            raise ValueError(
                "cpu_threads must be a positive integer, or None for each worker's share of "
                f"the cores, got {self.cpu_threads!r}"
            )
