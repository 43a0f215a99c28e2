"""Storage backends by URL scheme, and the registry new schemes join.

Importing this package registers the built-in backends:
``http`` and ``https`` (aiohttp), ``s3``, ``gs`` and ``az`` (obstore, an optional dependency;
options mapped per cloud), ``file`` and plain paths (the default executor).

Examples:
    >>> from asyncload.sources import Backend, register
    >>> class Memory(Backend):  # doctest: +SKIP
    ...     ...
    >>> register("mem", Memory())  # doctest: +SKIP
"""

from __future__ import annotations

# Importing them registers the built-in backends.
from .._storage.backends import http as _http  # noqa: F401
from .._storage.backends import local as _local  # noqa: F401
from .._storage.backends import s3 as _s3  # noqa: F401
from .._storage.backends.base import (
    Backend,
    ObjectInfo,
    Resume,
    StorageOptions,
    backend_for,
    register,
    registered_schemes,
)
from .._storage.retry import AttemptFailed

__all__ = [
    "AttemptFailed",
    "Backend",
    "ObjectInfo",
    "Resume",
    "StorageOptions",
    "backend_for",
    "register",
    "registered_schemes",
]
