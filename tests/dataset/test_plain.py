"""asyncload datasets under a plain torch DataLoader, and the recipe for trainers that build one."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import asyncload
from asyncload._dataset import plain as _plain
from tests._datasets import Numbers, put_numbers
from tests._http_server import ObjectServer


@pytest.fixture
def fresh_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_plain, "_warned", False)


def test_plain_dataloader_gets_samples_and_warns_once(
    http_server: ObjectServer, fresh_warning: None
) -> None:
    base = put_numbers(http_server, 20)
    loader = torch.utils.data.DataLoader(Numbers(base, 20), batch_size=8)
    with pytest.warns(asyncload.AsyncloadWarning, match="asyncload.DataLoader") as record:
        batches = [b.tolist() for b in loader]
    assert batches == [list(range(0, 8)), list(range(8, 16)), list(range(16, 20))]
    assert len(record) == 1  # once per process, not per batch
    assert "one at a time" in str(record[0].message)


def test_plain_dataloader_errors_are_the_datasets(
    http_server: ObjectServer, fresh_warning: None
) -> None:
    base = put_numbers(http_server, 4)
    loader = torch.utils.data.DataLoader(Numbers(base, 4, fail_on=(2,)), batch_size=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", asyncload.AsyncloadWarning)
        with pytest.raises(ValueError, match="bad sample 2"):
            next(iter(loader))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_plain_dataloader_with_worker_processes(
    http_server: ObjectServer, fresh_warning: None
) -> None:
    base = put_numbers(http_server, 24)
    loader = torch.utils.data.DataLoader(
        Numbers(base, 24), batch_size=4, num_workers=2, multiprocessing_context="spawn"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", asyncload.AsyncloadWarning)
        got = sorted(x for b in loader for x in b.tolist())
    assert got == list(range(24))


class _Trainer:
    """Stands in for transformers.Trainer: it builds a torch DataLoader in get_train_dataloader."""

    def __init__(self, train_dataset: Any, batch_size: int, data_collator: Any) -> None:
        self.train_dataset = train_dataset
        self._train_batch_size = batch_size
        self.data_collator = data_collator

    def get_train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(
            self.train_dataset, batch_size=self._train_batch_size, collate_fn=self.data_collator
        )

    def train(self) -> list[Any]:
        return list(self.get_train_dataloader())


class _AsyncloadTrainer(_Trainer):
    """The recipe in docs/concepts.md: hand the trainer an asyncload.DataLoader."""

    def get_train_dataloader(self) -> Any:
        return asyncload.DataLoader(
            self.train_dataset,
            batch_size=self._train_batch_size,
            collate_fn=self.data_collator,
            num_workers=0,
            max_concurrency=16,
        )


def test_trainer_recipe_uses_asyncload_and_does_not_warn(
    http_server: ObjectServer, fresh_warning: None
) -> None:
    base = put_numbers(http_server, 12)
    trainer = _AsyncloadTrainer(Numbers(base, 12), batch_size=5, data_collator=list)
    assert isinstance(trainer.get_train_dataloader(), asyncload.DataLoader)
    batches = trainer.train()  # filterwarnings=error: the one-sample-at-a-time warning would fail
    assert batches == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11]]
