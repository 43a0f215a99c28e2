"""Smoke tests: ``benchmarks/bench_loader.py``, ``bench_tails.py``, ``bench_cache.py``,
``bench_wholerun.py``, ``bench_pipeline.py``, ``bench_autotune.py``, ``bench_converge.py``,
``bench_lane.py``, ``bench_layers.py``, ``bench_overhead.py`` and ``bench_ab.py`` with ``--quick``
run and print their tables; ``bench_gpu.py`` says it needs CUDA and exits, and its CPU ceiling runs.

Only that it runs: speed depends on whatever else the machine is doing, so no numbers are
checked here.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_loader.py"

ROWS = (
    "asyncload (max_concurrency=128)",
    "torch, 32-thread pool in __getitems__",
    "torch, blocking GET per __getitem__",
    "raw aiohttp, 1 loop, 256 in flight",
)


def _run_quick(script: str, *args: str, timeout: float) -> str:
    """Run ``benchmarks/SCRIPT --quick ARGS`` to completion; return what it printed."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--quick", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_bench_loader_quick_prints_every_row(tmp_path: Path) -> None:
    out_json = tmp_path / "out.json"
    text = _run_quick(SCRIPT.name, "--json", str(out_json), timeout=60)
    for scenario in ("A (I/O-bound)", "B (overhead)"):
        assert scenario in text
    for row in ROWS:
        assert text.count(row) == 2, f"row {row!r} missing from a scenario:\n{text}"
    for target in (
        "asyncload / torch threaded >= 4x",
        "asyncload / raw ceiling >= 0.8x",
        "asyncload / torch blocking >= 1x",
        "USS growth epoch 1→3 < 5%",
    ):
        assert target in text, f"target {target!r} missing:\n{text}"
    assert "Memory growth" in text
    assert "Python list[str] keys" in text
    assert text.count("asyncload.RemoteFiles (NumPy arrays)") == 2  # forkserver and fork

    results = json.loads(out_json.read_text())
    assert set(results["scenarios"]) == {"A", "B"}
    for sc in results["scenarios"].values():
        assert set(sc["rows"]) == {"asyncload", "threaded", "blocking", "raw"}
        assert all(row["samples_per_s"] > 0 for row in sc["rows"].values())
    assert len(results["memory_growth"]) == 3


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bench_tails_quick_prints_its_tables() -> None:
    text = _run_quick("bench_tails.py", timeout=100)
    for row in (
        "asyncload.read loop, hedged",
        "asyncload.read loop, no hedge",
        "raw aiohttp loop",
        "DataLoader, hedged",
        "DataLoader, no hedge",
    ):
        assert text.count(row) == 2, f"row {row!r} missing from a distribution:\n{text}"
    assert "Ratios (this run)" in text
    assert "Hedges within the 5% budget in every row of every round: yes" in text


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bench_cache_quick_prints_its_tables() -> None:
    text = _run_quick("bench_cache.py", timeout=100)
    for row in (
        "no cache",
        "cache, epoch 1",
        "cache, epoch 2",
        "local files",
        "DataLoader, epoch 2",
    ):
        assert row in text, f"row {row!r} missing:\n{text}"
    assert "read loop: epoch 2 / epoch 1" in text
    assert "litdata rows skipped: not installed" in text or "litdata: epoch 2 / epoch 1" in text


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bench_wholerun_quick_prints_its_table() -> None:
    text = _run_quick("bench_wholerun.py", "--samples", "64", timeout=100)
    assert text.count("asyncload.DataLoader (built 2 s before iter())") == 2  # http and s3
    assert text.count("raw loop, 256 in flight") == 2
    assert "workers' CPU µs/sample" in text
    assert "torch DataLoader + 32 threads" in text
    assert "target: http loader / raw loop >= 0.85" in text
    assert "target: s3 loader / raw loop >= 0.85" in text
    # Peers are rows when installed (the `benchmarks` extra), else said to be skipped.
    for peer, label in [
        ("spdl", "SPDL pipeline"),
        ("litdata", "litdata StreamingRawDataset"),
        ("s3torchconnector", "s3torchconnector S3MapDataset"),
    ]:
        assert f"{peer} rows skipped: not installed" in text or label in text, text


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bench_ab_quick_pairs_two_versions(tmp_path: Path) -> None:
    # Two versions: the checkout's src and a copy of it elsewhere (a run that imported the
    # other one would count as failed), each with its own fixed limit (the figures say whose
    # options each run had: 2 workers at 24, and at 16).
    copy = tmp_path / "copy" / "src"
    shutil.copytree(ROOT / "src", copy, ignore=shutil.ignore_patterns("__pycache__"))
    out_json = tmp_path / "ab.json"
    text = _run_quick(
        "bench_ab.py",
        "--tree",
        "here=src",
        "--tree",
        f"copy={copy}",
        "--options",
        'here={"max_concurrency": 24}',
        "--options",
        'copy={"max_concurrency": 16}',
        "--json",
        str(out_json),
        timeout=100,
    )
    assert "failed" not in text, text
    assert "| http | here | 1 of 1 |" in text, text
    assert "| http | copy | 1 of 1 |" in text, text
    row = next(line for line in text.splitlines() if line.startswith("| http | copy |"))
    assert row.split("|")[8].strip() in ("0 of 1", "1 of 1"), row  # its one pair, won or not
    got = json.loads(out_json.read_text())
    runs = got["runs"]["http"]
    assert [r["limit"] for r in runs["here"]] == [48], runs
    assert [r["limit"] for r in runs["copy"]] == [32], runs
    assert Path(runs["copy"][0]["version"]).is_relative_to(copy), runs
    assert got["meta"]["versions"]["copy"] == str(copy), got["meta"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bench_pipeline_quick_prints_its_tables() -> None:
    text = _run_quick(
        "bench_pipeline.py",
        "--images",
        "64",
        "--records",
        "128",
        "--rows",
        "ceiling,torch-local,local,remote-decode",
        "--transports",
        "http",
        timeout=100,
    )
    for pipeline in ("images: 64 samples", "text: 128 samples"):
        assert pipeline in text, text
    for row in (
        "(the CPU ceiling)",
        "torch DataLoader, local files",
        "asyncload RemoteFiles(paths, decode=), local files",
    ):
        assert text.count(row) == 2, f"row {row!r} missing from a pipeline:\n{text}"
    assert text.count("asyncload RemoteFiles(urls, decode=)") == 2
    for target in ("asyncload local / torch local >= 1.1", "http 50 ms / ceiling >= 0.85"):
        assert f"target (images): {target}" in text, text
        assert f"target (text): {target}" in text, text


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_bench_autotune_quick_prints_the_throttling_store() -> None:
    # (c): two loaders of 2 workers on a 2,000 GETs/s store. Whatever the speed, the default
    # reads every object once and fails nothing (a fixed 128 may fail: printed, not raised).
    text = _run_quick("bench_autotune.py", "--scenarios", "c", timeout=80)
    default = [line for line in text.splitlines() if line.startswith("| default |")]
    assert len(default) == 1, text
    assert "| all once | no |" in default[0], text
    assert [line for line in text.splitlines() if line.startswith("| 128 |")], text
    assert "target (c): default goodput" in text, text


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_bench_converge_quick_prints_each_phase() -> None:
    # Two loaders while the store's rate drops from 2,000/s to 1,000/s: a row per phase, every
    # object once, no loader failed (how fast it converged is the benchmark's, not checked).
    text = _run_quick("bench_converge.py", timeout=80)
    rows = [line for line in text.splitlines() if line.startswith(("| start |", "| change 1 |"))]
    assert len(rows) == 2, text
    assert "| 1,000/s |" in rows[1], text
    assert "objects: each once; loader errors: none" in text, text
    assert "target (change 1): converged within 3 s" in text, text


@pytest.mark.timeout(60)
def test_bench_gpu_without_cuda_says_so_and_measures_the_cpu_ceiling() -> None:
    # CI has no GPU: the script says so and exits 0. Its CPU ceiling (processes that only
    # decode) runs anywhere: every process decodes every image it was given, so the rate is
    # 2 processes x 4 passes x 3 images over the time they took together.
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_gpu.py"), "--pipeline", "jpeg"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no CUDA device here" in proc.stdout, proc.stdout + proc.stderr
    code = (
        "import sys; sys.path.insert(0, 'benchmarks'); import bench_gpu, bench_pipeline; "
        "blobs = [bench_pipeline.make_image(i) for i in range(3)]; "
        "print(bench_gpu.parallel_decode_rate(blobs, 2))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=50
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert float(proc.stdout) > 0, proc.stdout


@pytest.mark.timeout(60)
def test_bench_lane_quick_prints_each_way() -> None:
    text = _run_quick("bench_lane.py", timeout=50)
    for way in ("| inline |", "| asyncload.cpu |", "| run_in_executor(lane) |"):
        assert way in text, f"{way} missing:\n{text}"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bench_overhead_quick_prints_each_row() -> None:
    text = _run_quick("bench_overhead.py", timeout=100)
    for row in (
        "| backend.read |",
        "| asyncload.read |",
        "| DataLoader, default |",
        "| DataLoader, max_concurrency=32 |",
    ):
        assert row in text, f"{row} missing:\n{text}"


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_bench_layers_quick_prints_each_layer() -> None:
    text = _run_quick("bench_layers.py", "--samples", "256", timeout=130)
    for layer in (
        "| http | aiohttp |",
        "| http | asyncload's session |",
        "| http | HttpBackend.read |",
        "| http | asyncload.read, no hedging |",
        "| http | asyncload.read |",
        "| http | DataLoader, num_workers=0 |",
    ):
        assert layer in text, f"{layer} missing:\n{text}"
    if "s3:// rows skipped: obstore is not installed" not in text:
        assert "| s3 | obstore.get_range_async |" in text, text
        assert "| s3 | asyncload.read |" in text, text
