"""Child-process driver for tests/test_distributed.py (run under torchrun or plain python).

``python tests/_dist_script.py CONFIG.json`` reads what to do from the JSON file and writes what it
saw next to it, so the test can check unions, overlaps and batch counts across processes:

* ``"mode": "ranks"`` (under torchrun, gloo): for each source, iterate one epoch of
  ``TarShards`` with 2 workers and write ``{name}-rank{r}.json`` = ``{"keys", "batches"}``.
* ``"mode": "resume"``, ``"dataset"``: ``"tar"``, ``"map"`` (RemoteFiles) or ``"mix"`` (a
  ``Mix`` of both, ``stop="all"``): iterate ``stop_after`` batches (then save
  ``loader.state_dict()``), or load a saved state and iterate the rest of the epoch; write the
  keys seen (under torchrun, one file per rank: a checkpoint of one rank resumed by two).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

import asyncload
from asyncload.datasets import RemoteFiles, TarShards


def _keys(batch: Any) -> list[str]:
    if _is_keys(batch):
        return list(batch)
    if isinstance(batch, dict):
        return list(batch["__key__"])
    return [bytes(b).decode() for b in batch]  # RemoteFiles: the object bodies are the keys


def _is_keys(batch: Any) -> bool:
    return isinstance(batch, list) and all(isinstance(k, str) for k in batch)


def _mixed_keys(batch: list[Any]) -> list[str]:
    """collate_fn of a Mix of RemoteFiles (bodies are keys) and TarShards (dicts)."""
    return [s["__key__"] if isinstance(s, dict) else bytes(s).decode() for s in batch]


def _build(cfg: dict[str, Any]) -> asyncload.DataLoader[Any]:
    if cfg["dataset"] == "mix":
        tar = TarShards(cfg["urls"], seed=cfg["seed"], shuffle_buffer=cfg["shuffle_buffer"])
        mix = asyncload.Mix([RemoteFiles(cfg["map_urls"]), tar], [1, 2], seed=7, stop="all")
        return asyncload.DataLoader(
            mix, batch_size=cfg["batch_size"], num_workers=2, collate_fn=_mixed_keys
        )
    if cfg["dataset"] == "tar":
        ds: Any = TarShards(
            cfg["urls"],
            seed=cfg.get("seed", 0),
            shuffle_buffer=cfg.get("shuffle_buffer", 0),
            samples_per_rank=cfg.get("samples_per_rank"),
            shards_in_flight=2,
            chunk_size=cfg.get("chunk_size", 1 << 20),
        )
        return asyncload.DataLoader(ds, batch_size=cfg["batch_size"], num_workers=2)
    ds = RemoteFiles(cfg["urls"])
    return asyncload.DataLoader(
        ds,
        batch_size=cfg["batch_size"],
        shuffle=True,
        num_workers=2,
        generator=torch.Generator().manual_seed(cfg.get("seed", 0)),
        collate_fn=list,
    )


def run_ranks(cfg: dict[str, Any], out: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        for source in cfg["sources"]:
            loader = _build(source)
            loader.set_epoch(source.get("epoch", 0))
            keys: list[str] = []
            batches = 0
            for batch in loader:
                keys += _keys(batch)
                batches += 1
            # What DDP cares about: every rank takes the same number of steps.
            counts = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
            dist.all_gather(counts, torch.tensor([batches]))
            result = {"keys": keys, "batches": batches, "all_batches": [int(c) for c in counts]}
            (out / f"{source['name']}-rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def run_resume(cfg: dict[str, Any], out: Path) -> None:
    loader = _build(cfg)
    state_path = out / f"{cfg['name']}-state.pt"
    keys: list[str] = []
    if cfg["phase"] == "first":
        for i, batch in enumerate(loader):
            keys += _keys(batch)
            if i + 1 == cfg["stop_after"]:
                torch.save(loader.state_dict(), state_path)
                break
    else:
        loader.load_state_dict(torch.load(state_path, weights_only=True))
        for batch in loader:
            keys += _keys(batch)
    # Under torchrun (an elastic resume on more ranks) each rank writes its own file.
    rank = f"-rank{os.environ['RANK']}" if "RANK" in os.environ else ""
    (out / f"{cfg['name']}-{cfg['phase']}{rank}.json").write_text(json.dumps(keys))


def main() -> None:
    config_path = Path(sys.argv[1])
    cfg = json.loads(config_path.read_text())
    if cfg["mode"] == "ranks":
        run_ranks(cfg, config_path.parent)
    else:
        run_resume(cfg, config_path.parent)


if __name__ == "__main__":
    main()
