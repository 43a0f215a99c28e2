"""The forkserver forked from the loader's process (``_forkserver``), in fresh interpreters."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from ..._procs import SCRIPTS, run_script, script_env

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="Linux only, as the fork is")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("relative", [False, True], ids=["absolute-path", "dot-slash-path"])
def test_the_default_start_method_forks_the_server_from_the_loaders_process(
    tmp_path: Path, relative: bool
) -> None:
    marker = tmp_path / "handler-ran"
    out = run_script("forked_server.py", "default", str(marker), relative=relative)
    assert out["forked"] is True
    assert out["indices"] == list(range(32))
    # Workers see the script as it was when the loader was built (the workers of a fresh
    # server import it again, without running its guarded part); `python ./script.py` too.
    assert out["global"] == [7]
    # The server holds no pipe of the script's: a subprocess reading its stdin saw EOF.
    assert out["reader_saw_eof"] is True
    # A process of the script's own, started from the server, can start another.
    assert out["nested_exitcode"] == 0
    # A signal sent to the server kills it: the script's own handler does not run there.
    assert out["server_signal"] == signal.SIGTERM
    assert out["handler_ran"] is False
    assert not marker.exists()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "how", ["explicit", "thread"], ids=["forkserver-named", "another-thread-runs"]
)
def test_a_fresh_server_when_forkserver_is_named_or_forking_is_unsafe(how: str) -> None:
    out = run_script("forked_server.py", how)
    assert out["forked"] is False
    assert out["indices"] == list(range(32))
    assert out["global"] == [0]
    assert out["reader_saw_eof"] is True


@pytest.mark.timeout(120)
def test_a_fresh_server_once_torch_has_started_its_thread_pool() -> None:
    out = run_script("forked_server.py", "native")
    if out["native_threads_started"] == 0:
        pytest.skip("torch started no thread for the product on this machine (one core?)")
    assert out["forked"] is False
    assert out["indices"] == list(range(32))


@pytest.mark.timeout(120)
def test_the_forked_server_exits_with_the_loaders_process() -> None:
    # It must not hold the write end of its "alive" pipe: the EOF is how it learns.
    with subprocess.Popen(
        [sys.executable, str(SCRIPTS / "forked_server.py"), "wait"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,  # the tracker's note on the killed script's semaphores
        text=True,
        env=script_env(),
    ) as proc:
        try:
            assert proc.stdout is not None
            out = json.loads(proc.stdout.readline())
            assert out["forked"] is True
            server = psutil.Process(out["server"])
        finally:
            proc.kill()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if server.status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.05)
    else:
        os.kill(server.pid, signal.SIGKILL)
        pytest.fail("the forked server outlived the process it was forked from by 30 s")
