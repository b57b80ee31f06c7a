"""Every fault scenario ends as its [expect] table says, with no invariant broken."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import require_engine
from rich.console import Console

from kvstage.run.expect import check_expectation
from kvstage.run.rundir import read_summary
from kvstage.run.tracefile import read_records
from kvstage.shared.invariants import check_records
from kvstage.shared.scenario import load_scenario
from kvstage.sim.driver import Simulation

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


def _random_faults(s) -> bool:
    """Faults drawn with a probability per message: how many fire depends on how many
    messages a rank sends, which depends on timing, so counts may differ by mode."""
    f = s.faults
    return bool(f.drop or f.duplicate or f.delay)


@pytest.mark.hw
@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", FAULTS, ids=lambda p: p.stem)
@pytest.mark.slow
def test_fault_scenario_same_faults_same_outcome_in_both_modes(tmp_path, path):
    """One fault semantics: the simulation and a hardware run (NIXL) of the same fault
    scenario inject the same faults on the same ranks and reach the same [expect]."""
    from kvstage.run.hwrun import run_hardware
    from kvstage.run.summary import simulation_summary

    require_engine("nixl")
    s = load_scenario(path)
    sim = Simulation(s).run()
    sim_summary = simulation_summary(s, sim)
    assert check_expectation(s, sim.failures, len(sim.requests), "sim") == []
    code, run_dir = run_hardware(s, out=tmp_path / "run", timeout_s=240, console=Console(width=120))
    summary = read_summary(run_dir)
    assert code == 0, (summary.get("errors"), summary.get("failures"))
    if s.expect.hw_run_fails:  # a killed rank ends the hardware run: the run names it
        victim = f"{s.faults.kill[0].role}{s.faults.kill[0].rank}"
        assert any(victim in e and "died" in e for e in summary["errors"]), summary["errors"]
        assert victim in sim_summary["ranks_died"]
        return
    hw_failed = {int(k) for k in summary["failures"]}
    assert (
        hw_failed == {int(k) for k in sim_summary["failures"]} == set(s.expect.failed_rooms or [])
    )
    hw_faults, sim_faults = summary["faults_by_rank"], sim_summary["faults_by_rank"]
    if _random_faults(s):
        assert set(hw_faults) == set(sim_faults)
        for rank, kinds in hw_faults.items():
            assert {k.split(":")[0] for k in kinds} == {k.split(":")[0] for k in sim_faults[rank]}
    else:
        # An abort at a phase fires on each rank that reaches that phase of the room;
        # a rank whose room was already aborted by a faster peer never gets there, so
        # on hardware it may fire on fewer ranks, never on others. Everything else
        # fires exactly where the simulation fires it.
        # A message fault that matches every copy (times > 1) fires once per re-send, and
        # how many re-sends fit before the room times out depends on timing: the same
        # faults on the same ranks, counts may differ.
        for rank in set(hw_faults) | set(sim_faults):
            hw_r, sim_r = hw_faults.get(rank, {}), sim_faults.get(rank, {})
            for kind in set(hw_r) | set(sim_r):
                if kind.startswith("abort:"):
                    assert hw_r.get(kind, 0) <= sim_r.get(kind, 0), (
                        rank,
                        kind,
                        hw_faults,
                        sim_faults,
                    )
                elif kind.split(":")[0] in ("drop", "duplicate", "delay"):
                    assert (kind in hw_r) == (kind in sim_r), (rank, kind, hw_faults, sim_faults)
                else:
                    assert hw_r.get(kind) == sim_r.get(kind), (rank, kind, hw_faults, sim_faults)
    assert summary["faults_injected"], "no fault was injected"
    assert summary["bytes_wrong"] == 0
    assert all(v == 0 for v in summary["ring_used_at_end"].values())
    _, records = read_records(run_dir)
    assert not check_records(records)


def test_abort_at_rsp_fires_on_every_prefill_rank_that_gets_the_answer():
    """The 'rsp' phase: each prefill rank aborts the room when its first STAGING_RSP of it
    arrives (the runtime decides, per rank, as for every phase)."""
    s = load_scenario(
        next(p for p in FAULTS if p.stem == "abort-mid-write"),
        overrides=[
            'faults.abort=[{room = 3, phase = "rsp"}]',
            "expect.failed_rooms=[3]",
            'expect.reason_contains="aborted at rsp"',
        ],
    )
    result = Simulation(s).run()
    assert not result.violations
    assert check_expectation(s, result.failures, len(result.requests), "sim") == []
    by_rank = {r.name: r.faults_injected for r in result.ranks if r.faults_injected}
    g = s.geometry()
    assert by_rank == {f"prefill{p}": {"abort:rsp": 1} for p in range(g.prefill_tp)}


def test_a_message_fate_does_not_depend_on_the_order_a_rank_sends_in():
    """A rank's sending order depends on timing in hardware mode: the same messages sent
    interleaved otherwise (each identity's sends in their own order: a resend after the
    send) meet the same fates (dropped, duplicated, passed), each resend its own draw,
    so a scenario drops the same messages in both modes."""
    import random

    from kvstage.shared.faults import FaultPlan, FaultsConfig
    from kvstage.shared.protocol import StagingRsp, Watermark

    cfg = FaultsConfig(drop={"STAGING_RSP": 0.3, "WATERMARK": 0.3}, duplicate={"STAGING_RSP": 0.2})
    msgs = [
        StagingRsp(room, chunk, 4096 * chunk, 0, 0, False, p, 0)
        for room in range(6)
        for chunk in range(4)
        for p in range(2)
    ]
    msgs += msgs[:10]  # resends: the same identities again
    msgs += [Watermark(r, 0, p, 0) for r in range(5) for p in range(2)]

    def ident(m):
        return (type(m).__name__, getattr(m, "room", None), getattr(m, "chunk", None),
                m.prefill_rank, m.decode_rank)  # fmt: skip

    def fates(order):
        plan, count, out = FaultPlan(cfg, seed=7, stream=4096), {}, {}
        for m in order:
            n = count[ident(m)] = count.get(ident(m), -1) + 1
            out[(ident(m), n)] = len(plan.on_send(m))
        return out

    # another interleaving: the identities' turns shuffled, each one's sends in order
    turns = [ident(m) for m in msgs]
    random.Random(3).shuffle(turns)
    queues: dict = {}
    for m in msgs:
        queues.setdefault(ident(m), []).append(m)
    other = [queues[k].pop(0) for k in turns]
    assert sorted(map(repr, other)) == sorted(map(repr, msgs)) and other != msgs
    a = fates(msgs)
    assert a == fates(other)
    assert {0, 1, 2} <= set(a.values())  # dropped, passed, duplicated: every fate drawn
    resent = [k for k in a if k[1] == 1]
    assert resent and any(a[k] != a[(k[0], 0)] for k in resent)  # a resend draws anew
