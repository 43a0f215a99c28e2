"""The storage layer's state as one object a context owns (``_storage/state.py``)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest

import asyncload
from asyncload._storage import api as _storage
from asyncload._storage.backends.pacing_memory import BURST, PacingMemory
from asyncload._storage.state import StorageState, current, process_state, serving

pytestmark = [pytest.mark.timeout(30), pytest.mark.usefixtures("clean_storage")]


def test_a_serving_state_shares_the_process_knowledge_and_keeps_its_own_pool() -> None:
    process = process_state()
    before = process.pool_size
    asyncload.configure("http://example.com", read_timeout=3)
    with serving(StorageState(pool_size=before + 50, shared=process)) as mine:
        assert current() is mine
        assert _storage.pool_size() == before + 50
        assert _storage.options_for("http://example.com/x").read_timeout == 3
        _storage.set_pool_size(7)  # this context's, not the process's
        mine.hosts.remember_proven("example.com:80", 12)
        asyncload.configure("http://example.org", read_timeout=4)  # the process's prefixes
    assert current() is process
    assert process.pool_size == before
    assert process.hosts.proven("example.com:80") == 12
    assert _storage.options_for("http://example.org/y").read_timeout == 4


def test_a_context_state_does_not_leak_to_other_threads() -> None:
    seen: list[int] = []
    with serving(StorageState(pool_size=3, shared=process_state())):
        worker = threading.Thread(target=lambda: seen.append(_storage.pool_size()))
        worker.start()
        worker.join(5)
        # Tasks started here inherit it (the engine's loop runs in such a context).
        assert asyncio.run(_pool_in_a_task()) == 3
    assert seen == [process_state().pool_size]


async def _pool_in_a_task() -> int:
    return await asyncio.get_running_loop().create_task(_pool())


async def _pool() -> int:
    return _storage.pool_size()


def test_a_worker_fills_its_process_state_from_the_loaders_configuration() -> None:
    asyncload.configure("s3://bucket", region="eu-west-1")
    config = _storage.export_config()
    _storage.reset()  # a new worker process: nothing configured
    hosts = PacingMemory(connections=(("example.com:443", 30),))
    _storage.import_config(dataclasses.replace(config, pacing=hosts), pool_size=17, sharers=4)
    state = process_state()
    assert state.pool_size == 17
    assert state.prefixes == list(config.prefixes)
    assert state.hosts.proven("example.com:443") == 30
    assert state.hosts.first_burst() == max(2, BURST // 4)


def test_a_pool_size_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        StorageState(pool_size=0)
