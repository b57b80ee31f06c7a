"""Every fault scenario ends as its [expect] table says, with no invariant broken."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import require_engine
from rich.console import Console

from kvstage.expect import check_expectation
from kvstage.runs import read_summary
from kvstage.shared.invariants import check_records
from kvstage.shared.scenario import load_scenario
from kvstage.sim.driver import Simulation
from kvstage.tracefile import read_records

FAULTS = sorted((Path(__file__).resolve().parents[1] / "scenarios" / "faults").glob("*.toml"))


def test_catalogue_is_there():
    assert len(FAULTS) >= 9


@pytest.mark.parametrize("path", FAULTS, ids=lambda p: p.stem)
def test_fault_scenario_in_simulation(path):
    s = load_scenario(path)
    sim = Simulation(s)
    result = sim.run()
    assert not result.violations, "\n".join(v.format() for v in result.violations[:3])
    assert check_expectation(s, result.failures, len(result.requests), "sim") == []
    assert all(rt.machine.ring.empty for rt in sim.decode)  # nothing leaked, whatever failed
    # a fault scenario that injects nothing would prove nothing
    assert result.faults_injected, "no fault was injected"


def test_fault_scenarios_are_reproducible_from_the_seed():
    s = load_scenario(next(p for p in FAULTS if p.stem == "drop-rsp-watermark"))
    a, b = Simulation(s).run(), Simulation(s).run()
    assert a.records == b.records and a.faults_injected == b.faults_injected
    assert a.faults_injected  # and something was injected


HW_CASES = ["drop-rsp-watermark", "duplicate-everything", "abort-mid-write", "lost-chunk-ready", "kill-prefill"]


@pytest.mark.hw
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", HW_CASES)
def test_fault_scenario_on_hardware(tmp_path, name):
    from kvstage.hwrun import run_hardware

    require_engine("nixl")
    s = load_scenario(next(p for p in FAULTS if p.stem == name))
    code, run_dir = run_hardware(s, out=tmp_path / "run", timeout_s=240, console=Console(width=120))
    summary = read_summary(run_dir)
    assert code == 0, (summary.get("errors"), summary.get("failures"))
    if s.expect.hw_run_fails:
        assert any("died" in e for e in summary["errors"])
        return
    assert summary["bytes_wrong"] == 0
    assert all(v == 0 for v in summary["ring_used_at_end"].values())
    _, records = read_records(run_dir)
    assert not check_records(records)
