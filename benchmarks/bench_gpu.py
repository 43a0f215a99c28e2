"""End-to-end training on a GPU fed from a 50 ms store: asyncload vs torch's DataLoader.

One run, one table; needs CUDA (it says so and exits otherwise). N images (3 x 128 x 128 uint8,
49 KB) behind the loopback object server (``_server.py``, its own process) at 50 ms per
request. A small conv net trains on them with bf16 autocast. Rows:

* **compute ceiling**: the same steps on one batch already on the GPU (no loading at all);
* ``asyncload.DataLoader`` (``RemoteFiles`` decoding each object into a tensor, 4 workers,
  batch 64), ``pin_memory=True``, copies with ``non_blocking=True``;
* the same with ``pin_memory=False``;
* torch's ``DataLoader`` (4 workers, batch 64, ``pin_memory=True``) over a blocking dataset
  with a 32-thread pool in ``__getitems__`` (``bench_loader.ThreadedBlobs``), the best plain
  torch can do.

Each loader row runs one warm-up epoch, then a timed epoch on persistent workers: samples/s of
the training loop and the share of its time spent waiting for data. Every batch is checked:
pinned when asked for, on the GPU, and its first image holds the object's bytes.

    python benchmarks/bench_gpu.py              # about a minute on one GPU
    python benchmarks/bench_gpu.py --samples 2048 --workers 8
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.utils.data
from _server import ObjectServerProcess, object_bytes
from bench_loader import ThreadedBlobs

import asyncload

SHAPE = (3, 128, 128)
SIZE = SHAPE[0] * SHAPE[1] * SHAPE[2]
LATENCY = 0.05
BATCH = 64


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
    def __init__(self) -> None:
        self.model = make_model().cuda().to(memory_format=torch.channels_last)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.mean = torch.tensor([0.485, 0.456, 0.406], device="cuda").view(1, 3, 1, 1) * 255
        self.std = torch.tensor([0.229, 0.224, 0.225], device="cuda").view(1, 3, 1, 1) * 255

    def step(self, images: torch.Tensor) -> None:
        x = ((images.float() - self.mean) / self.std).contiguous(memory_format=torch.channels_last)
        target = torch.zeros(x.shape[0], dtype=torch.long, device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(self.model(x), target)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()


def train_epoch(
    trainer: Trainer, batches: Iterable[torch.Tensor], pinned: bool
) -> dict[str, float]:
    """One epoch: samples/s, and the share of wall time the loop waited for its next batch."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    waited = 0.0
    seen = 0
    it = iter(batches)
    while True:
        w0 = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            break
        waited += time.perf_counter() - w0
        if pinned and not batch.is_pinned():
            raise AssertionError("pin_memory=True gave a batch that is not pinned")
        first_index = seen  # sequential sampler: the batch starts at sample `seen`
        gpu = batch.cuda(non_blocking=True)
        if seen % (BATCH * 16) == 0:  # checked now and then: a check synchronises the stream
            expected = torch.frombuffer(
                bytearray(object_bytes(first_index, SIZE)), dtype=torch.uint8
            )
            if not torch.equal(gpu[0].flatten().cpu(), expected):
                raise AssertionError(f"batch starting at {first_index} holds the wrong bytes")
        trainer.step(gpu)
        seen += batch.shape[0]
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    return {"rate": seen / elapsed, "wait": waited / elapsed, "samples": seen}


def ceiling(trainer: Trainer, n: int) -> dict[str, float]:
    batch = torch.randint(0, 255, (BATCH, *SHAPE), dtype=torch.uint8, device="cuda")
    for _ in range(5):
        trainer.step(batch)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n // BATCH):
        trainer.step(batch)
    torch.cuda.synchronize()
    return {"rate": (n // BATCH) * BATCH / (time.perf_counter() - t0), "wait": 0.0}


def run_loader(trainer: Trainer, loader: Any, pinned: bool) -> dict[str, float]:
    train_epoch(trainer, loader, pinned)  # warm-up: workers started, connections opened
    result = train_epoch(trainer, loader, pinned)
    if result["samples"] != len(loader.dataset):
        raise AssertionError(f"{result['samples']} samples of {len(loader.dataset)}")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here; run it on a machine with a GPU.")
        return 0
    n, workers = args.samples, args.workers
    trainer = Trainer()
    rows: dict[str, dict[str, float]] = {
        "compute ceiling (batch already on the GPU)": ceiling(trainer, n)
    }
    with ObjectServerProcess() as server:
        urls = [server.url_for(index=i, size=SIZE, latency=LATENCY) for i in range(n)]
        for pin in (True, False):
            loader = asyncload.DataLoader(
                asyncload.RemoteFiles(urls, decode=to_image),
                batch_size=BATCH,
                num_workers=workers,
                pin_memory=pin,
                persistent_workers=True,
            )
            rows[f"asyncload.DataLoader, pin_memory={pin}"] = run_loader(trainer, loader, pin)
            del loader
        host, port = server.base_url.removeprefix("http://").split(":")
        prefix = server.prefix(SIZE, LATENCY).split(server.base_url, 1)[1]
        torch_loader = torch.utils.data.DataLoader(
            ThreadedBlobs(host, int(port), prefix, n),
            batch_size=BATCH,
            num_workers=workers,
            pin_memory=True,
            persistent_workers=True,
            collate_fn=collate_images,
        )
        rows["torch DataLoader + 32 threads, pin_memory=True"] = run_loader(
            trainer, torch_loader, True
        )
    print(
        f"\nTraining on {torch.cuda.get_device_name()}: {n} images 3x128x128 at "
        f"{LATENCY * 1000:g} ms per request, batch {BATCH}, {workers} workers\n"
    )
    top = rows["compute ceiling (batch already on the GPU)"]["rate"]
    print("| row | samples/s | share of time waiting for data | of the compute ceiling |")
    print("|---|---|---|---|")
    for label, row in rows.items():
        print(f"| {label} | {row['rate']:,.0f} | {row['wait']:.0%} | {row['rate'] / top:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
