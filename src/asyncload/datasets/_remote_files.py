"""``RemoteFiles``: a map-style dataset with one object URL per sample.

The URLs live in two NumPy arrays, one ``uint8`` buffer of UTF-8 bytes and one ``int64`` array of
offsets, rather than in a list of ``str``. A forked worker that reads a Python list touches every
string's reference count, which copies its memory page by page (copy-on-read): with millions of
URLs and several workers that is gigabytes. Two arrays are two objects whatever their length, and
they pickle as two buffers for ``forkserver`` and ``spawn`` workers.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from .._dataset import cpu as _cpu
from .._dataset.base import Dataset
from .._redact import redact_url
from .._storage import api as _storage
from ..sources import StorageOptions

__all__ = ["RemoteFiles"]


def _pack(urls: Iterable[str | bytes]) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64]]:
    encoded = [u.encode() if isinstance(u, str) else bytes(u) for u in urls]
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum([len(e) for e in encoded], out=offsets[1:])
    blob = np.frombuffer(b"".join(encoded), dtype=np.uint8).copy()
    return blob, offsets


_PASSED = ("url", "index")


def _wanted(decode: Callable[..., Any] | None) -> tuple[str, ...]:
    """Which of ``url``/``index`` *decode* names as parameters (passed by keyword).

    Only parameters named so count, never ``**kwargs``: ``json.loads`` takes ``**kw`` and would
    choke on a ``url=``.
    """
    if decode is None:
        return ()
    try:
        params = inspect.signature(decode).parameters
    except (TypeError, ValueError):  # some builtins have no signature: bytes only
        return ()
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return tuple(n for n in _PASSED if n in params and params[n].kind in named)


class RemoteFiles(Dataset[Any]):
    """One sample per object URL: ``dataset[i]`` reads URL ``i`` and decodes it.

    Works with any scheme ``asyncload.read`` knows (``https://``, ``s3://``, ``gs://``,
    ``az://``, ``file://``, plain paths). ``decode`` runs in the worker process; with
    ``decode_in_thread=True`` it runs on the worker's CPU lane (see
    [`asyncload.cpu`][asyncload.cpu]), so a CPU-heavy decoder (JPEG, audio) does not stop the
    event loop from fetching the next samples meanwhile; by default it does where the worker
    has more than one core to itself, and decodes inline where it has one (faster there).

    **Labels from paths.** A ``decode`` with a parameter named ``url`` and/or ``index`` gets the
    sample's URL and/or index by keyword, besides the bytes; the signature is read once. So an
    ImageFolder-style layout (``.../train/cat/001.jpg``) needs no subclass:

    ```python
    def decode(data, *, url):
        return load_image(data), CLASSES.index(url.rsplit("/", 2)[-2])
    ```

    Args:
        urls: The object URLs, in sample order (any iterable of ``str``, or a NumPy array).
        decode: ``decode(data: bytes) -> sample``, or ``decode(data, *, url, index)`` with
            either keyword (see above); the raw ``bytes`` when ``None``. Must be picklable (a
            module-level function) to reach ``forkserver``/``spawn`` workers.
        decode_in_thread: Run ``decode`` with [`asyncload.cpu`][asyncload.cpu]: on the
            worker's CPU lane, as many at once as its share of the cores, the head batch first
            (``True``), or inline on the event loop (``False``). ``None`` (default): on the
            lane where the worker has two cores or more to itself (``cpu_threads``), inline
            where it has one: measured, each is the faster there.
        storage_options: ``{prefix: StorageOptions or dict}`` applied with
            [`asyncload.configure_all`][asyncload.configure_all] in each process that reads from
            this dataset.

    Examples:
        >>> import asyncload, io
        >>> from PIL import Image  # doctest: +SKIP
        >>> def decode(data):
        ...     return Image.open(io.BytesIO(data)).convert("RGB")
        >>> ds = asyncload.RemoteFiles.from_prefix(
        ...     "s3://bucket/train/", decode=decode
        ... )  # doctest: +SKIP
        >>> # One worker per core, decoding inline: the fastest when the CPU is the limit.
        >>> loader = asyncload.DataLoader(ds, batch_size=64, num_workers=4)  # doctest: +SKIP
    """

    def __init__(
        self,
        urls: Iterable[str] | npt.NDArray[Any],
        *,
        decode: Callable[..., Any] | None = None,
        decode_in_thread: bool | None = None,
        storage_options: Mapping[str, StorageOptions | Mapping[str, Any]] | None = None,
    ) -> None:
        if isinstance(urls, (str, bytes)):
            raise TypeError("RemoteFiles(urls) takes a sequence of URLs, not a single string")
        if decode is not None and not callable(decode):
            raise TypeError(f"RemoteFiles(decode=...) must be callable, got {decode!r}")
        self._blob, self._offsets = _pack(urls)
        # Buffer views of the two arrays, made at the first url() in each process (not
        # pickled): indexing one gives plain ints and str() decodes a slice of the other in
        # place, where NumPy's scalars and tobytes() made url() cost 1.7 us a sample (now 1.0).
        self._blob_view: memoryview | None = None
        self._offsets_view: memoryview | None = None
        self.decode = decode
        self.decode_in_thread = decode_in_thread
        self.storage_options = dict(storage_options) if storage_options else None
        self._configured_in: int | None = None
        self._wanted: tuple[Callable[..., Any], tuple[str, ...]] | None = None

    @classmethod
    def from_prefix(
        cls,
        prefix_url: str,
        *,
        decode: Callable[..., Any] | None = None,
        decode_in_thread: bool | None = None,
        storage_options: Mapping[str, StorageOptions | Mapping[str, Any]] | None = None,
    ) -> RemoteFiles:
        """A dataset over every object under *prefix_url*, in sorted URL order.

        Lists with [`asyncload.list_files`][asyncload.list_files] (so ``storage_options`` are
        applied in this process first). See that function's note on forking after listing object
        stores.

        Examples:
            >>> ds = asyncload.RemoteFiles.from_prefix("s3://bucket/val/")  # doctest: +SKIP
        """
        if storage_options:
            _storage.configure_all(storage_options)
        return cls(
            _storage.list_files(prefix_url),
            decode=decode,
            decode_in_thread=decode_in_thread,
            storage_options=storage_options,
        )

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def url(self, index: int) -> str:
        """The URL of sample *index* (negative indices count from the end)."""
        blob, offsets = self._blob_view, self._offsets_view
        if blob is None or offsets is None:
            blob = self._blob_view = self._blob.data
            offsets = self._offsets_view = self._offsets.data
        n = len(offsets) - 1
        i = int(index)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"RemoteFiles index {index} out of range for {n} URLs")
        return str(blob[offsets[i] : offsets[i + 1]], "utf-8")

    @property
    def urls(self) -> list[str]:
        """Every URL as a new list (builds one ``str`` per URL: for inspection, not workers)."""
        return [self.url(i) for i in range(len(self))]

    async def __getitem__(self, index: int) -> Any:
        url = self.url(index)
        if self.storage_options and self._configured_in != os.getpid():
            _storage.configure_all(self.storage_options)
            self._configured_in = os.getpid()
        data = await _storage.read(url)
        decode = self.decode
        if decode is None:
            return data
        wanted = self._wanted_by(decode)
        if wanted:
            given = {"url": url, "index": int(index)}
            decode = functools.partial(decode, **{k: given[k] for k in wanted})
        if _cpu.decode_on_lane(self.decode_in_thread):
            return await _cpu.cpu(decode, data)
        return decode(data)

    def _wanted_by(self, decode: Callable[..., Any]) -> tuple[str, ...]:
        # Read once per decoder (``decode`` is a plain attribute and may be replaced).
        cached = self._wanted
        if cached is None or cached[0] is not decode:
            cached = self._wanted = (decode, _wanted(decode))
        return cached[1]

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_configured_in"] = None  # each process applies storage_options itself
        state["_wanted"] = None  # read the decoder's signature again after unpickling
        # Views of this process's arrays (memoryviews do not pickle): made again where unpickled.
        state["_blob_view"] = state["_offsets_view"] = None
        return state

    def __repr__(self) -> str:
        n = len(self)
        first = f", first={redact_url(self.url(0))!r}" if n else ""
        return f"RemoteFiles({n} URLs{first}, decode={getattr(self.decode, '__name__', None)})"
