"""Image classification over HTTP from class folders: the label comes from each file's URL.

The ImageFolder layout (``train/<class>/<file>``), served by a loopback HTTP server that stands
in for a bucket or a web server:

1. small 8x8 "images" of three classes are saved as ``.npy`` files under ``train/<class>/`` and
   ``val/<class>/``, with a ``manifest.txt`` listing them (plain HTTP has no listing);
2. ``asyncload.RemoteFiles`` reads them with 2 workers; its ``decode(data, *, url)`` gets the
   URL too, so the class is the URL's folder, with no subclass and no label file;
3. a small convolutional network trains three epochs and is scored on the validation folders.

No torchvision, no image codec: swap ``decode_npy`` for ``PIL.Image.open`` on real JPEGs.

    python examples/classify_folders.py
"""

from __future__ import annotations

import asyncio
import functools
import http.server
import io
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch

import asyncload

CLASSES = ("circle", "cross", "square")


def decode_npy(data: bytes, *, url: str) -> tuple[torch.Tensor, int]:
    # Module level, so the workers can unpickle it. The keyword-only `url` parameter is what
    # asks RemoteFiles for the URL; `.../train/cross/0007.npy` -> "cross".
    image = torch.from_numpy(np.load(io.BytesIO(data)))  # np.load refuses pickles by default
    label = CLASSES.index(url.rsplit("/", 2)[-2])
    return image.unsqueeze(0), label  # one channel


def draw(kind: str, rng: np.random.Generator) -> np.ndarray:
    y, x = np.mgrid[:8, :8] - 3.5 + rng.normal(scale=0.5, size=2)[:, None, None]
    if kind == "circle":
        image = (np.abs(np.hypot(x, y) - 2.5) < 0.8).astype(np.float32)
    elif kind == "cross":
        image = ((np.abs(x) < 0.8) | (np.abs(y) < 0.8)).astype(np.float32)
    else:
        image = (np.maximum(np.abs(x), np.abs(y)) < 2.6).astype(np.float32)
    return image + rng.normal(scale=0.3, size=image.shape).astype(np.float32)


def make_folders(root: Path, per_class: dict[str, int]) -> None:
    rng = np.random.default_rng(0)
    listing = []
    for split, n in per_class.items():
        for kind in CLASSES:
            folder = root / split / kind
            folder.mkdir(parents=True)
            for i in range(n):
                buf = io.BytesIO()
                np.save(buf, draw(kind, rng))
                (folder / f"{i:04d}.npy").write_bytes(buf.getvalue())
                listing.append(f"{split}/{kind}/{i:04d}.npy")
    (root / "manifest.txt").write_text("\n".join(listing) + "\n")


class Server(http.server.ThreadingHTTPServer):
    # The standard library's default backlog of 5 overflows when a loader opens dozens of
    # connections at once; the dropped ones would be retried by the kernel only after 1 s.
    request_queue_size = 128

    def handle_error(self, request: object, client_address: object) -> None:
        # A hedged read (asyncload sends a second GET for a straggler) closes the losing
        # connection mid-body: the server's write then fails, which is expected, not an error.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)  # type: ignore[arg-type]


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def serve(directory: Path) -> Server:
    server = Server(("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(directory)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


async def read_listing(url: str) -> list[str]:
    try:
        return (await asyncload.read(url)).decode().split()
    finally:
        await asyncload.aclose()  # this process's connections; the workers have their own


def loader_for(urls: list[str], *, train: bool) -> asyncload.DataLoader[list[torch.Tensor]]:
    dataset = asyncload.RemoteFiles(urls, decode=decode_npy)
    # Training reshuffles every epoch and keeps its workers between epochs.
    return asyncload.DataLoader(
        dataset, batch_size=32, shuffle=train, num_workers=2, persistent_workers=train
    )


def main() -> None:
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_folders(root, {"train": 80, "val": 20})
        server = serve(root)
        try:
            base = f"http://127.0.0.1:{server.server_address[1]}"
            listing = asyncio.run(read_listing(f"{base}/manifest.txt"))
            train = [f"{base}/{p}" for p in listing if p.startswith("train/")]
            val = [f"{base}/{p}" for p in listing if p.startswith("val/")]
            print(f"{len(train)} training and {len(val)} validation images in {CLASSES}")

            model = torch.nn.Sequential(
                torch.nn.Conv2d(1, 8, 3, padding=1),
                torch.nn.ReLU(),
                torch.nn.MaxPool2d(2),
                torch.nn.Flatten(),
                torch.nn.Linear(8 * 4 * 4, len(CLASSES)),
            )
            opt = torch.optim.Adam(model.parameters(), lr=0.01)
            loader = loader_for(train, train=True)
            for epoch in range(3):
                for images, labels in loader:
                    loss = torch.nn.functional.cross_entropy(model(images), labels)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                print(f"epoch {epoch}: loss {loss.item():.3f}")

            correct = 0
            with torch.no_grad():
                for images, labels in loader_for(val, train=False):
                    correct += int((model(images).argmax(1) == labels).sum())
            accuracy = correct / len(val)
            print(f"validation accuracy: {accuracy:.0%} ({correct}/{len(val)})")
            assert accuracy > 0.8, "the classes are easy to tell apart: something went wrong"
        finally:
            server.shutdown()
            server.server_close()


if __name__ == "__main__":
    main()
