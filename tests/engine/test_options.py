"""The loader's arguments that every worker reads (``_engine/options.py``): added in two places.

A new one is a ``WorkerOptions`` field and a ``DataLoader.__init__`` argument; the pass's
settings and the code that starts workers carry the options whole and never name them.
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest

import asyncload
from asyncload._dataset import cpu as _cpu
from asyncload._engine import WorkerOptions

SRC = Path(asyncload.__file__).parent
# Options the loader works out from an argument of another name.
DERIVED = {"skip_sample_errors": "sample_errors"}


class LaneSize(asyncload.Dataset[int]):
    """Each sample is the size of the CPU lane of the worker that fetched it."""

    def __len__(self) -> int:
        return 4

    async def __getitem__(self, index: int) -> int:
        lane = _cpu.current()
        assert lane is not None
        return lane.size


@pytest.mark.timeout(10)
def test_every_option_is_a_keyword_only_loader_argument() -> None:
    params = inspect.signature(asyncload.DataLoader.__init__).parameters
    for field in dataclasses.fields(WorkerOptions):
        name = DERIVED.get(field.name, field.name)
        assert name in params, f"WorkerOptions.{field.name} has no DataLoader argument {name}"
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, name
        assert name in (asyncload.DataLoader.__doc__ or ""), f"{name} is not documented"


@pytest.mark.timeout(10)
def test_the_pass_settings_and_the_start_carry_the_options_whole() -> None:
    names = [f.name for f in dataclasses.fields(WorkerOptions)]
    for module in ("_loader/spec.py", "_loader/start.py"):
        text = (SRC / module).read_text()
        assert "worker_options" in text
        named = [n for n in names if n in text]
        assert not named, f"{module} names {named}: WorkerOptions carries them"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_loaders_options_reach_every_worker(num_workers: int) -> None:
    loader = asyncload.DataLoader(
        LaneSize(), batch_size=2, num_workers=num_workers, cpu_threads=3, max_concurrency=5
    )
    assert (loader.cpu_threads, loader.max_concurrency) == (3, 5)
    assert sorted(int(x) for batch in loader for x in batch) == [3, 3, 3, 3]
    assert asyncload.DataLoader(LaneSize(), max_concurrency="auto").max_concurrency is None


@pytest.mark.timeout(10)
def test_a_bad_option_is_refused_by_the_loader_with_its_name() -> None:
    with pytest.raises(ValueError, match="cpu_threads must be a positive integer"):
        asyncload.DataLoader(LaneSize(), cpu_threads=0)
    with pytest.raises(ValueError, match="max_concurrency must be a positive integer"):
        WorkerOptions(max_concurrency=0)
