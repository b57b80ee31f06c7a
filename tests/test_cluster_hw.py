"""Clusters in hardware mode: two prefill instances (TP2 each) write into the one ring of
a decode instance (TP1) over real NIXL and Mooncake transfers, every byte verified,
and `kvstage compare` puts the run beside its simulation."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from conftest import require_engine
from test_hw import read_summary, run, write_scenario
from test_outcome import kvstage_cmd

from kvstage.run.tracefile import read_records
from kvstage.shared.invariants import check_records

ROOT = Path(__file__).resolve().parents[1]


def cluster_scenario(tmp_path: Path, requests: int = 10, router: str = "round-robin") -> Path:
    f = write_scenario(tmp_path, 2, 1, 8, requests=requests)
    f.write_text(
        f.read_text()
        + f'[cluster]\nprefill_instances = 2\ndecode_instances = 1\nrouter = "{router}"\n'
    )
    return f


@pytest.mark.hw
@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_two_prefill_instances_share_one_decode_ring(tmp_path, backend):
    require_engine(backend)
    f = cluster_scenario(tmp_path)
    code, run_dir = run(tmp_path, backend, f)
    summary = read_summary(run_dir)
    assert code == 0, summary.get("errors")
    assert summary["requests_done"] == 10 and summary["requests_failed"] == 0
    assert summary["bytes_wrong"] == 0 and summary["bytes_verified"] > 0
    _, records = read_records(run_dir)
    assert not check_records(records)
    # five ranks ran: prefill0..3 (two instances of two) and decode0
    assert {(r.role, r.rank) for r in records} == {("prefill", p) for p in range(4)} | {
        ("decode", 0)
    }
    # decode0 answered STAGING_REQs from the sessions of both instances, into one ring
    sessions = {r.peer for r in records if r.role == "decode" and r.phase == "req"}
    assert sessions == {0, 1, 2, 3}
    # round-robin: even rooms written by instance 0 (ranks 0, 1), odd rooms by instance 1
    writes = {(r.room, r.rank // 2) for r in records if r.role == "prefill" and r.phase == "write"}
    assert writes and all(inst == room % 2 for room, inst in writes)
    ring_ends = [r.ring_used for r in records if r.role == "decode" and r.ring_used >= 0]
    assert ring_ends[-1] == 0  # nothing left in the ring


@pytest.mark.hw
def test_compare_puts_a_cluster_run_beside_its_simulation(tmp_path):
    require_engine("nixl")
    f = cluster_scenario(tmp_path, requests=6)
    code, run_dir = run(tmp_path, "nixl", f)
    assert code == 0
    sim = subprocess.run(
        [*kvstage_cmd(), "sim", str(f), "--out", str(tmp_path / "sim"), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert sim.returncode == 0, sim.stdout + sim.stderr
    cmp = subprocess.run(
        [*kvstage_cmd(), "compare", str(tmp_path / "sim"), str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cmp.returncode == 0, cmp.stdout + cmp.stderr
    assert "TTFT MAPE" in cmp.stdout and "(n=6)" in cmp.stdout  # all six rooms matched up


def test_hardware_mode_refuses_a_load_aware_router_with_one_line(tmp_path):
    f = cluster_scenario(tmp_path, router="least-outstanding")
    proc = subprocess.run(
        [*kvstage_cmd(), "hw", str(f), "--out", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in out
    assert "only the simulator sees" in out and "round-robin" in out
    assert not (tmp_path / "run").exists()
