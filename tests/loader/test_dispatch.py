"""``_loader/dispatch.py`` on its own: how the main process passes what one worker learned of
the store to the others (``Dispatch._share``), with the workers faked."""

from __future__ import annotations

import pytest

from asyncload._control import LimitState
from asyncload._loader import dispatch
from asyncload._loader.dispatch import Dispatch
from asyncload._protocol.messages import PEERS_EVERY, Peers

pytestmark = pytest.mark.timeout(10)


class _Workers:
    def __init__(self) -> None:
        self.sent: list[tuple[int, Peers]] = []

    def send(self, worker_id: int, msg: Peers) -> None:
        self.sent.append((worker_id, msg))


class _Sharing(Dispatch):
    """Just what ``_share`` reads: the workers, which are active, when each last heard."""

    def __init__(self, workers: int) -> None:
        self.learned = {}
        self._num_workers = workers
        self._active = [True] * workers
        self._heard_at = [-float("inf")] * workers
        self._engines = _Workers()  # type: ignore[assignment]

    @property
    def sent(self) -> list[tuple[int, Peers]]:
        return self._engines.sent  # type: ignore[union-attr]


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The main process's clock, moved by the test (a loaded machine cannot stretch it)."""
    now = [100.0]
    monkeypatch.setattr(dispatch.time, "monotonic", lambda: now[0])
    return now


def test_news_reaches_the_other_workers_at_once_and_the_rest_waits(clock: list[float]) -> None:
    d = _Sharing(3)
    d._share(0, LimitState(limit=32.0))  # a first report: the others know nothing yet
    assert sorted(w for w, _ in d.sent) == [1, 2]
    d._share(1, LimitState(limit=32.0))
    d._share(2, LimitState(limit=32.0))
    d.sent.clear()
    clock[0] += 0.1
    d._share(0, LimitState(limit=40.0))  # no news, within PEERS_EVERY
    assert d.sent == []
    # Worker 0 was throttled: the others' limits are cut too, now, not PEERS_EVERY later,
    # while they go on sending into the overload.
    d._share(0, LimitState(limit=32.0, throttled_at=5.0))
    assert sorted(w for w, _ in d.sent) == [1, 2]
    assert all(m.state.throttled_at == 5.0 for _, m in d.sent)
    d.sent.clear()
    clock[0] += 0.1
    d._share(0, LimitState(limit=30.0, throttled_at=5.0))  # the same throttle: it waits
    # Worker 1, cut by that throttle, reports it as its own: an echo, not news.
    d._share(1, LimitState(limit=26.0, throttled_at=5.0))
    assert d.sent == []
    clock[0] += PEERS_EVERY
    d._share(0, LimitState(limit=30.0, throttled_at=5.0))  # what waited goes now
    assert sorted(w for w, _ in d.sent) == [1, 2]


def test_each_worker_hears_the_others_combined_never_itself() -> None:
    d = _Sharing(3)
    d._share(1, LimitState(limit=20.0))
    d._share(2, LimitState(limit=40.0))
    to_0 = [m.state for w, m in d.sent if w == 0]
    # Worker 0 heard worker 1 alone, then 1 and 2 together.
    assert [(s.limit, s.workers) for s in to_0] == [(20.0, 1), (30.0, 2)]
    assert all(m.state.workers == 1 for w, m in d.sent if w in (1, 2))
