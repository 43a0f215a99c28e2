"""Write tar shards from a folder of files, serve them over HTTP, train from them, and resume.

1. a folder of samples (``cat/0001.npy`` + ``cat/0001.cls``, ...) is packed into tar shards
   with ``asyncload.datasets.write_shards``;
2. a loopback HTTP server (the standard library's) serves the shards, standing in for S3;
3. a small model trains two epochs from ``asyncload.TarShards`` with 2 workers, reshuffling
   per epoch with ``loader.set_epoch``;
4. an interrupted epoch is resumed from ``loader.state_dict()`` with no sample lost or repeated.

python examples/write_shards.py
"""

from __future__ import annotations

import functools
import http.server
import io
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch

import asyncload
from asyncload.datasets import TarShards, write_shards


def decode_npy(data: bytes) -> np.ndarray:
    # Module level, so forkserver workers can unpickle it. np.load refuses pickles by default.
    return np.load(io.BytesIO(data))


def make_folder(root: Path, n: int = 400) -> None:
    rng = np.random.default_rng(0)
    for i in range(n):
        label = i % 4
        folder = root / f"class{label}"
        folder.mkdir(parents=True, exist_ok=True)
        x = rng.normal(loc=label, size=16).astype(np.float32)
        buf = io.BytesIO()
        np.save(buf, x)
        (folder / f"{i:05d}.npy").write_bytes(buf.getvalue())
        (folder / f"{i:05d}.cls").write_text(str(label))


def serve(directory: Path) -> http.server.ThreadingHTTPServer:
    handler = functools.partial(QuietHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def loader_for(urls: list[str]) -> asyncload.DataLoader[dict[str, torch.Tensor]]:
    dataset = TarShards(urls, shuffle_buffer=64, seed=0, decoders={"npy": decode_npy, "cls": int})
    return asyncload.DataLoader(dataset, batch_size=32, num_workers=2)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_folder(root / "files")
        paths = write_shards(root / "files", root / "shards", samples_per_shard=50)
        print(paths)  # a summary: shards, samples, files, bytes, and any files left out
        server = serve(root / "shards")
        try:
            base = f"http://127.0.0.1:{server.server_address[1]}"
            urls = [f"{base}/{Path(p).name}" for p in paths]

            torch.manual_seed(0)
            model = torch.nn.Linear(16, 4)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            loader = loader_for(urls)
            for epoch in range(2):
                loader.set_epoch(epoch)  # a new shard order and shuffle every epoch
                for batch in loader:
                    loss = torch.nn.functional.cross_entropy(model(batch["npy"]), batch["cls"])
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                print(f"epoch {epoch}: loss {loss.item():.3f}")

            # Interrupted mid-epoch: save where the loader stands, continue in a fresh loader.
            seen: list[str] = []
            for i, batch in enumerate(loader):
                seen += batch["__key__"]
                if i == 3:
                    state = loader.state_dict()
                    break
            resumed = loader_for(urls)
            resumed.load_state_dict(state)
            for batch in resumed:
                seen += batch["__key__"]
            assert len(seen) == len(set(seen)) == 400, len(seen)
            print(f"resumed epoch: {len(seen)} samples, none lost or repeated")
        finally:
            server.shutdown()
            server.server_close()


if __name__ == "__main__":
    main()
