"""Simulating a cluster in independent groups (`[cluster] shard`, sim/shard.py): the
groups follow rooms and shared NICs, a sharded run gives every room the same
latencies and the same rows as one simulation, and a load-aware router is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstage.metrics.rooms import room_latencies
from kvstage.run.simrun import run_simulation
from kvstage.shared.scenario import ScenarioError, load_scenario
from kvstage.sim.driver import simulate
from kvstage.sim.shard import independent_groups, simulate_scenario, simulate_sharded

ROOT = Path(__file__).resolve().parents[1]
S = ROOT / "scenarios"
P8D2 = S / "llama3-70b-p8-d2.toml"

CASES = {
    # four prefill instances into two decode instances, generation and KV capacity
    # modeled: rooms of prefill i go to decode i mod 2, each decode node its own NICs
    "p8-d2-4x2": (
        P8D2,
        [
            "workload.requests=48",
            "cluster.prefill_instances=4",
            "cluster.decode_instances=2",
            "workload.output_tokens=16",
            "decode.gpu_memory_gib=141",
        ],
    ),
    # the same, folded (one simulated rank per symmetric set) and sharded
    "p8-d2-4x2-fold": (
        P8D2,
        [
            "workload.requests=48",
            "cluster.prefill_instances=4",
            "cluster.decode_instances=2",
            "cluster.fold=true",
        ],
    ),
    # fan-out P2 -> D8, four prefill instances into two decode instances
    "p2-d8-4x2": (
        S / "llama3-8b-p2-d8.toml",
        ["workload.requests=36", "cluster.prefill_instances=4", "cluster.decode_instances=2"],
    ),
    # the slice path, a tight ring and faults of single messages are all fine in a group
    "slice-faults": (
        S / "llama3-8b-p4-d2.toml",
        [
            "workload.requests=24",
            'transfer.path="slice"',
            "cluster.prefill_instances=2",
            "cluster.decode_instances=2",
            "faults.drop.CHUNK_READY=0.05",
        ],
    ),
}


def test_groups_follow_the_routes_and_the_shared_nics():
    sets = ["cluster.prefill_instances=4", "cluster.decode_instances=2", "workload.requests=8"]
    # prefill i -> decode i mod 2; every GPU its own NIC: two groups
    assert independent_groups(load_scenario(P8D2, sets)) == [
        (frozenset({0, 2}), frozenset({0})),
        (frozenset({1, 3}), frozenset({1})),
    ]
    # one NIC per node: both TP2 decode instances sit on one node and share it: one group
    one_nic = independent_groups(load_scenario(P8D2, [*sets, "cluster.nics_per_node=1"]))
    assert one_nic == [(frozenset({0, 1, 2, 3}), frozenset({0, 1}))]
    # fewer requests than instances: an instance with no room is a group of its own
    lone = independent_groups(
        load_scenario(P8D2, ["cluster.prefill_instances=3", "workload.requests=2"])
    )
    assert lone == [(frozenset({0, 1}), frozenset({0})), (frozenset({2}), frozenset())]


@pytest.mark.parametrize("case", list(CASES))
def test_a_sharded_run_gives_every_room_the_same_latencies_and_rows(case):
    path, sets = CASES[case]
    one = simulate(load_scenario(path, sets))
    scenario = load_scenario(path, [*sets, "cluster.shard=true"])
    assert len(independent_groups(scenario)) > 1
    sharded = simulate_scenario(scenario)
    assert (sharded.rooms_done, sharded.rooms_failed) == (one.rooms_done, one.rooms_failed)
    assert sharded.rooms_done >= len(one.requests) - 2  # (dropped messages are recovered)
    assert not one.violations and not sharded.violations
    # (events differ by deadline ticks: a group's pending timers no longer fire once it
    # is done, while in one simulation they fire as long as any group runs)
    assert sharded.sim_time_s == one.sim_time_s
    a, b = room_latencies(one.records), room_latencies(sharded.records)
    assert a.keys() == b.keys()
    for room, info in a.items():
        gaps, other = info.pop("itls", []), b[room].pop("itls", [])
        assert info == pytest.approx(b[room], abs=1e-9), room
        assert gaps == pytest.approx(other, abs=1e-9), room

    def key(r):
        return (
            r.role,
            r.rank,
            r.phase,
            r.start,
            r.end,
            r.room,
            r.chunk,
            r.writer,
            r.peer,
            r.bytes,
            r.requests,
        )

    assert sorted(map(key, one.records)) == sorted(map(key, sharded.records))
    ends = [r.end for r in sharded.records]
    assert ends == sorted(ends)  # merged in time order
    assert [(r.role, r.rank) for r in sharded.ranks] == [(r.role, r.rank) for r in one.ranks]
    assert sharded.failures == one.failures


def test_a_sharded_run_writes_the_same_summary(tmp_path):
    import io
    import json

    from rich.console import Console

    path, sets = CASES["p8-d2-4x2"]
    summaries = []
    for name, extra in (("one", []), ("shard", ["cluster.shard=true"])):
        code = run_simulation(
            load_scenario(path, [*sets, *extra]),
            out=tmp_path / name,
            progress=False,
            console=Console(file=io.StringIO()),
        )
        assert code == 0
        summaries.append(json.loads(next((tmp_path / name).rglob("summary.json")).read_text()))
    a, b = summaries
    for k in (
        "requests_done",
        "ttft_s",
        "tpot_s",
        "e2e_s",
        "kv_transfer_latency_s",
        "throughput_gbps",
    ):
        assert a[k] == b[k], k


def test_sharding_needs_a_static_router():
    with pytest.raises(
        ScenarioError,
        match=r"cluster.shard = true: cannot shard the cluster: router "
        r"'least-outstanding' .* \(allowed: round-robin\)",
    ):
        load_scenario(
            P8D2,
            [
                "cluster.prefill_instances=2",
                'cluster.router="least-outstanding"',
                "cluster.shard=true",
            ],
        )
    with pytest.raises(ValueError, match="cannot shard the cluster"):
        simulate_sharded(
            load_scenario(P8D2, ["cluster.prefill_instances=2", 'cluster.router="staging-aware"'])
        )
