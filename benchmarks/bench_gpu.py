"""End-to-end training on a GPU fed from a 50 ms store: asyncload vs torch's DataLoader.

One run, one table; needs CUDA (it says so and exits otherwise; ``--allow-cpu`` runs the same
rows on the CPU instead, a smoke test whose numbers mean nothing). Two pipelines
(``--pipeline``), each behind a loopback server in its own process at 50 ms per request:

* ``synthetic`` (the default): N objects of 3 x 128 x 128 uint8 (49 KB) from the object server
  (``_server.py``), each object's bytes viewed as the image (no decode);
* ``jpeg``: N photo-like JPEGs (500x375, ~75 KB) generated at run time by
  ``bench_pipeline.py`` (``make_image``/``ensure_corpus``, cached under ``--data``, by default
  in the temporary folder, never downloaded) and served by its file server (``GET
  /obj/1/50/{i}``). A worker decodes each with ``bench_pipeline.decode_image``: PIL decode +
  RandomResizedCrop(224) + a random horizontal flip -> ``uint8`` 3 x 224 x 224, with the index
  the JPEG carries.

A small conv net (adaptive pooling, so it takes either size) trains on them with bf16 autocast.
Rows:

* **compute ceiling**: the same steps on one batch already on the GPU (no loading at all;
  ``jpeg``: a batch of the corpus's first images, decoded and augmented beforehand);
* ``asyncload.DataLoader`` (``RemoteFiles`` decoding each object into a tensor, ``--workers``
  workers, batch 64), ``pin_memory=True``, copies with ``non_blocking=True``;
* the same with ``pin_memory=False``;
* torch's ``DataLoader`` (``--workers`` workers, batch 64, ``pin_memory=True``) over a blocking
  dataset with a 32-thread pool in ``__getitems__`` (``bench_loader.ThreadedBlobs``; ``jpeg``:
  ``bench_pipeline.ThreadedDecoded``, each thread a GET then the decode), the best plain torch
  can do.

Each loader row runs one warm-up epoch, then a timed epoch on persistent workers: samples/s of
the training loop, the share of its time spent waiting for data, the share of the machine's
cores busy and its CPU per sample (in the table). A line per row splits that CPU into the
training process's, the server's and (asyncload) the workers' and their CPU lanes' (from
``/proc`` and ``loader.stats()``), with the stage ``stats()`` says bounds the pass, the
workers' in-flight limits and the fetch p50. Every batch is checked: its shape and dtype,
pinned when asked for (on CUDA), copied to the training device, and its contents:
``synthetic``, now and then, that its first image holds the object's bytes; ``jpeg``, that
every image index arrives exactly once per epoch. ``jpeg`` also prints what decoding costs one
core, the CPU ceiling (every core decoding, no loader: a bound on what the workers can feed)
with its CPU per image, and, on CUDA, issue 32's target (asyncload with ``pin_memory=True`` >=
0.95 of the compute ceiling).

    python benchmarks/bench_gpu.py              # about a minute on one GPU
    python benchmarks/bench_gpu.py --samples 2048 --workers 8
    PYTHONPATH=src python3 benchmarks/bench_gpu.py --pipeline jpeg --workers 8
    python benchmarks/bench_gpu.py --pipeline jpeg --allow-cpu --samples 128 --workers 2
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

# bench_loader and bench_pipeline import psutil at module level, for rows this script does not
# run; a GPU machine without the dev extra gets a stand-in (its Error, in their except clauses).
try:
    import psutil  # noqa: F401
except ImportError:
    import types

    _psutil = sys.modules["psutil"] = types.ModuleType("psutil")
    _psutil.Error = OSError  # type: ignore[attr-defined]

import bench_pipeline
import torch
import torch.utils.data
from _peers import BUCKET
from _server import ObjectServerProcess, object_bytes
from bench_loader import ThreadedBlobs

import asyncload

SHAPE = (3, 128, 128)
SIZE = SHAPE[0] * SHAPE[1] * SHAPE[2]
JPEG_SHAPE = (3, bench_pipeline.CROP, bench_pipeline.CROP)
LATENCY = 0.05
BATCH = 64
CEILING = "compute ceiling (batch already on the GPU)"
TARGET = 0.95  # issue 32: asyncload, pin_memory=True, over the compute ceiling (jpeg, 8 workers)


def to_image(data: bytes, **_: Any) -> torch.Tensor:
    """An object's bytes as a uint8 CHW image (module level: workers pickle it)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(SHAPE)


def collate_images(samples: list[Any]) -> torch.Tensor:
    """Raw bytes (the torch row's dataset) or tensors, stacked into one uint8 batch."""
    images = [to_image(s) if isinstance(s, bytes | bytearray) else s for s in samples]
    return torch.stack(images)


def make_model() -> torch.nn.Module:
    def block(cin: int, cout: int) -> list[torch.nn.Module]:
        return [torch.nn.Conv2d(cin, cout, 3, padding=1), torch.nn.BatchNorm2d(cout),
                torch.nn.ReLU(), torch.nn.MaxPool2d(2)]  # fmt: skip

    return torch.nn.Sequential(
        *block(3, 64), *block(64, 128), *block(128, 256), *block(256, 256),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(256, 1000),
    )  # fmt: skip


class Trainer:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.model = make_model().to(device).to(memory_format=torch.channels_last)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.mean = torch.tensor([0.485, 0.456, 0.406], device=device).view(1, 3, 1, 1) * 255
        self.std = torch.tensor([0.229, 0.224, 0.225], device=device).view(1, 3, 1, 1) * 255

    def step(self, images: torch.Tensor) -> None:
        x = ((images.float() - self.mean) / self.std).contiguous(memory_format=torch.channels_last)
        target = torch.zeros(x.shape[0], dtype=torch.long, device=self.device)
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(self.model(x), target)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def check_batch(
    images: torch.Tensor, index: torch.Tensor | None, shape: tuple[int, ...], pinned: bool
) -> None:
    """A batch's shape and dtype (and its indices', ``jpeg``), and pinned when asked for."""
    if (
        tuple(images.shape[1:]) != shape
        or images.dtype != torch.uint8
        or not 0 < images.shape[0] <= BATCH
    ):
        raise AssertionError(f"bad batch: {tuple(images.shape)} {images.dtype}")
    if index is not None and (index.dtype != torch.int64 or index.shape != images.shape[:1]):
        raise AssertionError(f"bad indices: {tuple(index.shape)} {index.dtype}")
    if pinned and not images.is_pinned():
        raise AssertionError("pin_memory=True gave a batch that is not pinned")


def train_epoch(
    trainer: Trainer,
    batches: Iterable[Any],
    pinned: bool,
    shape: tuple[int, ...],
    server: ObjectServerProcess,
) -> dict[str, Any]:
    """One epoch: samples/s, the share of wall time the loop waited for its next batch, the
    machine's CPU per sample (and the training process's and the server's), and the indices
    the batches carried (``jpeg``'s ``(images, indices)`` batches; none for synthetic)."""
    pinned = pinned and trainer.device.type == "cuda"  # nothing is pinned without CUDA
    trainer.sync()
    busy0 = _cpu_times()
    main0, server0 = time.process_time(), server.cpu()
    t0 = time.perf_counter()
    waited = 0.0
    seen = 0
    ids: list[int] = []
    it = iter(batches)
    while True:
        w0 = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            break
        waited += time.perf_counter() - w0
        images, index = batch if isinstance(batch, list | tuple) else (batch, None)
        check_batch(images, index, shape, pinned)
        gpu = images.to(trainer.device, non_blocking=True)
        if gpu.device.type != trainer.device.type:
            raise AssertionError(f"the batch is on {gpu.device}, not on {trainer.device}")
        if index is not None:
            ids.extend(index.tolist())
        elif seen % (BATCH * 16) == 0:  # checked now and then: a check synchronises the stream
            first_index = seen  # sequential sampler: the batch starts at sample `seen`
            expected = torch.frombuffer(
                bytearray(object_bytes(first_index, SIZE)), dtype=torch.uint8
            )
            if not torch.equal(gpu[0].flatten().cpu(), expected):
                raise AssertionError(f"batch starting at {first_index} holds the wrong bytes")
        trainer.step(gpu)
        seen += images.shape[0]
    trainer.sync()
    elapsed = time.perf_counter() - t0
    busy1 = _cpu_times()
    busy = (busy1[0] - busy0[0]) / max(1e-9, busy1[1] - busy0[1])
    per_sample = 1000 / max(1, seen)
    return {
        "rate": seen / elapsed,
        "wait": waited / elapsed,
        "samples": seen,
        "ids": ids,
        "busy": busy,
        # ms of CPU per sample: the whole machine's (every CPU's busy time in /proc/stat, in
        # USER_HZ ticks), the training process's (its loop, the pin-memory thread, CUDA's
        # threads) and the store's server's (nan where /proc cannot tell)
        "cpu_ms": (busy1[0] - busy0[0]) / os.sysconf("SC_CLK_TCK") * per_sample,
        "main_ms": (time.process_time() - main0) * per_sample,
        "server_ms": (server.cpu() - server0) * per_sample,
    }


def _cpu_times() -> tuple[float, float]:
    """The machine's (busy, total) CPU time so far, from /proc/stat (zeros where there is none)."""
    try:
        fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return 0.0, 0.0
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def ceiling(trainer: Trainer, batch: torch.Tensor, n: int) -> dict[str, float]:
    """*n* samples' worth of steps on *batch*, already on the training device."""
    for _ in range(5):
        trainer.step(batch)
    trainer.sync()
    t0 = time.perf_counter()
    for _ in range(n // BATCH):
        trainer.step(batch)
    trainer.sync()
    return {"rate": (n // BATCH) * BATCH / (time.perf_counter() - t0), "wait": 0.0}


def run_loader(
    trainer: Trainer, loader: Any, pinned: bool, shape: tuple[int, ...], server: ObjectServerProcess
) -> dict[str, float]:
    n = len(loader.dataset)
    for epoch in ("warm-up", "timed"):  # warm-up: workers started, connections opened
        result = train_epoch(trainer, loader, pinned, shape, server)
        if result["samples"] != n:
            raise AssertionError(f"{epoch} epoch: {result['samples']} samples of {n}")
        ids = result.pop("ids")
        if ids and sorted(ids) != list(range(n)):
            missing = sorted(set(range(n)) - set(ids))[:5]
            raise AssertionError(
                f"{epoch} epoch: {len(set(ids))} distinct indices of {n}, missing e.g. {missing}"
            )
    return result


# Loader settings from the command line (--max-concurrency, --decode-in-thread).
OPTIONS: dict[str, Any] = {}


def asyncload_rows(
    trainer: Trainer,
    dataset: Any,
    workers: int,
    shape: tuple[int, ...],
    server: ObjectServerProcess,
) -> dict[str, dict[str, float]]:
    """The two asyncload rows over *dataset*: ``pin_memory=True``, then ``False``."""
    rows = {}
    for pin in (True, False):
        loader = asyncload.DataLoader(
            dataset,
            batch_size=BATCH,
            num_workers=workers,
            pin_memory=pin,
            persistent_workers=True,
            max_concurrency=OPTIONS.get("max_concurrency"),
            cpu_threads=OPTIONS.get("cpu_threads"),
        )
        row = run_loader(trainer, loader, pin, shape, server)
        rows[f"asyncload.DataLoader, pin_memory={pin}"] = row
        st = loader.stats()  # the timed epoch's: which stage bounds it, and the CPU lane's use
        print(
            f"asyncload pin_memory={pin}: bound by {st.bound_by or '-'}, workers' CPU "
            f"{st.worker_cpu_s:.1f} s, CPU lane {st.cpu_lane_s:.1f} s, waiting {st.wait_s:.1f} s "
            f"of {st.elapsed_s:.1f} s; CPU ms per sample: machine {row['cpu_ms']:.2f}, workers "
            f"{st.worker_cpu_s * 1000 / max(1, st.samples):.2f} (lanes "
            f"{st.cpu_lane_s * 1000 / max(1, st.samples):.2f}), training process "
            f"{row['main_ms']:.2f}, server {row['server_ms']:.2f}; in-flight limits "
            f"{'/'.join(map(str, st.concurrency))}, fetch p50 {st.latency_p50 * 1000:.0f} ms",
            flush=True,
        )
        del loader
    return rows


def torch_row(
    trainer: Trainer,
    dataset: Any,
    workers: int,
    shape: tuple[int, ...],
    server: ObjectServerProcess,
    **kw: Any,
) -> dict[str, float]:
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=BATCH,
        num_workers=workers,
        pin_memory=True,
        persistent_workers=True,
        **kw,
    )
    row = run_loader(trainer, loader, True, shape, server)
    print(
        f"torch: CPU ms per sample: machine {row['cpu_ms']:.2f}, training process "
        f"{row['main_ms']:.2f}, server {row['server_ms']:.2f}",
        flush=True,
    )
    return row


def run_synthetic(
    device: torch.device, n: int, workers: int, _: argparse.Namespace
) -> tuple[dict[str, dict[str, float]], str]:
    trainer = Trainer(device)
    batch = torch.randint(0, 255, (BATCH, *SHAPE), dtype=torch.uint8, device=trainer.device)
    rows = {CEILING: ceiling(trainer, batch, n)}
    with ObjectServerProcess() as server:
        urls = [server.url_for(index=i, size=SIZE, latency=LATENCY) for i in range(n)]
        rows |= asyncload_rows(
            trainer, asyncload.RemoteFiles(urls, decode=to_image), workers, SHAPE, server
        )
        host, port = server.base_url.removeprefix("http://").split(":")
        prefix = server.prefix(SIZE, LATENCY).split(server.base_url, 1)[1]
        dataset = ThreadedBlobs(host, int(port), prefix, n)
        if not OPTIONS.get("skip_torch"):
            rows["torch DataLoader + 32 threads, pin_memory=True"] = torch_row(
                trainer, dataset, workers, SHAPE, server, collate_fn=collate_images
            )
    return rows, f"{n} images 3x128x128"


class CorpusServer(bench_pipeline.FileServerProcess):
    """``bench_pipeline``'s file server, started as this script's ``--serve`` (which has the
    psutil fallback above: ``bench_pipeline.py --serve`` needs psutil installed)."""

    start_timeout = 120.0  # it imports torch first

    def command(self) -> list[str]:
        return [sys.executable, __file__, "--serve", *map(str, self.folders)]


_DECODE: dict[str, Any] = {}  # what a parallel_decode_rate process inherits


def _inherit(blobs: list[bytes], start: Any) -> None:
    _DECODE.update(blobs=blobs, start=start)


def _decode_all(_: int) -> tuple[float, float, int]:
    blobs = _DECODE["blobs"]
    bench_pipeline.decode_image(blobs[0])  # first-call imports and allocations, untimed
    _DECODE["start"].wait()
    t0 = time.perf_counter()
    for _ in range(4):
        for data in blobs:
            bench_pipeline.decode_image(data)
    return t0, time.perf_counter(), 4 * len(blobs)


def cores_here() -> int:
    return len(os.sched_getaffinity(0))


def parallel_decode_rate(blobs: list[bytes], processes: int) -> float:
    """Images/s that *processes* processes decode at once, each from bytes in its own memory
    (no loader, no IPC): what the machine's cores can feed at most."""
    ctx = multiprocessing.get_context("fork")  # the barrier is inherited, never pickled
    start = ctx.Barrier(processes)
    with concurrent.futures.ProcessPoolExecutor(
        processes, mp_context=ctx, initializer=_inherit, initargs=(blobs, start)
    ) as pool:
        got = list(pool.map(_decode_all, range(processes), timeout=600))
    return sum(g[2] for g in got) / (max(g[1] for g in got) - min(g[0] for g in got))


def run_jpeg(
    device: torch.device, n: int, workers: int, args: argparse.Namespace
) -> tuple[dict[str, dict[str, float]], str]:
    root = Path(args.data or Path(tempfile.gettempdir()) / "asyncload-bench-pipeline")
    folder = bench_pipeline.ensure_corpus(root, "images", n)  # forks: before CUDA is initialised
    blobs = [Path(p).read_bytes() for p in bench_pipeline._paths(folder, "images", min(n, 256))]
    t0 = time.perf_counter()
    decoded = [bench_pipeline.decode_image(b) for b in blobs]
    per_image = (time.perf_counter() - t0) / len(blobs)
    print(
        f"decode + augment: {per_image * 1000:.2f} ms per image on one core here, so "
        f"{workers} workers decode at most ~{workers / per_image:,.0f} images/s",
        flush=True,
    )
    cores = cores_here()
    for processes in sorted({workers, cores}):  # forks: before CUDA is initialised
        rate = parallel_decode_rate(blobs, processes)
        print(
            f"decode + augment in {processes} processes at once: {rate:,.0f} images/s "
            f"({processes * 1000 / rate:.2f} ms of CPU per image)"
        )
    OPTIONS["cpu_ceiling"] = rate  # every core decoding: no loader on these CPUs feeds more
    trainer = Trainer(device)
    batch = torch.stack([image for image, _ in decoded[:BATCH]]).to(trainer.device)
    rows = {CEILING: ceiling(trainer, batch, n)}
    latency = f"{LATENCY * 1000:g}"
    with CorpusServer([folder]) as server:
        urls = bench_pipeline._urls("http", server.base_url, "images", latency, n)
        dataset = asyncload.RemoteFiles(
            urls,
            decode=bench_pipeline.decode_image,
            decode_in_thread=OPTIONS.get("decode_in_thread"),
        )
        rows |= asyncload_rows(trainer, dataset, workers, JPEG_SHAPE, server)
        host, port = server.base_url.removeprefix("http://").split(":")
        prefix = f"/{BUCKET}/{bench_pipeline.CORPUS_ID['images']}/{latency}"
        threaded = bench_pipeline.ThreadedDecoded(
            host, int(port), prefix, n, bench_pipeline.decode_image
        )
        if not OPTIONS.get("skip_torch"):
            rows["torch DataLoader + 32 threads (GET + decode), pin_memory=True"] = torch_row(
                trainer, threaded, workers, JPEG_SHAPE, server
            )
    w, h = bench_pipeline.IMAGE_W, bench_pipeline.IMAGE_H
    return rows, f"{n} JPEGs {w}x{h} -> decode + RandomResizedCrop(224) + flip in the workers"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline", choices=("synthetic", "jpeg"), default="synthetic")
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--data", help="jpeg: where the corpus is generated and cached")
    parser.add_argument(
        "--allow-cpu", action="store_true", help="without CUDA, run on the CPU (a smoke test)"
    )
    parser.add_argument(
        "--max-concurrency", type=int, default=None, help="asyncload rows (default: automatic)"
    )
    parser.add_argument(
        "--decode-in-thread",
        choices=("auto", "on", "off"),
        default="auto",
        help="jpeg: decode on the workers' CPU lanes (auto: the loader's default)",
    )
    parser.add_argument(
        "--cpu-threads", type=int, default=None, help="asyncload rows (default: automatic)"
    )
    parser.add_argument("--skip-torch", action="store_true", help="leave out the torch row")
    parser.add_argument("--serve", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    in_thread = {"auto": None, "on": True, "off": False}[args.decode_in_thread]
    OPTIONS.update(
        max_concurrency=args.max_concurrency,
        decode_in_thread=in_thread,
        cpu_threads=args.cpu_threads,
        skip_torch=args.skip_torch,
    )
    if args.serve:  # the jpeg pipeline's file server (CorpusServer), in its own process
        bench_pipeline._serve_files(args.serve)
        return 0
    if args.samples < BATCH:
        parser.error(f"--samples must be at least the batch size ({BATCH})")
    if torch.cuda.is_available():
        device = torch.device("cuda")
        where = torch.cuda.get_device_name()
    elif args.allow_cpu:
        device = torch.device("cpu")
        where = "the CPU (--allow-cpu: a smoke test, not a measurement)"
    else:
        print("bench_gpu: no CUDA device here; run it on a machine with a GPU (or --allow-cpu).")
        return 0
    n, workers = args.samples, args.workers
    run = run_jpeg if args.pipeline == "jpeg" else run_synthetic
    rows, what = run(device, n, workers, args)
    print(
        f"\nTraining on {where}: {what}, at {LATENCY * 1000:g} ms per request, batch {BATCH}, "
        f"{workers} workers\n"
    )
    top = rows[CEILING]["rate"]
    print(
        "| row | samples/s | share of time waiting for data | machine's cores busy "
        "| machine CPU ms/sample | of the compute ceiling |"
    )
    print("|---|---|---|---|---|---|")
    for label, row in rows.items():
        busy = f"{row['busy']:.0%}" if "busy" in row else "-"
        cpu = f"{row['cpu_ms']:.2f}" if "cpu_ms" in row else "-"
        print(
            f"| {label} | {row['rate']:,.0f} | {row['wait']:.0%} | {busy} | {cpu} "
            f"| {row['rate'] / top:.2f} |"
        )
    if args.pipeline == "jpeg" and device.type == "cuda":
        ratio = rows["asyncload.DataLoader, pin_memory=True"]["rate"] / top
        verdict = "met" if ratio >= TARGET else "MISSED"
        print(
            f"\ntarget (issue 32): asyncload pin_memory=True / compute ceiling >= {TARGET}: "
            f"{ratio:.2f} {verdict} ({workers} workers; the issue's run uses 8, on a GPU)"
        )
        cpu_top = OPTIONS["cpu_ceiling"]
        print(
            f"CPU ceiling ({cores_here()} processes decoding, no loader) / compute ceiling: "
            f"{cpu_top / top:.2f}; asyncload pin_memory=True / CPU ceiling: "
            f"{ratio * top / cpu_top:.2f}"
            + (" (the target is beyond what these cores decode)" if cpu_top < TARGET * top else "")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
