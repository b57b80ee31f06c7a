"""scripts/kvstage.sbatch without SLURM: the batch script as sbatch would run it, on this host.

A fake `srun` (written here, first on PATH) starts SLURM_NTASKS copies of the task
command on this machine, each with its own SLURM_PROCID and SLURM_LOCALID, as srun
does on one node. Everything else is the real script: the launcher it starts
(`kvstage hw --no-spawn`), the wait for the run's secret, the per-task script
(scripts/kvstage-task.sh) whose `kvstage hw-rank` takes its identity from SLURM's
variables and its rendezvous from MASTER_ADDR:MASTER_PORT, and the job's exit code.
A P2->D1 run moves real bytes with NIXL over loopback and verifies every one.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import require_engine
from test_control_auth import _bytes_to_verify, _free_port
from test_hw import write_scenario

from kvstage.run.rundir import read_summary
from kvstage.shared.scenario import load_scenario

ROOT = Path(__file__).resolve().parent.parent
SBATCH = ROOT / "scripts" / "kvstage.sbatch"
TASK = ROOT / "scripts" / "kvstage-task.sh"
BIN = Path(sys.executable).parent

# srun on one node: every task here, SLURM_PROCID = SLURM_LOCALID = its index; only
# `--opt=value` options (the batch script uses no other form); exit: the first failure's.
FAKE_SRUN = r"""#!/usr/bin/env bash
set -u
while [[ $# -gt 0 && $1 == --*=* ]]; do shift; done
[[ $# -gt 0 && $1 != -* ]] || { echo "fake srun: unexpected arguments: $*" >&2; exit 99; }
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do
    SLURM_PROCID=$i SLURM_LOCALID=$i SLURM_NODEID=0 SLURM_STEP_ID=0 "$@" >"$FAKE_SRUN_LOGS/task$i.log" 2>&1 &
    pids+=($!)
done
rc=0
for p in "${pids[@]}"; do
    wait "$p" || { code=$?; [[ $rc -ne 0 ]] || rc=$code; }
done
exit $rc
"""


def test_scripts_parse():
    for script in (SBATCH, TASK):
        done = subprocess.run(
            ["bash", "-n", str(script)], capture_output=True, text=True, timeout=30
        )
        assert done.returncode == 0, done.stderr
    text = SBATCH.read_text()
    assert (
        "set -euo pipefail" in text
        and "#SBATCH --nodes=" in text
        and "#SBATCH --partition=" in text
    )


def _clean_env() -> dict[str, str]:
    """This environment without anything that would place or name a rank."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("KVSTAGE", "UCX_", "MC_TCP_", "MASTER_", "SLURM_", "CUDA_"))
        and k
        not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SCENARIO", "BACKEND", "DEVICE", "RUN_DIR")
    }


def _job(
    tmp_path: Path, scenario: Path, ntasks: int, *args: str, **extra: str
) -> tuple[subprocess.CompletedProcess, Path, Path]:
    """Run the batch script as a one-node job of `ntasks` tasks; (result, run dir, task logs)."""
    fake = tmp_path / "fakebin"
    fake.mkdir()
    (fake / "srun").write_text(FAKE_SRUN)
    (fake / "srun").chmod(0o755)
    logs = tmp_path / "tasks"
    logs.mkdir()
    run_dir = tmp_path / "run"
    env = _clean_env()
    env.update(
        {
            "PATH": f"{fake}:{env.get('PATH', '')}",
            "FAKE_SRUN_LOGS": str(logs),
            # what sbatch sets for a one-node job
            "SLURM_JOB_ID": "4242",
            "SLURM_NTASKS": str(ntasks),
            "SLURM_JOB_NUM_NODES": "1",
            "SLURM_JOB_NODELIST": socket.gethostname(),
            "SLURM_SUBMIT_DIR": str(ROOT),
            # the script's parameters: one host, so the rendezvous is on loopback
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(_free_port()),
            "SCENARIO": str(scenario),
            "BACKEND": "nixl",
            "DEVICE": "cpu",
            "RUN_DIR": str(run_dir),
            "KVSTAGE": str(BIN / "kvstage"),
            "TIMEOUT": "120",
            **extra,
        }
    )
    # sbatch runs a copy from its spool folder: so does this, to prove nothing needs $0's folder
    spooled = tmp_path / "spool" / "slurm_script"
    spooled.parent.mkdir()
    spooled.write_text(SBATCH.read_text())
    done = subprocess.run(
        ["bash", str(spooled), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    return done, run_dir, logs


def _task_logs(logs: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(logs.iterdir()))


def _assert_every_byte_right(run_dir: Path) -> int:
    """A clean P2->D1 NIXL run of 3 rooms on loopback: every byte of every room verified
    right, no violation, nothing left in a ring, nothing unauthenticated; the bytes."""
    summary = read_summary(run_dir)
    expected = _bytes_to_verify(load_scenario(run_dir / "scenario.toml"))
    assert summary["bytes_verified"] == expected and summary["bytes_wrong"] == 0
    assert summary["requests_done"] == 3 and summary["requests_failed"] == 0
    assert (
        summary["backend"] == "nixl"
        and summary["invariant_violations"] == 0
        and not summary["errors"]
    )
    assert (
        not any(summary["ring_used_at_end"].values()) and summary["unauthenticated_messages"] == 0
    )
    assert {c["host"] for c in summary["clocks"].values()} == {"127.0.0.1"}
    return expected


@pytest.mark.hw
@pytest.mark.timeout(300)
@pytest.mark.slow
def test_sbatch_p2_d1_every_byte_verified(tmp_path):
    require_engine("nixl")
    scenario = write_scenario(tmp_path, 2, 1, 8)
    t = time.monotonic()
    done, run_dir, logs = _job(tmp_path, scenario, 3, "--trace-format", "jsonl")
    wall = time.monotonic() - t
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}\n{_task_logs(logs)}"
    # each task took its identity from SLURM's variables, its rendezvous from MASTER_ADDR:MASTER_PORT
    for i, name in enumerate(["prefill0", "prefill1", "decode0"]):
        log = (logs / f"task{i}.log").read_text()
        assert (
            f"{name}: global rank {i} from slurm, device cpu, host 127.0.0.1, rendezvous 127.0.0.1:"
            in log
        ), log
    expected = _assert_every_byte_right(run_dir)
    assert "launcher exit 0, tasks exit 0" in done.stdout
    print(
        f"\nkvstage.sbatch P2->D1 (fake srun, NIXL, loopback): {expected} bytes verified, 0 wrong, "
        f"wall {wall:.1f}s"
    )


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_sbatch_wrong_task_count_fails_fast(tmp_path):
    """4 tasks for a P2->D1 scenario: every task refuses with one clear message, and the
    job ends (launcher terminated after GRACE_S) instead of waiting for its timeout."""
    scenario = write_scenario(tmp_path, 2, 1, 8)
    t = time.monotonic()
    done, run_dir, logs = _job(tmp_path, scenario, 4, GRACE_S="2")
    wall = time.monotonic() - t
    assert done.returncode != 0, done.stdout
    assert (
        "$SLURM_NTASKS = 4 but the scenario has prefill TP2 + decode TP1 = 3"
        in (logs / "task0.log").read_text()
    )
    assert wall < 60, f"the job took {wall:.0f}s: the launcher was left to its timeout"
    assert "tasks exit 2" in done.stdout, done.stdout


def test_sbatch_refuses_a_used_run_dir(tmp_path):
    scenario = write_scenario(tmp_path, 2, 1, 8)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run.secret").write_text("00" * 32)
    done, _, logs = _job(tmp_path, scenario, 3)
    assert done.returncode == 2 and "already holds a run" in done.stderr
    assert not list(logs.iterdir())  # no task started


def test_sbatch_bad_scenario_starts_no_task(tmp_path):
    """The launcher refuses the scenario (exit 2) before writing a secret: the job ends with
    its code and no task is started."""
    done, _, logs = _job(tmp_path, tmp_path / "missing.toml", 3)
    assert done.returncode == 2 and "no such scenario file" in " ".join(done.stderr.split()), (
        done.stderr
    )
    assert not list(logs.iterdir())


@pytest.mark.hw
@pytest.mark.timeout(300)
@pytest.mark.slow
def test_torchrun_p2_d1_every_byte_verified(tmp_path):
    """README's torchrun command line, on one node: torchrun sets RANK, LOCAL_RANK,
    WORLD_SIZE, MASTER_ADDR and MASTER_PORT (its own store's port, so the rendezvous is
    --rendezvous on another port); each hw-rank takes its identity from them."""
    require_engine("nixl")
    scenario = write_scenario(tmp_path, 2, 1, 8)
    run_dir = tmp_path / "run"
    store, rdzv = _free_port(), _free_port()
    env = _clean_env()
    launcher = subprocess.Popen(
        [
            str(BIN / "kvstage"),
            "hw",
            str(scenario),
            "--backend",
            "nixl",
            "--device",
            "cpu",
            "--no-spawn",
            "--bind",
            "127.0.0.1",
            "--advertise",
            "127.0.0.1",
            "--port",
            str(rdzv),
            "--out",
            str(run_dir),
            "--timeout",
            "120",
            "--trace-format",
            "jsonl",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not (run_dir / "run.secret").exists():
            assert launcher.poll() is None and time.monotonic() < deadline, (
                "the launcher wrote no run.secret"
            )
            time.sleep(0.05)
        ranks = subprocess.run(
            [
                str(BIN / "torchrun"),
                "--nnodes=1",
                "--nproc-per-node=3",
                "--node-rank=0",
                "--master-addr=127.0.0.1",
                f"--master-port={store}",
                "--no-python",
                str(BIN / "kvstage"),
                "hw-rank",
                str(run_dir / "scenario.toml"),
                "--rendezvous",
                f"127.0.0.1:{rdzv}",
                "--secret-file",
                str(run_dir / "run.secret"),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=200,
        )
        out, _ = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(timeout=10)
    assert ranks.returncode == 0 and launcher.returncode == 0, (
        f"{out[-3000:]}\n{ranks.stderr[-3000:]}"
    )
    for g, name in enumerate(["prefill0", "prefill1", "decode0"]):
        assert (
            f"{name}: global rank {g} from torchrun, device cpu, host 127.0.0.1, rendezvous 127.0.0.1:{rdzv}"
            in ranks.stderr
        )
    _assert_every_byte_right(run_dir)
