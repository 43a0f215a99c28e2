"""The per-sample error budget (issue 13 item 3): DataLoader(sample_errors=, max_sample_errors=)."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch

import asyncload

pytestmark = pytest.mark.usefixtures("no_leaks")

BAD = (3, 17, 18, 40)


class Flaky(asyncload.Dataset[int]):
    """Item i is i, except that the indices in ``bad`` raise (a NotFound naming a URL)."""

    def __init__(self, n: int, bad: tuple[int, ...] = BAD) -> None:
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, index: int) -> int:
        await asyncio.sleep(0)
        if index in self.bad:
            raise asyncload.NotFound(
                f"no object {index}", url=f"http://127.0.0.1:1/x/{index}?sig=SECRET", status=404
            )
        return index


class FlakyStream(asyncload.IterableDataset[int]):
    """Yields awaitables; those for the items in ``bad`` raise ValueError."""

    def __init__(self, n: int, bad: tuple[int, ...] = BAD) -> None:
        self.n, self.bad = n, bad

    async def _one(self, i: int) -> int:
        await asyncio.sleep(0)
        if i in self.bad:
            raise ValueError(f"corrupt item {i}")
        return i

    async def __aiter__(self) -> AsyncIterator[Any]:
        for i in asyncload.shard(range(self.n)):
            yield self._one(i)


def _all(loader: Any) -> list[int]:
    return [i for batch in loader for i in batch.tolist()]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_skip_leaves_exactly_the_failing_samples_out(num_workers: int) -> None:
    loader = asyncload.DataLoader(
        Flaky(60), batch_size=8, num_workers=num_workers, sample_errors="skip"
    )
    batches = [b.tolist() for b in loader]
    got = [i for b in batches for i in b]
    assert sorted(got) == [i for i in range(60) if i not in BAD]
    assert len(batches) == 8  # smaller batches, none refilled
    assert [len(b) for b in batches[:3]] == [7, 8, 6]
    assert loader.stats().skipped == {"NotFound": 4}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_budget_exceeded_fails_listing_the_first_failures(num_workers: int) -> None:
    loader = asyncload.DataLoader(
        Flaky(60), batch_size=8, num_workers=num_workers, sample_errors="skip", max_sample_errors=2
    )
    with pytest.raises(asyncload.SampleErrorBudgetExceeded) as info:
        _all(loader)
    text = str(info.value)
    assert isinstance(info.value, asyncload.LoadError)
    assert "3 samples failed in this pass, more than max_sample_errors=2" in text
    for i in (3, 17, 18):
        assert f"sample {i}: NotFound: no object {i} (http://127.0.0.1:1/x/{i}" in text
    assert "NotFound: no object 17" in text
    assert "SECRET" not in text


def test_fractional_budget() -> None:
    # Failures at 3, 17, 18, 40 of 60: 20% of the samples seen tolerates them at every batch,
    # 5% does not (3 failures by sample 24).
    ok = asyncload.DataLoader(Flaky(60), batch_size=8, sample_errors="skip", max_sample_errors=0.2)
    assert len(_all(ok)) == 56
    tight = asyncload.DataLoader(
        Flaky(60), batch_size=8, sample_errors="skip", max_sample_errors=0.05
    )
    with pytest.raises(asyncload.SampleErrorBudgetExceeded, match=r"5\.00% of 24 samples seen"):
        _all(tight)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_warn_warns_once_per_skipped_sample(num_workers: int) -> None:
    loader = asyncload.DataLoader(
        Flaky(60), batch_size=8, num_workers=num_workers, sample_errors="warn"
    )
    with pytest.warns(asyncload.AsyncloadWarning) as record:
        got = _all(loader)
    assert len(got) == 56
    texts = [str(w.message) for w in record if issubclass(w.category, asyncload.AsyncloadWarning)]
    assert len(texts) == 4
    assert all("sample_errors='warn'" in t for t in texts)
    assert any(
        "skipped sample 40: NotFound: no object 40 (http://127.0.0.1:1/x/40" in t for t in texts
    )


def test_raise_is_the_default() -> None:
    with pytest.raises(asyncload.NotFound):
        _all(asyncload.DataLoader(Flaky(60), batch_size=8))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_iterable_dataset_skips_failing_awaitables(num_workers: int) -> None:
    loader = asyncload.DataLoader(
        FlakyStream(60), batch_size=8, num_workers=num_workers, sample_errors="skip"
    )
    got = _all(loader)
    assert sorted(got) == [i for i in range(60) if i not in BAD]
    assert loader.stats().skipped == {"ValueError": 4}
    strict = asyncload.DataLoader(
        FlakyStream(60),
        batch_size=8,
        num_workers=num_workers,
        sample_errors="skip",
        max_sample_errors=1,
    )
    with pytest.raises(asyncload.SampleErrorBudgetExceeded, match="corrupt item 3"):
        _all(strict)


def test_a_batch_whose_every_sample_failed_is_not_yielded() -> None:
    loader = asyncload.DataLoader(Flaky(12, bad=(4, 5, 6, 7)), batch_size=4, sample_errors="skip")
    assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [8, 9, 10, 11]]
    single = asyncload.DataLoader(Flaky(6, bad=(2,)), batch_size=None, sample_errors="skip")
    assert list(single) == [0, 1, 3, 4, 5]


@pytest.mark.parametrize("iterable", [False, True])
def test_resume_after_skips_is_exact(iterable: bool) -> None:
    def make() -> asyncload.DataLoader[Any]:
        ds: Any = FlakyStream(60) if iterable else Flaky(60)
        return asyncload.DataLoader(
            ds,
            batch_size=8,
            shuffle=None if iterable else True,
            generator=torch.Generator().manual_seed(5),
            sample_errors="skip",
        )

    loader = make()
    it = iter(loader)
    before = [i for _, b in zip(range(3), it, strict=False) for i in b.tolist()]
    state = loader.state_dict()
    del it
    restored = make()
    restored.load_state_dict(state)
    after = _all(restored)
    both = collections.Counter(before + after)
    assert sorted(both) == [i for i in range(60) if i not in BAD]
    assert max(both.values()) == 1


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="sample_errors must be 'raise', 'skip' or 'warn'"):
        asyncload.DataLoader(Flaky(4), sample_errors="ignore")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fractional max_sample_errors"):
        asyncload.DataLoader(Flaky(4), sample_errors="skip", max_sample_errors=1.5)
    with pytest.raises(ValueError, match="needs sample_errors='skip' or 'warn'"):
        asyncload.DataLoader(Flaky(4), max_sample_errors=3)
