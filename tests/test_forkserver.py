"""The fork server (hw/launch/forkserver.py): a forked rank is what a spawned one would be,
its exit is told to the launcher, and no forked rank outlives its launcher."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvstage.hw.launch.forkserver import (
    ForkServer,
    forkable,
    rank_start,
    start_rank,
)

PROBE = Path(__file__).parent / "helpers" / "forked_probe.py"


@pytest.fixture
def light():
    """A fork server that imports nothing beforehand: quick to start."""
    server = ForkServer.start(preload=())
    yield server
    server.close()


def _probe(server: ForkServer, tmp_path: Path, mode: str, env: dict[str, str] | None = None):
    out = tmp_path / f"seen-{mode.replace(':', '')}.json"
    log = tmp_path / f"{mode.replace(':', '')}.log"
    env = env if env is not None else {"PATH": os.environ.get("PATH", ""), "PROBE_MARK": "1"}
    child = server.fork([sys.executable, str(PROBE), str(out), mode], env, log)
    return child, out, log


def _wait_for(path: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} was not written within {timeout_s}s"
        time.sleep(0.02)


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie nobody reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _wait_gone(pid: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not _gone(pid):
        assert time.monotonic() < deadline, f"pid {pid} still runs after {timeout_s}s"
        time.sleep(0.02)


def test_the_setting_says_fork_or_spawn():
    assert rank_start({}) == "fork"
    assert rank_start({"KVSTAGE_RANK_START": "spawn"}) == "spawn"
    with pytest.raises(ValueError, match="KVSTAGE_RANK_START='exec'.*fork, spawn"):
        rank_start({"KVSTAGE_RANK_START": "exec"})


def test_only_this_interpreter_running_a_module_or_a_script_is_forked():
    assert forkable([sys.executable, "-m", "kvstage.hw.rank.main", "s.toml"])
    assert forkable([sys.executable, str(PROBE), "x"])
    assert not forkable(["numactl", "-N0", sys.executable, "-m", "kvstage.hw.rank.main"])
    assert not forkable([sys.executable, "-c", "pass"])
    assert not forkable([sys.executable, "-m"])


def test_a_forked_process_is_what_a_spawned_one_would_be(light, tmp_path):
    env = {"PATH": os.environ.get("PATH", ""), "PROBE_MARK": "yes"}
    child, out, log = _probe(light, tmp_path, "exit:7", env)
    assert child.wait(timeout=60) == 7
    seen = json.loads(out.read_text())
    assert seen["argv"] == [str(PROBE), str(out), "exit:7"]
    assert seen["name"] == "__main__"
    assert seen["cwd"] == os.getcwd()
    assert seen["env"] == env  # exactly the environment asked for, nothing of the server's
    assert seen["session_leader"] is True  # its own process group: killpg reaches it alone
    assert seen["ppid"] == light.proc.pid
    assert seen["stdin"] == os.devnull
    assert seen["torch_preloaded"] is False
    assert log.read_text().splitlines() == ["to stdout", "to stderr"]
    assert child.cpu_s is not None and child.cpu_s >= 0


def test_how_a_forked_process_ended_is_told(light, tmp_path):
    raised, _, raised_log = _probe(light, tmp_path, "raise")
    killed, _, _ = _probe(light, tmp_path, "kill")
    fine, _, _ = _probe(light, tmp_path, "exit:0")
    assert raised.wait(timeout=60) == 1
    assert "RuntimeError: the probe raised" in raised_log.read_text()
    assert killed.wait(timeout=60) == -signal.SIGKILL
    assert fine.wait(timeout=60) == 0
    assert fine.poll() == 0


def test_a_module_runs_as_with_python_m(light, tmp_path):
    log = tmp_path / "help.log"
    cmd = [sys.executable, "-m", "kvstage.hw.rank.main", "--help"]
    child = light.fork(cmd, dict(os.environ), log)
    assert child.wait(timeout=120) == 0
    assert "usage: kvstage.hw.rank.main" in log.read_text()


def test_closing_the_launcher_end_ends_every_forked_process(tmp_path):
    server = ForkServer.start(preload=())
    try:
        child, out, _ = _probe(server, tmp_path, "pause")
        _wait_for(out)
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(timeout=0.1)
        assert child.poll() is None
    finally:
        server.close()
    _wait_gone(child.pid)
    assert server.proc.returncode == 0


def test_a_killed_launcher_takes_its_forked_processes_along(tmp_path):
    out = tmp_path / "seen.json"
    code = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from kvstage.hw.launch.forkserver import ForkServer\n"
        "s = ForkServer.start(preload=())\n"
        f"c = s.fork([sys.executable, {str(PROBE)!r}, {str(out)!r}, 'pause'], {{}}, "
        f"Path({str(tmp_path / 'pause.log')!r}))\n"
        "print(s.proc.pid, c.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    launcher = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        server_pid, child_pid = map(int, launcher.stdout.readline().split())
        _wait_for(out)
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=30)
        _wait_gone(child_pid)
        _wait_gone(server_pid)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        launcher.wait(timeout=30)


def test_a_dead_fork_server_s_ranks_end_and_are_told_ended(tmp_path):
    server = ForkServer.start(preload=())
    try:
        child, out, _ = _probe(server, tmp_path, "pause")
        _wait_for(out)
        os.kill(server.proc.pid, signal.SIGKILL)
        _wait_gone(child.pid)  # its parent-death signal
        assert child.wait(timeout=30) == -signal.SIGTERM
        assert not server.alive
    finally:
        server.close()


def test_the_shared_fork_server_has_torch_imported_already(tmp_path):
    out = tmp_path / "seen.json"
    env = {k: v for k, v in os.environ.items() if k != "KVSTAGE_RANK_START"}
    child = start_rank([sys.executable, str(PROBE), str(out), "exit:0"], env, tmp_path / "p.log")
    assert child is not None, "the fork server did not start"
    assert child.wait(timeout=60) == 0
    seen = json.loads(out.read_text())
    assert seen["torch_preloaded"] is True
    assert seen["blas_works"] is True  # numpy's BLAS threads came back after the fork
    spawned = {**env, "KVSTAGE_RANK_START": "spawn"}
    assert start_rank([sys.executable, str(PROBE), str(out), "exit:0"], spawned, out) is None
