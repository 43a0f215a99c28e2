"""Errors, timeouts, dead workers and every way a loop can end: nothing may be left behind."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import psutil
import pytest

import asyncload
from asyncload._workers.reaper import reaper
from asyncload._workers.stop import DoneFlag, release_elsewhere

from .._datasets import (
    BigTensors,
    CancelsItself,
    DiesHoldingLocks,
    Numbers,
    Segfault,
    Sleepy,
    Stuck,
    SyncNumbers,
    put_numbers,
)
from .._procs import worker_processes

_SCRIPTS = Path(__file__).resolve().parents[1] / "_scripts"  # run as subprocesses

pytestmark = pytest.mark.usefixtures("no_leaks")


def _worker_pids() -> list[int]:
    return [p.pid for p in worker_processes()]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_sample_error_is_reraised_with_type_worker_index_and_traceback(
    http_server: Any, num_workers: int
) -> None:
    base = put_numbers(http_server, 40)
    loader = asyncload.DataLoader(
        Numbers(base, 40, fail_on=(13,)), batch_size=4, num_workers=num_workers
    )
    seen: list[int] = []
    with pytest.raises(ValueError, match="bad sample 13") as info:
        _drain(loader, seen)
    assert seen == list(range(12))  # batches before the failing one arrived, in order
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "sample 13" in notes
    if num_workers:
        assert "DataLoader worker 1 (pid " in notes  # batch 3 went to worker 1 (round robin)
        cause = str(info.value.__cause__)
        assert "Traceback" in cause
        assert "__getitem__" in cause
        assert "bad sample 13" in cause


def _drain(batches: Any, into: list[int] | None = None) -> None:
    for batch in batches:
        if into is not None:
            into.extend(batch.tolist())


def test_missing_object_error_names_url_and_index(http_server: Any) -> None:
    base = put_numbers(http_server, 8)
    del http_server.objects["n/5"]
    loader = asyncload.DataLoader(Numbers(base, 8), batch_size=2, num_workers=2)
    with pytest.raises(asyncload.NotFound) as info:
        list(loader)
    assert isinstance(info.value, FileNotFoundError)
    assert "n/5" in str(info.value)
    assert "sample 5" in " ".join(info.value.__notes__)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_timeout_raises_batch_timeout(num_workers: int) -> None:
    loader = asyncload.DataLoader(
        Sleepy(8, slow=3, delay=30), batch_size=2, num_workers=num_workers, timeout=1
    )
    t0 = time.monotonic()
    with pytest.raises(asyncload.BatchTimeout, match=r"timed out after 1 seconds") as info:
        list(loader)
    assert isinstance(info.value, RuntimeError)
    assert isinstance(info.value, TimeoutError)
    assert time.monotonic() - t0 < 10
    # The stuck batch is named: sample 3 is in batch 1, which went to the last worker.
    assert "sample indices [2, 3]" in str(info.value)
    assert f"from worker {max(num_workers - 1, 0)}" in str(info.value)


def test_killed_worker_raises_naming_pid_and_signal() -> None:
    loader = asyncload.DataLoader(Sleepy(100, slow=50, delay=60), batch_size=2, num_workers=2)
    it = iter(loader)
    next(it)
    victim = it.worker_pids[1]
    os.kill(victim, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(asyncload.WorkerError, match=rf"pid {victim}.*SIGKILL") as info:
        _drain(it)
    assert time.monotonic() - t0 < 5
    assert info.value.pid == victim
    assert info.value.exitcode == -signal.SIGKILL
    assert isinstance(info.value, RuntimeError)


def test_a_worker_killed_holding_every_shared_lock_is_reported_at_once(tmp_path: Path) -> None:
    """A worker killed while it held a lock the others share (a queue's, the done signal's
    once) must not keep them, and so the stop, waiting: the error comes within a second or
    few of its death, not after the stop's timeouts (6 s at least), and nothing is left
    behind."""
    stamp = tmp_path / "died"
    loader = asyncload.DataLoader(
        DiesHoldingLocks(400, die=121, stamp=str(stamp)), batch_size=2, num_workers=2
    )
    with pytest.raises(asyncload.WorkerError, match=r"worker 0 \(pid \d+\).*SIGKILL"):
        _drain(loader)
    assert time.time() - float(stamp.read_text()) < 4  # 0.2 s here, quiet


def test_segfault_in_a_worker_raises_naming_the_signal() -> None:
    loader = asyncload.DataLoader(Segfault(40, crash=21), batch_size=4, num_workers=2)
    with pytest.raises(asyncload.WorkerError, match=r"worker 1 \(pid \d+\).*SIGSEGV"):
        _drain(loader)


def test_break_early_and_exception_in_training_loop_leave_nothing() -> None:
    loader = asyncload.DataLoader(SyncNumbers(1000), batch_size=4, num_workers=2)
    for _ in loader:
        break
    with pytest.raises(KeyError):
        _train(loader)


@pytest.mark.asyncio
async def test_breaking_out_of_async_for_stops_the_workers() -> None:
    loader = asyncload.DataLoader(SyncNumbers(10_000), batch_size=4, num_workers=2)
    async for _ in loader:
        break
    del loader
    await asyncio.sleep(0.5)  # the loop finalizes the abandoned async generator


def _train(loader: Any) -> None:
    for _ in loader:
        raise KeyError("training step failed")


def test_persistent_workers_survive_epochs_and_go_with_the_loader() -> None:
    loader = asyncload.DataLoader(
        SyncNumbers(30), batch_size=4, num_workers=2, persistent_workers=True, shuffle=True
    )
    it = iter(loader)
    pids = list(it.worker_pids)
    for _ in range(3):
        seen = sorted(i for b in loader for i in b.tolist())
        assert seen == list(range(30))
        assert list(loader._persistent_pass.worker_pids) == pids
    for _ in loader:  # break mid-epoch, then a full epoch: nothing stale may leak through
        break
    assert sorted(i for b in loader for i in b.tolist()) == list(range(30))
    assert set(pids) <= set(_worker_pids())
    del loader, it


def test_persistent_workers_carry_on_after_a_failed_batch(http_server: Any) -> None:
    base = put_numbers(http_server, 20)
    loader = asyncload.DataLoader(
        Numbers(base, 20, fail_on=(5,)), batch_size=4, num_workers=2, persistent_workers=True
    )
    pids = None
    for _epoch in range(2):
        seen, errors = _collect_skipping_errors(loader)
        assert errors == 1
        assert seen == [i for i in range(20) if not 4 <= i < 8]
        assert loader._persistent_pass is not None
        now = list(loader._persistent_pass.worker_pids)
        assert pids is None or now == pids  # the same workers, as in torch
        pids = now
    del loader


def _collect_skipping_errors(loader: Any) -> tuple[list[int], int]:
    seen: list[int] = []
    errors = 0
    it = iter(loader)
    for _ in range(50):  # bounded
        try:
            seen.extend(next(it).tolist())
        except StopIteration:
            break
        except ValueError:
            errors += 1
    return seen, errors


def test_unpicklable_dataset_error_names_the_attribute() -> None:
    ds = SyncNumbers(10)
    ds.transform = lambda x: x  # type: ignore[attr-defined]
    loader = asyncload.DataLoader(ds, num_workers=1)
    # torch's warning comes first (issue 10), then our error naming the attribute.
    with (
        pytest.warns(UserWarning, match="Got pickle error"),
        pytest.raises(asyncload.NotPicklable, match=r"dataset\.transform.*lambda.*module level"),
    ):
        iter(loader)
    with pytest.warns(UserWarning, match="Got pickle error"), pytest.raises(TypeError):
        iter(asyncload.DataLoader(SyncNumbers(4), num_workers=1, collate_fn=lambda b: b))


def test_worker_init_fn_failure_is_reported() -> None:
    loader = asyncload.DataLoader(SyncNumbers(4), num_workers=1, worker_init_fn=_bad_init)
    with pytest.raises(RuntimeError, match="no credentials") as info:
        list(loader)
    assert "start-up" in " ".join(info.value.__notes__)


def _bad_init(worker_id: int) -> None:
    raise RuntimeError(f"no credentials in worker {worker_id}")


def test_unpicklable_batch_becomes_an_error_not_a_hang() -> None:
    loader = asyncload.DataLoader(
        SyncNumbers(4), batch_size=2, num_workers=1, collate_fn=_unpicklable
    )
    with pytest.raises(TypeError, match="could not be pickled"):
        list(loader)


def _unpicklable(batch: list[int]) -> Any:
    return lambda: batch


@pytest.mark.parametrize("how", ["SIGKILL", "SIGINT", "SIGTERM"])
@pytest.mark.parametrize("mode", ["one-pass", "epochs"])
def test_main_process_death_or_ctrl_c_leaves_no_workers(how: str, mode: str) -> None:
    """Also between epochs, while the next pass's standby workers start (``epochs``): every
    process the script started goes with it (workers, standby ones, the forkserver)."""
    script = [_SCRIPTS / "train_forever.py", *(["epochs"] if mode == "epochs" else [])]
    settle = 0.5 if mode == "epochs" else 0
    pids, err, family = _run_then_signal(script, getattr(signal, how), settle=settle)
    alive = _wait_gone(pids)
    assert not alive, f"workers {alive} outlived their main process ({how})"
    alive = _wait_gone(family)
    assert not alive, f"processes {alive} outlived their main process ({how})"
    if how == "SIGINT":
        assert "KeyboardInterrupt" in err
        assert "Exception ignored" not in err, err
        assert "leaked" not in err, err


def _run_then_signal(
    script: list[Any], sig: int, settle: float
) -> tuple[list[int], str, list[int]]:
    """Run *script* (a path, then arguments) until it prints its 2 worker pids, wait *settle*
    seconds, send *sig* to it.

    Returns the worker pids, what the script wrote to stderr, and the pids of every process
    it had started when the signal left. A script still running 15 s later fails the test with
    every thread's stack (faulthandler, on SIGABRT) and its process tree, so that a hang shows
    where it is.
    """
    with subprocess.Popen(
        [sys.executable, "-X", "faulthandler", *map(str, script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        try:
            assert proc.stdout is not None
            pids = [int(p) for p in proc.stdout.readline().split()]
            assert len(pids) == 2
            time.sleep(settle)
            family = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
            os.kill(proc.pid, sig)
            try:
                _, err = proc.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                tree = _abort_tree(proc.pid)
                _, err = proc.communicate(timeout=10)
                pytest.fail(f"still running 15 s after {sig!r}; processes: {tree}\n{err}")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return pids, err, family


def _signal_state(pid: int) -> str:
    """The kernel's view of *pid*'s signals (ignored, caught; blocked per thread), in hex."""
    try:
        fields = {}
        for task in sorted(os.listdir(f"/proc/{pid}/task")):
            for line in Path(f"/proc/{pid}/task/{task}/status").read_text().splitlines():
                key, _, value = line.partition(":")
                if key in ("SigIgn", "SigCgt") and task == str(pid):
                    fields[key] = value.strip()
                elif key == "SigBlk" and int(value, 16):
                    fields[f"SigBlk[{task}]"] = value.strip()
        return repr(fields)
    except (OSError, ValueError) as exc:
        return f"({exc})"


def _abort_tree(pid: int) -> str:
    """Describe *pid* and its descendants, then SIGABRT them all, deepest first (the
    forkserver's workers inherit ``-X faulthandler``: each writes its stacks to stderr)."""
    try:
        procs = [psutil.Process(pid)]
        procs += procs[0].children(recursive=True)
    except psutil.Error as exc:
        return f"({exc})"
    described = []
    for p in reversed(procs):
        try:
            described.append(f"{p.pid} {p.name()} {p.status()} {_signal_state(p.pid)}")
            p.send_signal(signal.SIGABRT)
        except psutil.Error:
            pass
    return ", ".join(reversed(described))


def _wait_gone(pids: list[int], seconds: float = 10) -> list[int]:
    """The processes of *pids* still running after up to *seconds*."""
    deadline = time.monotonic() + seconds
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in pids if _running(p)]
        time.sleep(0.1)
    return alive


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("num_workers", [0, 1])
def test_file_descriptor_limit_gives_a_clear_error_not_a_hang(
    http_server: Any, num_workers: int
) -> None:
    base = put_numbers(http_server, 300)
    http_server.latency = 0.2  # keep connections open so the 64-descriptor limit is reached
    out = subprocess.run(
        [sys.executable, str(_SCRIPTS / "fd_limit.py"), base, str(num_workers)],
        capture_output=True,
        text=True,
        timeout=45,
        check=False,
    )
    assert "ConnectError:" in out.stdout, out.stdout + out.stderr
    assert "ran out of file descriptors" in out.stdout
    assert "max_concurrency" in out.stdout


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_failed_batch_does_not_end_the_pass(http_server: Any, num_workers: int) -> None:
    base = put_numbers(http_server, 40)
    loader = asyncload.DataLoader(
        Numbers(base, 40, fail_on=(5,)), batch_size=4, num_workers=num_workers
    )
    seen, errors = _collect_skipping_errors(loader)  # as with torch: catch it, carry on
    assert errors == 1
    assert seen == [i for i in range(40) if not 4 <= i < 8]


def test_dataset_raising_cancelled_error_is_a_sample_error_not_a_hang() -> None:
    for num_workers in (0, 1):
        loader = asyncload.DataLoader(
            CancelsItself(20, bad=5), batch_size=4, num_workers=num_workers, timeout=20
        )
        with pytest.raises(RuntimeError, match="cancelled from inside") as info:
            _drain(loader)
        assert not isinstance(info.value, asyncload.BatchTimeout)


def test_shutdown_is_prompt_while_every_fetch_slot_is_stuck() -> None:
    before = set(threading.enumerate())
    loader = asyncload.DataLoader(
        Stuck(), batch_size=2, num_workers=0, max_concurrency=4, timeout=1
    )
    t0 = time.monotonic()
    with pytest.raises(asyncload.BatchTimeout):
        _drain(loader)
    assert time.monotonic() - t0 < 4  # the 1 s timeout, then a shutdown that doesn't wait 5 s
    loop_threads = [t for t in set(threading.enumerate()) - before if t.name == "asyncload-loop"]
    assert not loop_threads


def test_worker_killed_while_its_shared_memory_batches_queue_up() -> None:
    loader = asyncload.DataLoader(BigTensors(), batch_size=8, num_workers=2)
    it = iter(loader)
    next(it)
    time.sleep(1.0)  # the workers fill the result queue with shared-memory batches
    victim = it.worker_pids[1]
    os.kill(victim, signal.SIGKILL)
    with pytest.raises(asyncload.WorkerError, match=rf"pid {victim}.*SIGKILL"):
        _drain(it)


def test_a_worker_killed_inside_torchs_shared_memory_window_leaves_nothing_named() -> None:
    """torch names a batch's segment, maps it, then unlinks the name: a worker killed in between
    left /dev/shm/torch_<its pid>_... for good (seen once in CI). Such a name is planted here,
    as that kill would leave it; the stop unlinks it, and not another process's."""
    loader = asyncload.DataLoader(SyncNumbers(10**6), batch_size=4, num_workers=2)
    it = iter(loader)
    next(it)
    victim = it.worker_pids[1]
    os.kill(victim, signal.SIGKILL)
    window = Path(f"/dev/shm/torch_{victim}_4042009500_41")
    other = Path(f"/dev/shm/torch_{os.getpid()}_4042009500_99999")
    window.write_bytes(b"")
    other.write_bytes(b"")
    try:
        with pytest.raises(asyncload.WorkerError, match=rf"pid {victim}.*SIGKILL"):
            _drain(it)
        del it
        gc.collect()
        reaper.drain(10)
        assert not window.exists()
        assert other.exists()
    finally:
        window.unlink(missing_ok=True)
        other.unlink(missing_ok=True)


@pytest.mark.timeout(60)
def test_a_killed_worker_leaves_no_feeder_thread_blocked_on_its_index_queue(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Tasks a dead worker never read fill its index queue's pipe, whose only read end is then
    the main process's own: the queue's feeder thread blocked on it for ever, and the queue's
    semaphores stayed in /dev/shm until the process exited (seen in 4 of 40 kills of a worker
    whose batches queued up). The stop closes that end."""
    loader = asyncload.DataLoader(SyncNumbers(10**6), batch_size=4, num_workers=2)
    it = iter(loader)
    next(it)
    victim = it.worker_pids[1]
    os.kill(victim, signal.SIGSTOP)  # reads nothing more
    index_queue = it._engines._index_queues[1]
    index_queue.put(((), b"x" * (1 << 20)))  # more than the pipe holds: its feeder blocks
    feeder = index_queue._thread
    os.kill(victim, signal.SIGKILL)
    with pytest.raises(asyncload.WorkerError, match=rf"pid {victim}.*SIGKILL"):
        _drain(it)
    del it, index_queue
    gc.collect()
    reaper.drain(10)
    deadline = time.monotonic() + 10
    while feeder.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not feeder.is_alive(), "the feeder thread still writes to a dead worker's queue"
    assert "Traceback" not in capfd.readouterr().err  # it ended quietly, on EPIPE


def test_persistent_loader_recovers_from_a_worker_killed_between_epochs() -> None:
    loader = asyncload.DataLoader(
        SyncNumbers(20), batch_size=4, num_workers=2, persistent_workers=True
    )
    assert len(list(loader)) == 5
    assert loader._persistent_pass is not None
    os.kill(loader._persistent_pass.worker_pids[0], signal.SIGKILL)
    time.sleep(0.3)
    with pytest.raises(asyncload.WorkerError):
        list(loader)
    assert len(list(loader)) == 5  # fresh workers
    del loader


@pytest.mark.parametrize("kind", ["blobs", "stuck"])
def test_workers_exit_when_their_parent_dies_while_blocked(kind: str) -> None:
    # settle: let the result pipe fill, or the fetches get stuck, before the parent dies
    pids, _, _ = _run_then_signal([_SCRIPTS / "orphan.py", kind], signal.SIGKILL, settle=1.5)
    alive = _wait_gone(pids)
    assert not alive, f"workers {alive} outlived their killed parent"


def test_interpreter_exit_after_break_with_persistent_workers_is_prompt_and_clean() -> None:
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, str(_SCRIPTS / "exit_after_break.py")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "done"
    assert out.stderr == ""  # no tracebacks, no leaked-semaphore or resource warnings
    assert time.monotonic() - t0 < 30


def test_a_pass_lets_go_of_its_queues_off_the_main_thread() -> None:
    """NOTE [ Ctrl-C and finalizers ]: a Ctrl-C landing in a finalizer in the main thread is
    lost, so the finalizers of a closed pass's multiprocessing objects run in another thread."""
    ran_in: list[str] = []
    box: list[Any] = [_Finalized(ran_in)]
    release_elsewhere(box)
    del box
    assert _Finalized.wait(ran_in) == ["asyncload-release"]

    loader = asyncload.DataLoader(SyncNumbers(8), batch_size=2, num_workers=2)
    it = iter(loader)
    ran_in.clear()
    weakref.finalize(it._engines._result_queue._reader, _Finalized.record, ran_in)  # type: ignore[union-attr]
    list(it)  # the pass ends: the reaper stops its workers (NOTE [ Who stops workers ])
    assert _Finalized.wait(ran_in) == ["asyncload-reaper"]


class _Finalized:
    def __init__(self, ran_in: list[str]) -> None:
        self.ran_in = ran_in

    def __del__(self) -> None:
        self.record(self.ran_in)

    @staticmethod
    def record(ran_in: list[str]) -> None:
        ran_in.append(threading.current_thread().name)

    @staticmethod
    def wait(ran_in: list[str]) -> list[str]:
        """*ran_in* once a finalizer recorded its thread (or after 10 s)."""
        deadline = time.monotonic() + 10
        while not ran_in and time.monotonic() < deadline:
            time.sleep(0.01)
        return ran_in


def _spin_until_done(done: Any, started: Any) -> None:
    """A worker's reads of the done signal, back to back, for 20 s at most."""
    started.put(os.getpid())
    deadline = time.monotonic() + 20
    while not done.is_set():
        if time.monotonic() > deadline:
            os._exit(3)
    os._exit(0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn"])
def test_a_worker_killed_while_it_reads_the_done_signal_cannot_block_the_stop(
    method: str,
) -> None:
    """A ``multiprocessing.Event`` takes a lock shared by every process on each read: a worker
    killed while it held it left it held for good. The next ``set()`` (the reaper stopping the
    pass) waited for ever, or, once bounded, the other workers never saw it and were killed
    after ``JOIN_TIMEOUT``. ``DoneFlag`` has no lock: the other reader sees it at once."""
    import multiprocessing

    ctx = multiprocessing.get_context(method)
    for _ in range(4):
        done = DoneFlag(ctx)
        started = ctx.Queue()
        victim = ctx.Process(target=_spin_until_done, args=(done, started), daemon=True)
        other = ctx.Process(target=_spin_until_done, args=(done, started), daemon=True)
        victim.start()
        other.start()
        assert {started.get(timeout=30), started.get(timeout=30)} == {victim.pid, other.pid}
        time.sleep(0.3)  # both reading it back to back
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(5)
        began = time.monotonic()
        setter = threading.Thread(target=done.set, daemon=True)
        setter.start()
        setter.join(5)
        assert not setter.is_alive(), "set() waited on a lock a killed process held"
        assert time.monotonic() - began < 1
        other.join(5)
        if other.is_alive():  # pragma: no cover - the failure: tidy up, then say so
            other.kill()
            other.join(5)
        assert other.exitcode == 0, "the other reader did not see the signal"
        started.close()
        assert victim.exitcode == -signal.SIGKILL
