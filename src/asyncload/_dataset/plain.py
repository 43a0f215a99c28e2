"""An ``asyncload.Dataset`` read by ``torch.utils.data.DataLoader`` (or any plain loop).

Trainers such as Hugging Face's ``Trainer`` build their own torch DataLoader. torch then calls
the dataset's ``__getitems__`` with a batch of indices; ``asyncload.Dataset`` answers by running
each ``async __getitem__`` to completion, one at a time, on the private loop of ``_storage.sync``.
That is correct but slow (one request in flight per worker), so the first such call in each process
warns once, pointing at ``asyncload.DataLoader``.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

from .._exceptions import AsyncloadWarning
from .._storage.sync import run_sync

__all__ = ["getitems_sync"]

# Per process: warns once per process (see the module doc), not per dataset or per batch.
_warned = False


def getitems_sync(dataset: Any, indices: list[Any]) -> list[Any]:
    """``[dataset[i] for i in indices]`` with each coroutine run to completion."""
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            f"{type(dataset).__name__} is an asyncload.Dataset read by a plain "
            "torch.utils.data.DataLoader: samples are fetched one at a time. Use "
            "asyncload.DataLoader (same arguments) for max_concurrency samples in flight per "
            "worker; see 'Trainers that build their own DataLoader' in the docs.",
            AsyncloadWarning,
            stacklevel=3,
        )
    out = []
    for index in indices:
        sample = dataset[index]
        if inspect.isawaitable(sample):
            sample = run_sync(_await(sample))
        out.append(sample)
    return out


async def _await(awaitable: Any) -> Any:
    return await awaitable
