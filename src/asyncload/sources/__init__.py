"""Storage backends by URL scheme, and the registry new schemes join.

Importing this package registers the built-in backends:

=====================  ==========================  ==============================
scheme                 module                      library
=====================  ==========================  ==============================
``http``, ``https``    ``._http``               aiohttp
``s3``, ``gs``, ``az`` ``._s3``                 obstore (optional dependency);
                       (+ ``._cloud_config``)   options mapped per cloud
``file``, plain paths  ``._local``              aiofiles / the default executor
=====================  ==========================  ==============================

Examples:
    >>> from asyncload.sources import Backend, register
    >>> class Memory(Backend):  # doctest: +SKIP
    ...     ...
    >>> register("mem", Memory())  # doctest: +SKIP
"""

from __future__ import annotations

from .._retry import AttemptFailed
from . import _http, _local, _s3  # noqa: F401 - importing registers the backends
from ._base import (
    Backend,
    ObjectInfo,
    Resume,
    StorageOptions,
    backend_for,
    register,
    registered_schemes,
)

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
