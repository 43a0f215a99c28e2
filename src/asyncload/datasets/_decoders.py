"""Which decoder a tar member's field gets, and the pickle guard: extensions in any letter case.

One rule for every extension comparison, so that no spelling slips past the guard: a decoder
registered as ``"PKL"`` is a pickle decoder like ``"pkl"``, and a member ``x.PKL`` is a pickle
like ``x.pkl``. Fields keep the member's own spelling (``sample["PKL"]``); only the lookup
ignores case. The full extension (``"seg.png"``) is tried before its last part (``"png"``).
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["PICKLE_EXTENSIONS", "DecoderTable", "check_pickle_guard", "decode_fields", "table_for"]

PICKLE_EXTENSIONS = frozenset({"pyd", "pickle", "pkl", "pth", "pt"})
"""Extensions whose members are pickles (``torch.save`` files included): bytes unless
``allow_pickle=True``. Compared in any letter case, as every extension is."""

DecoderTable = dict[str, Callable[[bytes], Any]]


def _unpickle(data: bytes) -> Any:
    return pickle.loads(data)  # reached only with allow_pickle=True


def _torch_load(data: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(data), weights_only=False)  # only with allow_pickle=True


def check_pickle_guard(decoders: Mapping[str, Any], allow_pickle: bool) -> None:
    """Refuse decoders for pickle extensions (in any case) unless *allow_pickle*."""
    if allow_pickle:
        return
    risky = sorted(e for e in decoders if e.rsplit(".", 1)[-1].lower() in PICKLE_EXTENSIONS)
    if risky:
        raise ValueError(
            f"decoders for pickle extensions {risky} need allow_pickle=True: "
            "unpickling runs arbitrary code from the shard"
        )


def table_for(
    decoders: Mapping[str, Callable[[bytes], Any]] | None, allow_pickle: bool
) -> DecoderTable:
    """The lookup table, keyed by lower-case extension: built-in pickle decoders (when allowed),
    then the user's, which win."""
    table: DecoderTable = {}
    if allow_pickle:
        for ext in ("pyd", "pickle", "pkl"):
            table[ext] = _unpickle
        table["pth"] = table["pt"] = _torch_load
    if decoders:
        table.update((ext.lower(), fn) for ext, fn in decoders.items())
    return table


def decode_fields(sample: dict[str, Any], table: DecoderTable) -> dict[str, Any]:
    """*sample* with every field that has a decoder in *table* decoded (``__key__`` and other
    ``__`` fields never are)."""
    if not table:
        return sample
    out: dict[str, Any] = {}
    for field, value in sample.items():
        name = field.lower()
        fn = table.get(name) or table.get(name.rsplit(".", 1)[-1])
        if fn is None or field.startswith("__"):
            out[field] = value
        else:
            out[field] = fn(value)
    return out
