"""``loader.stats()``: per pass, in both modes, with hedges, cache, Mix and shard counters."""

from __future__ import annotations

import asyncio
import collections
import io
import tarfile
import time
from pathlib import Path
from typing import Any

import pytest

import asyncload
from asyncload._storage import api as _storage
from asyncload._storage import hedge as _hedge

from .._datasets import spin
from .._http_server import ObjectServer
from ..datasets.test_tar import make_tar, shard_members

pytestmark = pytest.mark.usefixtures("no_leaks")

MODES = [pytest.param(0, id="thread"), pytest.param(2, id="processes")]


def body(i: int) -> bytes:
    return bytes([i % 251]) * 1000 + i.to_bytes(4, "big")


def put(server: ObjectServer, prefix: str, n: int) -> list[str]:
    return [server.put(f"{prefix}/{i}", body(i)) for i in range(n)]


def as_list(batch: list[bytes]) -> list[bytes]:
    return batch


class Numbers(asyncload.Dataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, index: int) -> int:
        await asyncio.sleep(0.001)
        return index


class Tagged(asyncload.Dataset[tuple[int, int]]):
    """Item i of source *tag* is (tag, i)."""

    def __init__(self, tag: int, n: int) -> None:
        self.tag, self.n = tag, n

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, index: int) -> tuple[int, int]:
        return self.tag, index


def test_persistent_workers_report_each_pass_on_its_own() -> None:
    # Issue 12 item 16: worker counters went on across epochs while the clock restarted.
    n = 96
    loader = asyncload.DataLoader(
        Numbers(n), batch_size=8, num_workers=2, persistent_workers=True, max_concurrency=8
    )
    for epoch in range(3):
        assert sorted(i for b in loader for i in b.tolist()) == list(range(n))
        s = loader.stats()
        assert (s.samples, s.batches) == (n, n // 8), f"epoch {epoch}: {s}"
        assert s.samples_per_s == pytest.approx(n / s.elapsed_s)


@pytest.mark.usefixtures("clean_storage")
@pytest.mark.parametrize("num_workers", MODES)
def test_hedges_sent_and_won_are_in_stats(http_server: ObjectServer, num_workers: int) -> None:
    # A min_delay far above loopback latency: only the two injected stragglers get hedged.
    _storage.configure(http_server.url, hedge=asyncload.Hedge(budget=0.05, min_delay=0.3))
    urls = put(http_server, "h", 64)
    # The last sample of each worker's last batch (batches alternate between 2 workers): by
    # then each worker has learned the latency from 31 reads and earned 1.6 hedge tokens, and
    # no other read of it holds the connection the hedge needs (a worker's pool has
    # max_concurrency connections).
    for i in (59, 63):
        http_server.delay(f"h/{i}", 5.0)  # the first request straggles, the hedge does not
    loader = asyncload.DataLoader(
        asyncload.RemoteFiles(urls),
        batch_size=4,
        num_workers=num_workers,
        max_concurrency=2,
        collate_fn=as_list,
    )
    got = [x for batch in loader for x in batch]
    assert got == [body(i) for i in range(64)]
    s = loader.stats()
    assert s.elapsed_s < 4.0  # neither straggler was waited for
    assert s.hedges_won >= 2
    assert s.hedges_won <= s.hedges_sent <= 3  # the budget: 0.05 x 64 requests
    assert sum(http_server.hits.values()) - 64 <= s.hedges_sent
    if num_workers == 0:  # the engine's notes also reach this process's totals
        assert _hedge.counts().sent == s.hedges_sent


@pytest.mark.usefixtures("clean_storage")
@pytest.mark.parametrize(
    ("num_workers", "persistent"),
    [pytest.param(0, False, id="thread"), pytest.param(2, True, id="persistent")],
)
def test_cache_misses_then_hits_per_pass(
    http_server: ObjectServer, tmp_path: Path, num_workers: int, persistent: bool
) -> None:
    _storage.configure(http_server.url, cache_dir=str(tmp_path / "cache"))
    urls = put(http_server, "c", 24)
    loader = asyncload.DataLoader(
        asyncload.RemoteFiles(urls),
        batch_size=4,
        num_workers=num_workers,
        persistent_workers=persistent,
        collate_fn=as_list,
    )
    seen = []
    for _ in range(3):
        assert [x for batch in loader for x in batch] == [body(i) for i in range(24)]
        s = loader.stats()
        seen.append((s.cache_misses, s.cache_hits))
    assert seen == [(24, 0), (0, 24), (0, 24)]
    assert all(http_server.hits[f"c/{i}"] == 1 for i in range(24))


@pytest.mark.parametrize(
    ("num_workers", "persistent"),
    [
        pytest.param(0, False, id="thread"),
        pytest.param(2, True, id="persistent"),
        pytest.param(2, False, id="processes"),  # the final counts come with the last batch
    ],
)
def test_mix_reports_what_it_drew_from_each_dataset(num_workers: int, persistent: bool) -> None:
    mix = asyncload.Mix([Tagged(0, 300), Tagged(1, 200), Tagged(2, 100)], [0.5, 0.3, 0.2])
    mix_samples = asyncload.Mix([Tagged(0, 50), Tagged(1, 50)], [0.8, 0.2], samples=400, seed=3)
    for ds, epochs in ((mix, 1), (mix_samples, 2)):
        loader = asyncload.DataLoader(
            ds,
            batch_size=8,
            num_workers=num_workers,
            persistent_workers=persistent,
        )
        for _ in range(epochs):
            got = collections.Counter(int(t) for batch in loader for t in batch[0].tolist())
            s = loader.stats()
            assert s.mixed == tuple(got[i] for i in range(len(ds.datasets))), s.mixed
            assert sum(s.mixed) == sum(got.values()) > 0
    assert sum(s.mixed) == 400


@pytest.mark.usefixtures("clean_storage")
@pytest.mark.filterwarnings("ignore:TarShards. shard:asyncload.AsyncloadWarning")
@pytest.mark.parametrize("num_workers", MODES)
def test_suspect_shards_are_counted_in_stats(http_server: ObjectServer, num_workers: int) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in shard_members(8, 4):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        members_end = tar.offset
    urls = [
        http_server.put("sh/empty.tar", b""),
        http_server.put("sh/good.tar", make_tar(shard_members(0, 4))),
        http_server.put("sh/cut.tar", buf.getvalue()[:members_end]),  # no end-of-archive block
        http_server.put("sh/good2.tar", make_tar(shard_members(4, 4))),
    ]
    loader = asyncload.DataLoader(
        asyncload.TarShards(urls), batch_size=None, num_workers=num_workers
    )
    samples: list[Any] = list(loader)
    s = loader.stats()
    assert len(samples) == 12
    assert (s.shards_empty, s.shards_unterminated) == (1, 1)


@pytest.mark.timeout(10)
def test_as_dict_gives_flat_numbers_for_a_metrics_logger() -> None:
    from asyncload._stats.loader_stats import LoaderStats

    stats = LoaderStats(
        elapsed_s=2.0, samples=100, bytes=1000, batches=4, samples_per_s=50.0, bytes_per_s=500.0,
        in_flight=(3, 4), concurrency=(16, 24), latency_p50=0.05, latency_p95=0.07,
        latency_p99=0.09, retries={"503": 2}, errors={}, wait_s=0.5, throttled=2,
        mixed=(60, 40), skipped={"ValueError": 1},
    )  # fmt: skip
    flat = stats.as_dict("loader/")
    assert all(isinstance(v, float) for v in flat.values())
    assert flat["loader/samples_per_s"] == 50.0
    assert flat["loader/in_flight"] == 7.0  # per-worker tuples are summed
    assert flat["loader/concurrency"] == 40.0
    assert flat["loader/retries/503"] == 2.0
    assert flat["loader/throttled"] == 2.0
    assert flat["loader/mixed/0"] == 60.0
    assert flat["loader/mixed/1"] == 40.0
    assert flat["loader/skipped/ValueError"] == 1.0
    assert not any(k.startswith("loader/errors") for k in flat)  # no errors: no keys
    assert set(stats.as_dict()) == {k.removeprefix("loader/") for k in flat}


class _Spinning(asyncload.Dataset[int]):
    """Each sample spins *cpu* seconds on the worker's loop, or waits *wait* seconds."""

    def __init__(self, n: int, *, cpu: float = 0.0, wait: float = 0.0) -> None:
        self.n, self.cpu, self.wait = n, cpu, wait

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, index: int) -> int:
        if self.wait:
            await asyncio.sleep(self.wait)
        spin(self.cpu)
        return index


def _second_pass(loader: Any, per_batch: float = 0.0) -> Any:
    # Persistent workers: the first pass pays the start-up, the second is measured alone.
    for _ in loader:
        pass
    for _ in loader:
        time.sleep(per_batch)
    return loader.stats()


@pytest.mark.timeout(60)
def test_stats_say_which_stage_bounds_the_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    # Spinning on the loop is the point here: a busy machine may stretch one 4 ms spin past
    # the blocked-loop warning's threshold.
    monkeypatch.setenv("ASYNCLOAD_SLOW_CALLBACK", "0")
    common: dict[str, Any] = {"batch_size": 8, "num_workers": 1, "persistent_workers": True}
    # The training loop takes 40 ms per batch; the samples are ready long before.
    consumer = _second_pass(asyncload.DataLoader(_Spinning(160), **common), per_batch=0.04)
    assert consumer.bound_by == "consumer"
    assert consumer.consumer_s >= 20 * 0.04 * 0.9
    # 4 ms of CPU per sample on the worker's one core: the loop waits on it.
    cpu = _second_pass(asyncload.DataLoader(_Spinning(400, cpu=0.004), **common))
    assert cpu.bound_by == "cpu", cpu
    assert cpu.worker_cpu_s >= 400 * 0.004 * 0.9
    # 20 ms of waiting per sample, 4 at a time: the worker idles on its store.
    storage = _second_pass(
        asyncload.DataLoader(_Spinning(160, wait=0.02), max_concurrency=4, **common)
    )
    assert storage.bound_by == "storage", storage
    assert storage.worker_cpu_s < 0.5 * storage.elapsed_s


@pytest.mark.timeout(60)
def test_a_fresh_worker_s_cpu_counts_its_first_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    # The first pass of fresh workers: its CPU counts from the engine's start, not from the
    # first stats sent with the first batch, which left that batch's work out.
    monkeypatch.setenv("ASYNCLOAD_SLOW_CALLBACK", "0")  # the spin holds the loop on purpose
    # One batch of 4 samples that spin 0.075 s each: all of the pass's CPU is in it.
    loader = asyncload.DataLoader(_Spinning(4, cpu=0.075), batch_size=4, num_workers=1)
    assert [int(x) for batch in loader for x in batch] == list(range(4))
    assert loader.stats().worker_cpu_s >= 0.3 * 0.9


@pytest.mark.timeout(10)
def test_the_bound_stage_follows_the_figures() -> None:
    from asyncload._stats.loader_stats import _bound_by, _cores

    cores = _cores()
    assert _bound_by(0, 1.0, 1.0, 0.0, 0.0, 1) == ""  # nothing yet
    assert _bound_by(10, 10.0, 0.5, 0.1, 9.0, 1) == "consumer"  # waited 5%
    # Workers whose loops were busy for most of the pass on cores they share with others
    # (2.8 CPU s of 4 for the JPEG pipeline on 2 cores): their CPU bounds them all the same.
    assert _bound_by(10, 10.0, 9.0, 0.1, 5.0, 2, cpu_bound_s=12.0) == "cpu"
    assert _bound_by(10, 10.0, 9.0, 0.1, 5.0, 2, cpu_bound_s=8.0) == "storage"  # 40% of it
    assert _bound_by(10, 10.0, 5.0, 3.0, 1.0, 1) == "transfer"  # busy receiving
    assert _bound_by(10, 10.0, 5.0, 0.1, 9.0, 1) == "cpu"  # one worker, 90% of a core
    assert _bound_by(10, 10.0, 5.0, 0.1, 2.0, 1) == "storage"  # idle workers
    # Two workers are CPU-bound at two cores' worth (one each), whatever the machine has.
    assert _bound_by(10, 10.0, 5.0, 0.1, 0.85 * 10 * min(cores, 2), 2) == "cpu"
