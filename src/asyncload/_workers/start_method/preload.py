"""What the forkserver imports once, so that workers forked from it don't (``_context``).

Every worker imports uvloop for its loop, and one reading ``s3://``, ``gs://`` or ``az://``
imports obstore: 3 ms and 9 ms of every new worker's start, every epoch. Every worker also
seeds NumPy's global generator (``numpy.random``, which ``import numpy`` leaves for later: 6-9 ms
here) and aiohttp encodes host names through ``encodings.idna`` (1-2 ms). The main process never
imports this module: obstore in its ``sys.modules`` would mark it unsafe to fork
(``start_method.guards``).
Importing obstore starts no thread; its runtime starts on first use, in a worker.
"""

from __future__ import annotations

import contextlib
import encodings.idna  # noqa: F401

import numpy.random  # noqa: F401

with contextlib.suppress(ImportError):  # optional: uvloop is absent on Windows
    import uvloop  # noqa: F401
with contextlib.suppress(ImportError):  # optional: the `s3` extra
    import obstore.store  # noqa: F401
