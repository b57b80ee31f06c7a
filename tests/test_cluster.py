"""Clusters in simulation: several prefill instances writing into the rings of several
decode instances, the routers, the shared NICs, and the one-to-one case unchanged."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from kvstage.metrics.rooms import room_latencies
from kvstage.shared.cluster import InstanceLoad, Router, Sessions
from kvstage.shared.scenario import ScenarioError, load_scenario
from kvstage.sim.driver import simulate
from kvstage.sim.links import Fabric

ROOT = Path(__file__).resolve().parents[1]
P4D2 = ROOT / "scenarios" / "llama3-8b-p4-d2.toml"  # prefill TP4 -> decode TP2
QUICK = ["workload.requests=24", "workload.rate_per_s=12", "decode.staging_pool_mb=1024"]


def run(*sets: str):
    return simulate(load_scenario(P4D2, [*QUICK, *sets]))


def decode_instance_of_rooms(records, decode_tp: int) -> dict[int, set[int]]:
    out: dict[int, set[int]] = {}
    for r in records:
        if r.role == "decode" and r.phase == "room_open":
            out.setdefault(r.room, set()).add(r.rank // decode_tp)
    return out


def test_sessions_number_ranks_globally_and_route_rooms():
    g = load_scenario(P4D2).geometry()
    ss = Sessions(g, prefill_instances=2, decode_instances=3)
    assert (ss.prefill_ranks, ss.decode_ranks) == (8, 6)
    ss.routes[10] = (1, 2)
    # decode rank 5 = instance 2, local 1; its writers for room 10 are instance 1's
    assert ss.writers(10, 5) == [4 + p for p in g.writers(1)]
    assert ss.targets(10, 6) == [4 + d for d in g.targets(2)]
    assert ss.serves("prefill", 6, 10) and not ss.serves("prefill", 2, 10)
    # every session that may write into decode rank 1: its writers in both prefill instances
    assert ss.all_writers(1) == [*g.writers(1), *(4 + p for p in g.writers(1))]
    # a room without a route is served by instance 0 of each side
    assert ss.writers(99, 1) == g.writers(1)


def test_one_instance_each_is_the_one_to_one_case_byte_for_byte():
    """An explicit [cluster] of one instance each changes nothing in the trace."""
    plain, explicit = (
        run(),
        run(
            "cluster.prefill_instances=1",
            "cluster.decode_instances=1",
            'cluster.router="least-outstanding"',
        ),
    )
    assert plain.records == explicit.records
    assert plain.rooms_done == 24


def test_two_prefill_instances_share_one_decode_instance_ring():
    """Both prefill instances' sessions write into the same decode rings, every room
    finishes, the invariants hold (checked by the run itself), and the rings end empty."""
    res = run("cluster.prefill_instances=2")
    assert res.rooms_done == 24 and res.rooms_failed == 0 and not res.violations
    sessions_per_decode = Counter()
    for r in res.records:
        if r.role == "decode" and r.phase == "req":
            sessions_per_decode[(r.rank, r.peer // 4)] += 1  # peer: the global prefill rank
    # decode ranks 0 and 1 each answered STAGING_REQs from sessions of both instances
    assert {k for k, n in sessions_per_decode.items() if n} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    # round-robin: even rooms from prefill instance 0, odd rooms from instance 1
    writers = {
        (r.room, r.rank // 4) for r in res.records if r.role == "prefill" and r.phase == "write"
    }
    assert all(inst == room % 2 for room, inst in writers)


def test_round_robin_spreads_rooms_over_decode_instances():
    res = run("cluster.decode_instances=2")
    rooms = decode_instance_of_rooms(res.records, 2)
    assert all(len(insts) == 1 for insts in rooms.values())  # a room lives on one instance
    by_instance = Counter(next(iter(i)) for i in rooms.values())
    assert by_instance == {0: 12, 1: 12}
    assert res.rooms_done == 24 and not res.violations
    latencies = room_latencies(res.records)
    assert all("done" in info for info in latencies.values())  # done at its own instance's ranks


@pytest.mark.parametrize("router", ["least-outstanding", "staging-aware"])
def test_load_aware_routers_finish_every_room_and_use_every_instance(router):
    res = run(
        "cluster.prefill_instances=2",
        "cluster.decode_instances=2",
        f'cluster.router="{router}"',
        "workload.rate_per_s=40",
    )
    assert res.rooms_done == 24 and not res.violations
    rooms = decode_instance_of_rooms(res.records, 2)
    assert set(Counter(next(iter(i)) for i in rooms.values())) == {0, 1}


@pytest.mark.parametrize("router", ["least-outstanding", "staging-aware", "cache-aware"])
def test_live_loads_route_as_a_fresh_look_at_every_instance(router, monkeypatch):
    """The simulator keeps each instance's load current as its ranks handle events
    (sim/cluster.py LiveLoads); at every arrival it must choose what reading every
    instance afresh would choose."""
    from kvstage.sim import cluster
    from kvstage.sim.driver import Simulation

    live, checked = cluster.LiveLoads.route, []

    def route(self, request=None):
        got = live(self, request)
        fresh = [
            [self._router.key(role, cluster._load(g)) for g in groups]
            for role, groups in self._groups.items()
        ]
        assert got == (cluster.least(fresh[0]), cluster.least(fresh[1]))
        checked.append(got)
        return got

    monkeypatch.setattr(cluster.LiveLoads, "route", route)
    s = load_scenario(
        P4D2,
        [
            *QUICK,
            "cluster.prefill_instances=3",
            "cluster.decode_instances=3",
            f'cluster.router="{router}"',
            "workload.rate_per_s=40",
            "decode.staging_pool_mb=600",
        ],
    )
    res = Simulation(s).run()
    assert res.rooms_done == 24 and len(checked) == 24 and len(set(checked)) > 1


def test_a_load_aware_run_ends_when_an_instance_never_gets_a_room():
    """Two requests far apart go to prefill instance 0 both times (it is idle again):
    instance 1 never handles an event, and the run still ends."""
    res = run(
        "cluster.prefill_instances=2",
        'cluster.router="least-outstanding"',
        "workload.requests=2",
        "workload.rate_per_s=0.1",
    )
    assert res.rooms_done == 2 and not res.violations
    assert {r.rank // 4 for r in res.records if r.role == "prefill"} == {0}


def test_routers_choose_by_load():
    rr = Router("round-robin", 2, 3)
    assert [rr.route(i, [], []) for i in range(4)] == [(0, 0), (1, 1), (0, 2), (1, 0)]
    busy, idle = InstanceLoad(outstanding=5), InstanceLoad(outstanding=1)
    lo = Router("least-outstanding", 2, 2)
    assert lo.route(0, [busy, idle], [idle, busy]) == (1, 0)
    # staging-aware: the decode instance with the most free ring, whatever its queue
    sa = Router("staging-aware", 1, 2)
    full = InstanceLoad(outstanding=0, free_ring_bytes=10, free_kv_pages=100)
    roomy = InstanceLoad(outstanding=3, free_ring_bytes=1000, free_kv_pages=100)
    assert sa.route(0, [idle], [full, roomy]) == (0, 1)
    with pytest.raises(ValueError, match="allowed: round-robin"):
        Router("random", 1, 1)


def test_a_dead_prefill_rank_fails_only_its_instances_rooms():
    """Prefill rank 5 (instance 1, local 1) is killed: the decode fails the rooms it
    writes (instance 1's, after the failure detector's timeout); instance 0's rooms,
    which share the same decode rings, all finish."""
    res = run(
        "cluster.prefill_instances=2",
        "faults.kill=[{role='prefill', rank=5, at_s=0.2}]",
        "transfer.room_timeout_s=10",
    )
    assert not res.violations
    assert res.failures and all(room % 2 == 1 for room in res.failures), res.failures
    done = {r.room for r in res.records if r.role == "decode" and r.phase == "room_done"}
    assert {room for room in range(24) if room % 2 == 0} <= done


def test_ranks_on_one_rail_share_a_nic():
    """gpus_per_node 8, 2 NICs per node: prefill instances of TP4 sit on node 0 side by
    side; GPU slots 0-3 use NIC 0 and slots 4-7 NIC 1, so rank 4 (instance 1) does not
    share instance 0's NIC, and with 1 NIC per node every rank shares one."""
    import simpy

    from kvstage.sim.cluster import cluster_nics

    for nics, expect_shared in ((2, False), (1, True)):
        s = load_scenario(P4D2, ["cluster.prefill_instances=2", f"cluster.nics_per_node={nics}"])
        fabric = Fabric(simpy.Environment())
        ss = Sessions(s.geometry(), 2, 1)
        prefill, decode = cluster_nics(fabric, s, ss, s.links.resolved())
        assert prefill[0] is prefill[3]
        assert (prefill[0] is prefill[4]) is expect_shared
        assert decode[0] is not prefill[0]  # the decode instance has nodes of its own


def test_cluster_table_errors_name_the_field_and_the_choices():
    with pytest.raises(
        ScenarioError,
        match=r"cluster.router.*'round-robin', 'least-outstanding', 'staging-aware' or 'cache-aware'",
    ):
        load_scenario(P4D2, ['cluster.router="random"'])
    with pytest.raises(ScenarioError, match="nics_per_node .* must be <= gpus_per_node"):
        load_scenario(P4D2, ["cluster.nics_per_node=16"])
    with pytest.raises(ScenarioError, match="cluster.prefill_instances"):
        load_scenario(P4D2, ["cluster.prefill_instances=0"])


def test_validate_states_the_cluster_and_the_decode_side():
    from typer.testing import CliRunner

    from kvstage.cli.main import app

    res = CliRunner().invoke(
        app,
        [
            "validate",
            str(P4D2),
            "--set",
            "cluster.prefill_instances=3",
            "--set",
            "decode.gpu_memory_gib=80",
            "--set",
            "workload.output_tokens=64",
        ],
        env={"COLUMNS": "200"},
    )
    assert res.exit_code == 0, res.output
    assert "3 prefill x TP4 + 1 decode x TP2 = 14 GPUs" in res.output
    assert "decode KV capacity per rank" in res.output and "tokens (bf16)" in res.output
    assert "decode GPU memory" in res.output and "weights 7.5 (bf16)" in res.output
    assert "TPOT alone" in res.output
