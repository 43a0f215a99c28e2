"""``pin_memory=True`` on a real accelerator: batches arrive pinned and reach the GPU intact.

Skipped without CUDA (CI has none); run on a GPU machine with
``python -m pytest tests/workers/test_pin_memory.py``, or, where the dev extra is not installed
(no pytest-asyncio, no emulators), ``python -m pytest -c /dev/null --rootdir . --noconftest
tests/workers/test_pin_memory.py`` (4 passed on an H200 machine, 2026-11-27).
"""

from __future__ import annotations

import pytest
import torch

import asyncload

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def image(i: int) -> torch.Tensor:
    """Sample i: 3 x 64 x 64 bytes, every byte (i * 7 + position) % 251, so mix-ups show."""
    return ((torch.arange(3 * 64 * 64) + i * 7) % 251).to(torch.uint8).view(3, 64, 64)


class Images(asyncload.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"image": image(index), "label": torch.tensor(index)}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_pinned_batches_reach_the_gpu_intact(num_workers: int) -> None:
    loader = asyncload.DataLoader(
        Images(256), batch_size=16, num_workers=num_workers, pin_memory=True
    )
    for epoch in range(2):
        seen = 0
        for k, batch in enumerate(loader):
            assert batch["image"].is_pinned()
            assert batch["label"].is_pinned()
            gpu = {key: t.cuda(non_blocking=True) for key, t in batch.items()}
            indices = list(range(16 * k, 16 * k + 16))
            assert torch.equal(gpu["label"].cpu(), torch.tensor(indices))
            assert torch.equal(gpu["image"].cpu(), torch.stack([image(i) for i in indices]))
            seen += len(indices)
        assert seen == 256, epoch


@pytest.mark.timeout(120)
def test_pinned_batches_kept_by_the_loop_stay_intact() -> None:
    # The loop keeps every batch (pinned copies of pooled shared-memory blocks): none may be
    # overwritten by a later batch that reuses its block.
    loader = asyncload.DataLoader(Images(512), batch_size=8, num_workers=2, pin_memory=True)
    kept = [batch["image"].cuda(non_blocking=True) for batch in loader]
    torch.cuda.synchronize()
    for k, gpu in enumerate(kept):
        assert torch.equal(gpu.cpu(), torch.stack([image(i) for i in range(8 * k, 8 * k + 8)]))


@pytest.mark.timeout(120)
def test_pinning_follows_the_current_device() -> None:
    device = torch.cuda.device_count() - 1
    with torch.cuda.device(device):
        loader = asyncload.DataLoader(Images(64), batch_size=16, num_workers=2, pin_memory=True)
        batch = next(iter(loader))
        assert batch["image"].is_pinned()
        assert batch["image"].cuda().device == torch.device("cuda", device)
