"""Real input pipelines (issue 32): decode and transforms, from local disk and over the network.

Two pipelines, each over a corpus generated at run time (never downloaded) and cached in a
temporary folder between runs:

* ``images``: photo-like JPEGs, 500x375, ~75 KB (smooth gradients and multi-scale texture plus
  a little noise, so they compress like photos), each carrying its index in a JPEG comment.
  A sample is PIL decode + RandomResizedCrop(224) (torchvision's parameters: scale 0.08-1,
  ratio 3/4-4/3, bilinear) + a random horizontal flip -> a ``uint8`` CHW tensor (as
  torchvision's ``PILToTensor`` gives it), with the index read back from the JPEG. Batch 64.
* ``text``: ~2 KB text records (the index, then words); a sample is ``bytes.split()`` + a CRC32
  per word into a 30,000-word vocabulary, padded to 512 ``int64`` tokens. The transform is cheap,
  so the loader's own cost per sample shows. Batch 64.

Rows (each in a fresh interpreter, 2 workers, ``collate_fn`` left to the loader's default,
built ``--build-s`` (2 s) before ``iter()``):

* ``ceiling``: 2 processes decode + transform bytes already in memory, no IPC, no loader;
* ``torch-local``: torch's DataLoader, a map dataset that reads the local file and decodes;
* ``local``: ``asyncload.RemoteFiles(paths, decode=...)`` over the same local files, defaults;
* ``remote-decode``: ``asyncload.RemoteFiles(urls, decode=...)`` over the network, defaults;
* ``remote-getitem``: an ``asyncload.Dataset`` whose ``async __getitem__`` awaits
  ``asyncload.read`` and then decodes inline (the README's recipe), defaults;
* ``remote-thread``: ``remote-decode`` with ``decode_in_thread=True`` (the docstring's recipe);
* ``torch-threads``: torch's DataLoader with a 32-thread pool per worker in ``__getitems__``,
  each thread a blocking GET then the decode (HTTP only);
* ``spdl``: SPDL's pipeline (fetch stage 256 in flight, decode stage 2 threads, batch 64),
  when ``spdl`` is importable.

The network is the loopback object store of ``_server.py`` (``asyncload.cli.loopback``) run as
its own process, here serving the generated files instead of its pseudo-random bodies:
``GET /obj/{corpus}/{latency}/{i}`` (corpus 1 = images, 2 = text), also as S3 path-style
(bucket ``obj``), as ``bench_wholerun.py`` does. Latencies: ``50`` (constant 50 ms),
``50x10p1`` (1% of requests x10) and ``ln40-400`` (log-normal, p50 40 ms, p99 400 ms).

Columns: whole-run samples/s (``iter()`` to the last batch); CPU ms/sample of the benchmark's
own process tree (the row's interpreter plus every descendant: workers, forkserver, pool
processes; user + system, reaped children included; the object server is NOT counted, it
stands in for remote storage) and, separately, the object server's CPU ms/sample; the share
of the machine's CPU time that was idle during the row (``/proc/stat``; ``-`` for the ceiling,
whose processes load before they start, and where there is no ``/proc``); the ratios to torch
over local files and to the CPU ceiling of the same pipeline; when the training loop took the
4th batch (a loader that works on several batches at once and finishes none of them delivers
its first batches late, and a training loop waits for them; ``-`` for the ceiling and for
passes of fewer than 4 batches). Every row checks that each sample index arrived exactly once
and that shapes and dtypes are right.

``--step-ms N``: the training loop holds each batch N ms (a step on an accelerator: a sleep, no
CPU), so the whole-run rate also shows what a loader's delivery order costs a training loop
that keeps up with it: a batch that comes late idles the step, and the ones that come at once
after it queue. The 4th batch's time then includes the 3 steps before it, and a loader held
back by the steps idles the machine: compare such rows only with rows of the same step.

    .venv/bin/python benchmarks/bench_pipeline.py                # every row, 3 rounds (~10 min)
    .venv/bin/python benchmarks/bench_pipeline.py --quick        # smoke run (< 30 s)
    .venv/bin/python benchmarks/bench_pipeline.py --pipelines images --latencies 50 \\
        --transports http --rows ceiling,torch-local,local,remote-decode --repeat 3
"""

from __future__ import annotations

import argparse
import io
import json
import math
import multiprocessing
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _server
import numpy as np
import torch
import torch.utils.data
from _children import result, spawn
from _peers import BUCKET, CREDS, installed
from bench_loader import ThreadedBlobs
from PIL import Image

import asyncload
from asyncload.cli import loopback

BATCH = 64
WORKERS = 2
CROP = 224
IMAGE_W, IMAGE_H = 500, 375
TEXT_TOKENS = 512
VOCAB = 30_000
CORPUS_ID = {"images": 1, "text": 2}  # the {size} field of the server's path names the corpus
LATENCIES = ("50", "50x10p1", "ln40-400")
CORPUS_VERSION = 1  # bump when the generated corpus changes (it is cached under this name)

# ── the corpus ────────────────────────────────────────────────────────────────────────────────


def _texture(rng: Any, grid: tuple[int, int], amplitude: float) -> Any:
    """Noise on a coarse grid, upsampled bicubically: texture at one scale, centred on 0."""

    small = rng.standard_normal((*grid, 3), dtype=np.float32) * amplitude + 128
    up = Image.fromarray(np.clip(small, 0, 255).astype(np.uint8)).resize(
        (IMAGE_W, IMAGE_H), Image.Resampling.BICUBIC
    )
    return np.asarray(up, dtype=np.float32) - 128


def make_image(index: int) -> bytes:
    """JPEG *index*: 500x375, ~75 KB at quality 90, its index in the JPEG comment."""

    rng = np.random.default_rng(index)
    y = np.linspace(0, 1, IMAGE_H, dtype=np.float32)[:, None, None]
    x = np.linspace(0, 1, IMAGE_W, dtype=np.float32)[None, :, None]
    base = rng.uniform(40, 215, 3).astype(np.float32)
    dx, dy = (rng.uniform(-90, 90, 3).astype(np.float32) for _ in range(2))
    fx, fy, phase = rng.uniform(1, 6), rng.uniform(1, 6), rng.uniform()
    img = base + dx * x + dy * y + 30 * np.sin(np.float32(2 * math.pi) * (fx * x + fy * y + phase))
    img += _texture(rng, (12, 16), 40) + _texture(rng, (47, 63), 25) + _texture(rng, (125, 167), 25)
    img += rng.standard_normal(img.shape, dtype=np.float32) * 4
    out = io.BytesIO()
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(
        out, "JPEG", quality=90, comment=str(index).encode()
    )
    return out.getvalue()


_WORDS = [
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by",
    "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an",
    "had", "they", "you", "were", "their", "one", "all", "we", "can", "her", "has", "there",
    "been", "if", "more", "when", "will", "would", "who", "so", "no", "loader", "gradient",
    "tensor", "sample", "network", "latency", "storage", "object", "training", "batch",
]  # fmt: skip


def make_record(index: int) -> bytes:
    """Text record *index*: ``"record {index}\\n"`` then ~2 KB of words, one line per ~80 chars."""
    rng = random.Random(index)
    words = [f"record {index}\n"]
    size = len(words[0])
    while size < 2000:
        word = rng.choice(_WORDS) if rng.random() < 0.8 else f"w{rng.randrange(100_000)}"
        words.append(word)
        size += len(word) + 1
    return " ".join(words).encode()


def _write_one(args: tuple[str, str, int]) -> None:
    kind, folder, index = args
    data = make_image(index) if kind == "images" else make_record(index)
    Path(folder, _name(kind, index)).write_bytes(data)


def _name(kind: str, index: int) -> str:
    return f"{index:06d}.jpg" if kind == "images" else f"{index:06d}.txt"


def ensure_corpus(root: Path, kind: str, n: int) -> Path:
    """The folder of *n* generated files of *kind* under *root* (generated once, then reused)."""
    folder = root / f"{kind}-v{CORPUS_VERSION}-{n}"
    if (folder / "done").exists():
        return folder
    tmp = root / f".{folder.name}.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    t0 = time.perf_counter()
    with multiprocessing.get_context("fork").Pool(os.cpu_count() or 2) as pool:
        pool.map(_write_one, [(kind, str(tmp), i) for i in range(n)], chunksize=16)
    (tmp / "done").write_text("")
    try:
        tmp.rename(folder)
    except OSError:  # another run made it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    sizes = [p.stat().st_size for p in folder.iterdir() if p.name != "done"]
    print(
        f"generated {n} {kind} in {time.perf_counter() - t0:.1f} s "
        f"(mean {sum(sizes) / len(sizes) / 1000:.1f} KB) under {folder}",
        flush=True,
    )
    return folder


# ── the transforms (module level: picklable to forkserver workers) ────────────────────────────


def _crop_box(width: int, height: int) -> tuple[int, int, int, int]:
    """torchvision's ``RandomResizedCrop.get_params`` (scale 0.08-1, ratio 3/4-4/3):
    ``(left, top, right, bottom)``."""
    area = width * height
    log_ratio = (math.log(3 / 4), math.log(4 / 3))
    for _ in range(10):
        target = area * random.uniform(0.08, 1.0)
        ratio = math.exp(random.uniform(*log_ratio))
        w = round(math.sqrt(target * ratio))
        h = round(math.sqrt(target / ratio))
        if 0 < w <= width and 0 < h <= height:
            top = random.randint(0, height - h)
            left = random.randint(0, width - w)
            return left, top, left + w, top + h
    # Fallback to a central crop, as torchvision does.
    in_ratio = width / height
    if in_ratio < 3 / 4:
        w, h = width, round(width / (3 / 4))
    elif in_ratio > 4 / 3:
        h, w = height, round(height * (4 / 3))
    else:
        w, h = width, height
    top, left = (height - h) // 2, (width - w) // 2
    return left, top, left + w, top + h


def decode_image(data: bytes) -> tuple[Any, int]:
    """JPEG bytes -> (``uint8`` tensor 3x224x224, the index the file carries)."""

    img = Image.open(io.BytesIO(data))
    index = int(img.info["comment"])
    img = img.convert("RGB")
    img = img.resize((CROP, CROP), Image.Resampling.BILINEAR, box=_crop_box(*img.size))
    if random.random() < 0.5:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    # torchvision's PILToTensor: a copy, HWC viewed as CHW (collate makes it contiguous).
    return torch.from_numpy(np.array(img, copy=True)).permute(2, 0, 1), index


def tokenize(data: bytes) -> tuple[Any, int]:
    """Text record -> (``int64`` tensor of 512 token ids, 0-padded; the record's index)."""

    words = data.split()
    index = int(words[1])
    ids = [zlib.crc32(w) % (VOCAB - 1) + 1 for w in words[2 : 2 + TEXT_TOKENS]]
    out = torch.zeros(TEXT_TOKENS, dtype=torch.int64)
    out[: len(ids)] = torch.tensor(ids, dtype=torch.int64)
    return out, index


TRANSFORMS: dict[str, Callable[[bytes], tuple[Any, int]]] = {
    "images": decode_image,
    "text": tokenize,
}
SHAPES = {"images": ((3, CROP, CROP), "torch.uint8"), "text": ((TEXT_TOKENS,), "torch.int64")}


# ── datasets ──────────────────────────────────────────────────────────────────────────────────


class LocalFiles(torch.utils.data.Dataset[Any]):
    """torch's way over local disk: read the file, transform, in ``__getitem__``."""

    def __init__(self, paths: Any, transform: Callable[[bytes], Any]) -> None:
        self.paths = paths  # a NumPy array of str: no copy-on-read in workers
        self.transform = transform

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> Any:
        with open(str(self.paths[index]), "rb") as f:
            return self.transform(f.read())


class AsyncDecoded(asyncload.Dataset[Any]):
    """The README's recipe: ``await asyncload.read(url)``, then decode inline."""

    def __init__(self, urls: Any, transform: Callable[[bytes], Any]) -> None:
        self.urls = urls
        self.transform = transform

    def __len__(self) -> int:
        return len(self.urls)

    async def __getitem__(self, index: int) -> Any:
        data = await asyncload.read(str(self.urls[index]))
        return self.transform(data)


class ThreadedDecoded(ThreadedBlobs):
    """torch + a 32-thread pool in ``__getitems__``: each thread GETs, then transforms."""

    def __init__(
        self, host: str, port: int, path_prefix: str, n: int, transform: Callable[..., Any]
    ) -> None:
        super().__init__(host, port, path_prefix, n)
        self.transform = transform

    def __getitem__(self, index: int) -> Any:  # type: ignore[override]
        return self.transform(super().__getitem__(index))


# ── one row, in its own interpreter ───────────────────────────────────────────────────────────


def _tree_cpu() -> float:
    """CPU seconds of this process and every live descendant, reaped children included."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def _machine_times() -> tuple[int, int] | None:
    """(all, idle) CPU ticks of the whole machine since boot (``/proc/stat``); ``None`` where
    there is none. Idle counts I/O wait too: a core with nothing to run."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return sum(ticks), ticks[3] + ticks[4]


def _idle_share(before: tuple[int, int] | None) -> float | None:
    """The machine's share of CPU time idle since *before* (``_machine_times``)."""
    after = _machine_times()
    if before is None or after is None or after[0] <= before[0]:
        return None
    return (after[1] - before[1]) / (after[0] - before[0])


def _check(kind: str, batches_ids: list[int], n: int) -> None:
    if len(batches_ids) != n or sorted(batches_ids) != list(range(n)):
        seen = set(batches_ids)
        missing = [i for i in range(n) if i not in seen][:5]
        dups = len(batches_ids) - len(seen)
        raise AssertionError(
            f"{kind}: {len(batches_ids)} samples for {n}; missing e.g. {missing}, {dups} repeats"
        )


def _timed_epoch(loader: Iterable[Any], spec: dict[str, Any]) -> None:
    """One pass of *loader* built ``spec["build_s"]`` before ``iter()``, each batch held
    ``spec["step_s"]``; checks every index exactly once."""
    kind, n, step_s = spec["kind"], spec["n"], spec.get("step_s", 0.0)
    shape, dtype = SHAPES[kind]
    time.sleep(spec["build_s"])  # the user builds the model
    machine0 = _machine_times()
    cpu0 = _tree_cpu()
    t0 = time.perf_counter()
    first = 0.0
    fourth: float | None = None  # a pass of fewer than 4 batches has none
    ids: list[int] = []
    for k, (data, index) in enumerate(loader):
        if k == 0:
            first = time.perf_counter() - t0
        elif k == 3:
            fourth = time.perf_counter() - t0
        if tuple(data.shape[1:]) != shape or str(data.dtype) != dtype or len(data) != len(index):
            raise AssertionError(f"bad batch: {tuple(data.shape)} {data.dtype}")
        ids.extend(index.tolist())
        if step_s:
            time.sleep(step_s)  # the training step, on the accelerator
    elapsed = time.perf_counter() - t0
    cpu = _tree_cpu() - cpu0  # before the loader's workers are gone
    idle = _idle_share(machine0)
    _check(kind, ids, n)
    result(rate=n / elapsed, first=first, fourth=fourth, cpu_ms=cpu * 1000 / n, idle=idle)


def _paths(folder: Path, kind: str, n: int) -> Any:

    return np.array([str(folder / _name(kind, i)) for i in range(n)])


def _urls(transport: str, base: str, kind: str, latency: str, n: int) -> Any:

    root = f"s3://{BUCKET}" if transport == "s3" else f"{base}/{BUCKET}"
    return np.array([f"{root}/{CORPUS_ID[kind]}/{latency}/{i}" for i in range(n)])


def _ceiling_worker(
    files: list[str], kind: str, barrier: Any, out: Any, seed: int
) -> None:  # pragma: no cover - runs in a forked process
    blobs = [Path(p).read_bytes() for p in files]
    transform = TRANSFORMS[kind]
    random.seed(seed)
    transform(blobs[0])  # first-call imports and allocations, untimed
    barrier.wait()
    t0, c0 = time.perf_counter(), time.process_time()
    ids = [transform(b)[1] for b in blobs]
    out.put((t0, time.perf_counter(), time.process_time() - c0, ids))


def _child_ceiling(spec: dict[str, Any]) -> None:

    torch.set_num_threads(1)
    kind, n = spec["kind"], spec["n"]
    files = [str(p) for p in _paths(Path(spec["data"]), kind, n)]
    ctx = multiprocessing.get_context("fork")
    barrier, out = ctx.Barrier(WORKERS), ctx.Queue()
    procs = [
        ctx.Process(target=_ceiling_worker, args=(files[w::WORKERS], kind, barrier, out, w))
        for w in range(WORKERS)
    ]
    for p in procs:
        p.start()
    got = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(60)
    elapsed = max(g[1] for g in got) - min(g[0] for g in got)
    ids = [i for g in got for i in g[3]]
    _check(kind, ids, n)
    result(rate=n / elapsed, first=0.0, cpu_ms=sum(g[2] for g in got) * 1000 / n, idle=None)


def _child_torch_local(spec: dict[str, Any]) -> None:

    kind = spec["kind"]
    dataset = LocalFiles(_paths(Path(spec["data"]), kind, spec["n"]), TRANSFORMS[kind])
    loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, num_workers=WORKERS)
    _timed_epoch(loader, spec)


def _child_local(spec: dict[str, Any]) -> None:

    kind = spec["kind"]
    dataset = asyncload.RemoteFiles(
        _paths(Path(spec["data"]), kind, spec["n"]), decode=TRANSFORMS[kind]
    )
    loader = asyncload.DataLoader(dataset, batch_size=BATCH, num_workers=WORKERS)
    _timed_epoch(loader, spec)


def _remote_urls(spec: dict[str, Any]) -> Any:

    if spec["transport"] == "s3":
        asyncload.configure(
            f"s3://{BUCKET}", endpoint=spec["base"], region="us-east-1", credentials=CREDS
        )
    return _urls(spec["transport"], spec["base"], spec["kind"], spec["latency"], spec["n"])


def _child_remote(spec: dict[str, Any], *, in_thread: bool = False) -> None:

    kind = spec["kind"]
    dataset = asyncload.RemoteFiles(
        _remote_urls(spec), decode=TRANSFORMS[kind], decode_in_thread=in_thread
    )
    loader = asyncload.DataLoader(dataset, batch_size=BATCH, num_workers=WORKERS)
    _timed_epoch(loader, spec)


def _child_remote_thread(spec: dict[str, Any]) -> None:
    _child_remote(spec, in_thread=True)


def _child_remote_getitem(spec: dict[str, Any]) -> None:

    kind = spec["kind"]
    dataset = AsyncDecoded(_remote_urls(spec), TRANSFORMS[kind])
    loader = asyncload.DataLoader(dataset, batch_size=BATCH, num_workers=WORKERS)
    _timed_epoch(loader, spec)


def _child_torch_threads(spec: dict[str, Any]) -> None:

    kind = spec["kind"]
    host, port = spec["base"].removeprefix("http://").split(":")
    prefix = f"/{BUCKET}/{CORPUS_ID[kind]}/{spec['latency']}"
    dataset = ThreadedDecoded(host, int(port), prefix, spec["n"], TRANSFORMS[kind])
    loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, num_workers=WORKERS)
    _timed_epoch(loader, spec)


class _SpdlEpoch:
    """An iterable whose ``iter()`` runs one pass of an SPDL pipeline (start to stop)."""

    def __init__(self, pipeline: Any) -> None:
        self.pipeline = pipeline

    def __iter__(self) -> Iterator[Any]:
        with self.pipeline.auto_stop():
            yield from self.pipeline


def _child_spdl(spec: dict[str, Any]) -> None:  # pragma: no cover - needs spdl
    from spdl.pipeline import PipelineBuilder

    kind, n, transform = spec["kind"], spec["n"], TRANSFORMS[spec["kind"]]
    urls = _urls(spec["transport"], spec["base"], kind, spec["latency"], n)
    if spec["transport"] == "http":
        import aiohttp

        sessions: list[aiohttp.ClientSession] = []

        async def get(i: int) -> bytes:
            if not sessions:  # in the pipeline's own event loop
                sessions.append(aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)))
            async with sessions[0].get(str(urls[i])) as resp:
                resp.raise_for_status()
                return await resp.read()

    else:
        import obstore
        from obstore.store import S3Store

        store = S3Store(
            BUCKET,
            endpoint=spec["base"],
            region="us-east-1",
            client_options={"allow_http": True},
            access_key_id=CREDS["access_key_id"],
            secret_access_key=CREDS["secret_access_key"],
        )

        async def get(i: int) -> bytes:
            answer = await obstore.get_async(store, f"{CORPUS_ID[kind]}/{spec['latency']}/{i}")
            return bytes(await answer.bytes_async())

    pipeline = (
        PipelineBuilder()
        .add_source(range(n))
        .pipe(get, concurrency=256)
        .pipe(transform, concurrency=WORKERS)
        .aggregate(BATCH)
        .pipe(torch.utils.data.default_collate)
        .add_sink(4)
        .build(num_threads=WORKERS + 2)
    )
    _timed_epoch(_SpdlEpoch(pipeline), spec)


CHILDREN: dict[str, Callable[[dict[str, Any]], None]] = {
    "ceiling": _child_ceiling,
    "torch-local": _child_torch_local,
    "local": _child_local,
    "remote-decode": _child_remote,
    "remote-getitem": _child_remote_getitem,
    "remote-thread": _child_remote_thread,
    "torch-threads": _child_torch_threads,
    "spdl": _child_spdl,
}
LABELS = {
    "ceiling": "decode + transform only, 2 processes, bytes in memory (the CPU ceiling)",
    "torch-local": "torch DataLoader, local files",
    "local": "asyncload RemoteFiles(paths, decode=), local files",
    "remote-decode": "asyncload RemoteFiles(urls, decode=)",
    "remote-getitem": "asyncload async __getitem__: read, then decode inline",
    "remote-thread": "asyncload RemoteFiles(urls, decode=, decode_in_thread=True)",
    "torch-threads": "torch DataLoader + 32 threads per worker",
    "spdl": "SPDL pipeline, 256 in flight, 2 decode threads",
}
LOCAL_ROWS = ("ceiling", "torch-local", "local")
DEFAULT_ROWS = (*LOCAL_ROWS, "remote-decode", "remote-getitem", "torch-threads", "spdl")


# ── the object server, serving the generated files ────────────────────────────────────────────


def load_corpora(store: loopback.Store, folders: list[str]) -> None:
    """Serve the generated files of *folders* at ``/obj/{corpus}/...`` from *store*."""
    for folder in folders:
        kind = "images" if Path(folder).name.startswith("images") else "text"
        files = sorted(p for p in Path(folder).iterdir() if p.name != "done")
        store.corpora[CORPUS_ID[kind]] = [p.read_bytes() for p in files]


def _serve_files(folders: list[str]) -> None:
    store = loopback.Store(generated=True, control=True, record=False)
    load_corpora(store, folders)
    loopback.run_child(store, fast=True)


class FileServerProcess(_server.ObjectServerProcess):
    """``_server.ObjectServerProcess`` serving the corpus *folders* (this script's ``--serve``)."""

    def __init__(self, folders: list[Path]) -> None:
        super().__init__()
        self.folders = folders

    start_timeout = 60.0

    def command(self) -> list[str]:
        return [sys.executable, __file__, "--serve", *map(str, self.folders)]


# ── the driver ────────────────────────────────────────────────────────────────────────────────


def _spawn(spec: dict[str, Any]) -> dict[str, float]:
    what = f"{spec['row']} ({spec['kind']}, {spec['transport']})"
    return spawn(__file__, json.dumps(spec), what=what, timeout=600)


def _plan(args: argparse.Namespace) -> list[tuple[str, str, str, str]]:
    """(pipeline, row, transport, latency) in run order; local rows have transport "local"."""
    rows = args.rows.split(",") if args.rows else list(DEFAULT_ROWS)
    unknown = set(rows) - set(CHILDREN)
    if unknown:
        raise SystemExit(f"unknown rows {sorted(unknown)}; known: {', '.join(CHILDREN)}")
    if "spdl" in rows and not installed("spdl.pipeline"):
        print("spdl rows skipped: not installed (the `benchmarks` extra)")
        rows.remove("spdl")
    transports = args.transports.split(",")
    if "s3" in transports and not installed("obstore"):
        print("s3:// rows skipped: obstore is not installed (the `s3` extra)")
        transports.remove("s3")
    plan = []
    for kind in args.pipelines.split(","):
        for row in rows:
            if row in LOCAL_ROWS:
                plan.append((kind, row, "local", "-"))
                continue
            for transport in transports:
                if row == "torch-threads" and transport != "http":
                    continue
                for latency in args.latencies.split(","):
                    plan.append((kind, row, transport, latency))
    return plan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: small corpora, 1 round")
    parser.add_argument("--images", type=int, help="images in the corpus (default 2048)")
    parser.add_argument("--records", type=int, help="text records (default 4096)")
    parser.add_argument(
        "--rows",
        help=f"comma-separated rows (default: {','.join(DEFAULT_ROWS)}; all: {','.join(CHILDREN)})",
    )
    parser.add_argument("--pipelines", default="images,text", help="images,text")
    parser.add_argument("--transports", default="http,s3", help="http,s3")
    parser.add_argument("--latencies", help=f"default {','.join(LATENCIES)} (--quick: 50)")
    parser.add_argument("--repeat", type=int, help="rounds of every row (default 3, --quick 1)")
    parser.add_argument("--build-s", type=float, help="loader built before iter() (default 2 s)")
    parser.add_argument(
        "--step-ms", type=float, default=0.0, help="each batch held this long (a training step)"
    )
    parser.add_argument("--data", help="where the corpora are generated and cached")
    parser.add_argument("--json", help="write every run's numbers here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--serve", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.step_ms < 0:
        parser.error(f"--step-ms must be 0 or more, got {args.step_ms:g}")
    if args.child:
        spec = json.loads(args.child)
        CHILDREN[spec["row"]](spec)
        return 0
    if args.serve:
        _serve_files(args.serve)
        return 0
    sizes = {
        "images": args.images or (128 if args.quick else 2048),
        "text": args.records or (256 if args.quick else 4096),
    }
    args.latencies = args.latencies or ("50" if args.quick else ",".join(LATENCIES))
    build_s = args.build_s if args.build_s is not None else (0.2 if args.quick else 2.0)
    rounds = args.repeat or (1 if args.quick else 3)
    plan = _plan(args)
    root = Path(args.data or Path(tempfile.gettempdir()) / "asyncload-bench-pipeline")
    kinds = list(dict.fromkeys(kind for kind, *_ in plan))
    folders = {kind: ensure_corpus(root, kind, sizes[kind]) for kind in kinds}
    load0 = os.getloadavg()
    runs: dict[tuple[str, str, str, str], list[dict[str, float]]] = {key: [] for key in plan}
    with FileServerProcess(list(folders.values())) as server:
        # The server's first requests are slower (its own first-time code paths): met by a
        # warm-up here, not by whichever row happens to run first (not in a smoke run).
        for kind in kinds if not args.quick else ():
            if any(t != "local" for k, _, t, _ in plan if k == kind):
                spec = {"row": "remote-getitem", "kind": kind, "transport": "http"}
                spec |= {"latency": "0", "base": server.base_url, "n": min(sizes[kind], 256)}
                _spawn({**spec, "data": "", "build_s": 0.0})
        # Rounds of every row in turn, so every row sees the same drift of the machine's load.
        for _ in range(rounds):
            for key in plan:
                kind, row, transport, latency = key
                spec = {"row": row, "kind": kind, "transport": transport, "latency": latency}
                spec |= {"base": server.base_url, "n": sizes[kind], "data": str(folders[kind])}
                spec["build_s"] = build_s
                spec["step_s"] = args.step_ms / 1000
                s0 = server.cpu()
                got = _spawn(spec)
                got["server_ms"] = (server.cpu() - s0) * 1000 / sizes[kind]
                runs[key].append(got)
    load1 = os.getloadavg()
    _print(runs, sizes, rounds, build_s, args.step_ms, load0, load1)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "load_before": load0,
                    "load_after": load1,
                    "build_s": build_s,
                    "step_ms": args.step_ms,
                    "runs": [
                        {"pipeline": k, "row": r, "transport": t, "latency": lat, "runs": v}
                        for (k, r, t, lat), v in runs.items()
                    ],
                },
                indent=1,
            )
        )
    return 0


def _print(
    runs: dict[tuple[str, str, str, str], list[dict[str, float]]],
    sizes: dict[str, int],
    rounds: int,
    build_s: float,
    step_ms: float,
    load0: tuple[float, float, float],
    load1: tuple[float, float, float],
) -> None:
    med = {
        key: {m: statistics.median(r[m] for r in got) for m in ("rate", "cpu_ms", "server_ms")}
        for key, got in runs.items()
    }
    for key, got in runs.items():
        idles = [r["idle"] for r in got if r.get("idle") is not None]
        med[key]["idle"] = statistics.median(idles) if idles else math.nan
        fourths = [r["fourth"] for r in got if r.get("fourth") is not None]
        med[key]["fourth"] = statistics.median(fourths) if fourths else math.nan
    print(
        f"\nWhole runs, batch {BATCH}, {WORKERS} workers, loaders built {build_s:g} s before "
        f"iter(), {f'each batch held {step_ms:g} ms (a training step), ' if step_ms else ''}"
        f"fresh interpreter per row, median of {rounds} round(s) per column; "
        f"load average {load0[0]:.2f} before, {load1[0]:.2f} after ({os.cpu_count()} CPUs).\n"
        "CPU ms/sample: the row's process tree (main + workers + their children), user + system;"
        "\nserver ms/sample: the loopback object server's, not counted in the row's;\n"
        "idle: the machine's share of CPU time with nothing to run during the row (where a row "
        "bound by the CPU\nloses to one over local files with little idle, it is latency hiding "
        "that is missing, not CPU"
        f"{'; with a training step, a loader held back by it idles too' if step_ms else ''}).\n"
        "4th batch s: when the training loop took it (after 3 steps, with one).\n"
    )
    for kind in dict.fromkeys(k for k, *_ in runs):
        print(f"{kind}: {sizes[kind]} samples")
        print(
            "| transport | latency | row | samples/s | CPU ms/sample | server ms/sample | idle "
            "| 4th batch s | / torch local | / ceiling |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        torch_local = med.get((kind, "torch-local", "local", "-"), {}).get("rate")
        ceiling = med.get((kind, "ceiling", "local", "-"), {}).get("rate")
        for (k, row, transport, latency), m in med.items():
            if k != kind:
                continue
            vs_torch = f"{m['rate'] / torch_local:.2f}" if torch_local else "-"
            vs_ceiling = f"{m['rate'] / ceiling:.2f}" if ceiling else "-"
            server = f"{m['server_ms']:.2f}" if transport != "local" else "-"
            idle = "-" if math.isnan(m["idle"]) else f"{m['idle']:.0%}"
            fourth = "-" if math.isnan(m["fourth"]) else f"{m['fourth']:.2f}"
            print(
                f"| {transport} | {latency} | {LABELS[row]} | {m['rate']:,.0f} "
                f"| {m['cpu_ms']:.2f} | {server} | {idle} | {fourth} | {vs_torch} | {vs_ceiling} |"
            )
        print()
        _targets(kind, med)


def _targets(kind: str, med: dict[tuple[str, str, str, str], dict[str, float]]) -> None:
    """Issue 32's targets that this run can check, for *kind*'s pipeline."""
    torch_local = med.get((kind, "torch-local", "local", "-"), {}).get("rate")
    ceiling = med.get((kind, "ceiling", "local", "-"), {}).get("rate")
    lines = []
    local = med.get((kind, "local", "local", "-"), {}).get("rate")
    if local and torch_local:
        lines.append(("asyncload local / torch local >= 1.1", local / torch_local, 1.1))
    for transport in ("http", "s3"):
        remote = med.get((kind, "remote-decode", transport, "50"), {}).get("rate")
        if not remote:
            continue
        if torch_local:
            lines.append((f"{transport} 50 ms / torch local >= 1.0", remote / torch_local, 1.0))
        if ceiling:
            lines.append((f"{transport} 50 ms / ceiling >= 0.85", remote / ceiling, 0.85))
        for tail in LATENCIES[1:]:
            slow = med.get((kind, "remote-decode", transport, tail), {}).get("rate")
            if slow:
                lines.append((f"{transport} {tail} / 50 ms >= 0.95", slow / remote, 0.95))
    for text, ratio, goal in lines:
        print(f"target ({kind}): {text}: {ratio:.2f} {'met' if ratio >= goal else 'MISSED'}")
    if lines:
        print()


if __name__ == "__main__":
    sys.exit(main())
