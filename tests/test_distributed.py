"""Across processes: ``torchrun --nproc_per_node=2`` over HTTP and S3 shards, and mid-epoch resume
in a new process (TarShards and a map-style dataset), with random per-request latency.

The work happens in ``tests/_dist_script.py`` child processes; these tests set up the shards on
the loopback servers, run the children, and check what each one wrote.
"""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest

from ._http_server import ObjectServer
from ._s3_server import S3Server

SCRIPT = Path(__file__).with_name("_dist_script.py")
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leaks")]


def _tar(keys: list[str]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for key in keys:
            for ext, data in (("txt", key.encode() * 20), ("cls", b"1")):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _shards(n_shards: int, per_shard: int | list[int], prefix: str) -> dict[str, bytes]:
    sizes = per_shard if isinstance(per_shard, list) else [per_shard] * n_shards
    shards, first = {}, 0
    for s, size in enumerate(sizes):
        shards[f"{prefix}/shard-{s:04d}.tar"] = _tar(
            [f"{prefix}/{i:05d}" for i in range(first, first + size)]
        )
        first += size
    return shards


def _all_keys(shards: dict[str, bytes]) -> list[str]:
    keys = []
    for data in shards.values():
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            keys += sorted({n.rsplit(".", 1)[0] for n in tar.getnames()})
    return sorted(keys)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(args: list[str], timeout: float) -> None:
    # This checkout's sources first: the venv may hold another checkout's install.
    root = SCRIPT.parent.parent
    path = os.pathsep.join([str(root / "src"), str(root)])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    proc = subprocess.run(
        args, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"


def _run_script(config: dict[str, Any], tmp_path: Path, timeout: float = 60) -> None:
    path = tmp_path / f"config-{config.get('name', 'ranks')}-{config.get('phase', '')}.json"
    path.write_text(json.dumps(config))
    _run([sys.executable, str(SCRIPT), str(path)], timeout)


@pytest.mark.timeout(150)
def test_torchrun_two_ranks_http_and_s3(
    http_server: ObjectServer, s3_server: S3Server, tmp_path: Path
) -> None:
    http_shards = _shards(8, 15, "h")
    http_urls = [http_server.put(k, v) for k, v in http_shards.items()]
    s3_shards = _shards(8, 12, "s")
    bucket = s3_server.bucket("shards", s3_shards)
    s3_urls = [f"{bucket}/{k}" for k in s3_shards]
    # Uneven: 9 shards of 5–17 samples; samples_per_rank evens the ranks out.
    uneven_shards = _shards(9, [5, 17, 9, 11, 6, 13, 8, 10, 7], "u")
    uneven_urls = [http_server.put(k, v) for k, v in uneven_shards.items()]
    http_server.jitter = 0.02

    common = {"dataset": "tar", "batch_size": 4, "shuffle_buffer": 8, "seed": 5}
    config = {
        "mode": "ranks",
        "sources": [
            {**common, "name": "http", "urls": http_urls, "epoch": 3},
            {**common, "name": "s3", "urls": s3_urls},
            {**common, "name": "uneven", "urls": uneven_urls, "samples_per_rank": 40},
        ],
    }
    (tmp_path / "ranks.json").write_text(json.dumps(config))
    _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            "--master_addr=127.0.0.1",
            f"--master_port={_free_port()}",
            str(SCRIPT),
            str(tmp_path / "ranks.json"),
        ],
        timeout=140,
    )

    def load(name: str) -> list[dict[str, Any]]:
        return [json.loads((tmp_path / f"{name}-rank{r}.json").read_text()) for r in (0, 1)]

    for name, shards in (("http", http_shards), ("s3", s3_shards)):
        ranks = load(name)
        k0, k1 = ranks[0]["keys"], ranks[1]["keys"]
        assert not set(k0) & set(k1), f"{name}: ranks overlap"
        assert sorted(k0 + k1) == _all_keys(shards), f"{name}: union is not the dataset"
        assert ranks[0]["batches"] == ranks[1]["batches"], f"{name}: unequal batches"
    uneven = load("uneven")
    assert [len(r["keys"]) for r in uneven] == [40, 40]
    assert uneven[0]["all_batches"] == uneven[1]["all_batches"] == [uneven[0]["batches"]] * 2
    assert not set(uneven[0]["keys"]) & set(uneven[1]["keys"])


def _check_resume(
    config: dict[str, Any], everything: list[str], tmp_path: Path, stop_after: int
) -> None:
    _run_script({**config, "phase": "first", "stop_after": stop_after}, tmp_path)
    _run_script({**config, "phase": "rest"}, tmp_path)
    first = json.loads((tmp_path / f"{config['name']}-first.json").read_text())
    rest = json.loads((tmp_path / f"{config['name']}-rest.json").read_text())
    assert len(first) == stop_after * config["batch_size"]
    assert not set(first) & set(rest), "samples repeated after the restore"
    assert sorted(first + rest) == sorted(everything), "samples lost across the restore"


@pytest.mark.timeout(90)
def test_resume_tar_shards_in_a_new_process(http_server: ObjectServer, tmp_path: Path) -> None:
    shards = _shards(6, 14, "r")
    urls = [http_server.put(k, v) for k, v in shards.items()]
    http_server.jitter = 0.03  # completions come back out of order
    config = {
        "mode": "resume",
        "name": "tar",
        "dataset": "tar",
        "urls": urls,
        "batch_size": 5,
        "shuffle_buffer": 10,
        "seed": 11,
        "chunk_size": 700,
    }
    _check_resume(config, _all_keys(shards), tmp_path, stop_after=5)


@pytest.mark.timeout(90)
def test_resume_map_style_in_a_new_process(http_server: ObjectServer, tmp_path: Path) -> None:
    names = [f"obj-{i:03d}" for i in range(90)]
    urls = [http_server.put(f"m/{n}", n.encode()) for n in names]
    http_server.jitter = 0.03
    config = {"mode": "resume", "name": "map", "dataset": "map", "urls": urls, "batch_size": 6}
    _check_resume(config, names, tmp_path, stop_after=4)


def _torchrun(config: dict[str, Any], tmp_path: Path, nproc: int, timeout: float) -> None:
    path = tmp_path / f"config-{config['name']}-{config['phase']}.json"
    path.write_text(json.dumps(config))
    args = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
    args += ["--master_addr=127.0.0.1", f"--master_port={_free_port()}", str(SCRIPT), str(path)]
    _run(args, timeout)


def _check_one_rank_to_two(
    config: dict[str, Any], everything: list[str], tmp_path: Path, stop_after: int
) -> None:
    """A checkpoint of one rank resumed by two ranks (torchrun): the epoch exactly once."""
    _run_script({**config, "phase": "first", "stop_after": stop_after}, tmp_path)
    _torchrun({**config, "phase": "rest"}, tmp_path, 2, timeout=100)
    first = json.loads((tmp_path / f"{config['name']}-first.json").read_text())
    ranks = [
        json.loads((tmp_path / f"{config['name']}-rest-rank{r}.json").read_text()) for r in (0, 1)
    ]
    assert len(first) == stop_after * config["batch_size"]
    assert all(ranks), "a rank got nothing of the rest"
    delivered = first + ranks[0] + ranks[1]
    assert len(delivered) == len(set(delivered)), "samples repeated after the restore"
    assert sorted(delivered) == sorted(everything), "samples lost across the restore"


@pytest.mark.timeout(150)
@pytest.mark.parametrize("shuffle_buffer", [0, 10])
def test_resume_tar_shards_one_rank_to_two(
    http_server: ObjectServer, tmp_path: Path, shuffle_buffer: int
) -> None:
    shards = _shards(6, 14, "e")
    urls = [http_server.put(k, v) for k, v in shards.items()]
    http_server.jitter = 0.02
    config = {
        "mode": "resume",
        "name": "tar-elastic",
        "dataset": "tar",
        "urls": urls,
        "batch_size": 5,
        "shuffle_buffer": shuffle_buffer,
        "seed": 11,
        "chunk_size": 700,
    }
    _check_one_rank_to_two(config, _all_keys(shards), tmp_path, stop_after=5)


@pytest.mark.timeout(150)
def test_resume_map_style_one_rank_to_two(http_server: ObjectServer, tmp_path: Path) -> None:
    names = [f"obj-{i:03d}" for i in range(90)]
    urls = [http_server.put(f"me/{n}", n.encode()) for n in names]
    config = {
        "mode": "resume",
        "name": "map-elastic",
        "dataset": "map",
        "urls": urls,
        "batch_size": 6,
    }
    _check_one_rank_to_two(config, names, tmp_path, stop_after=4)


@pytest.mark.timeout(150)
def test_resume_mix_one_rank_to_two(http_server: ObjectServer, tmp_path: Path) -> None:
    """A Mix of RemoteFiles and TarShards (stop="all"): every sample of both exactly once."""
    shards = _shards(4, 14, "x")
    urls = [http_server.put(k, v) for k, v in shards.items()]
    names = [f"mix-{i:03d}" for i in range(40)]
    map_urls = [http_server.put(f"mx/{n}", n.encode()) for n in names]
    config = {
        "mode": "resume",
        "name": "mix-elastic",
        "dataset": "mix",
        "urls": urls,
        "map_urls": map_urls,
        "batch_size": 6,
        "shuffle_buffer": 10,
        "seed": 11,
    }
    _check_one_rank_to_two(config, _all_keys(shards) + names, tmp_path, stop_after=4)
