"""Folding symmetric ranks (`[cluster] fold`, sim/fold.py): the same latencies as the
unfolded run, a fraction of the events, and a clear refusal where ranks differ."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstage.metrics.rooms import room_latencies
from kvstage.shared.scenario import ScenarioError, load_scenario
from kvstage.sim.driver import simulate

ROOT = Path(__file__).resolve().parents[1]
S = ROOT / "scenarios"

CASES = {
    # fan-in P8 -> D2, two decode instances sharing the prefill instances' traffic,
    # generation and KV capacity modeled
    "p8-d2-cluster": (
        S / "llama3-70b-p8-d2.toml",
        [
            "workload.requests=60",
            "cluster.prefill_instances=2",
            "cluster.decode_instances=2",
            "workload.output_tokens=32",
            "decode.gpu_memory_gib=141",
        ],
    ),
    # fan-out P2 -> D8 (the representative writes to four decode ranks)
    "p2-d8": (S / "llama3-8b-p2-d8.toml", ["workload.requests=40", "cluster.prefill_instances=2"]),
    # a pool of about one chunk and every GPU of a node on one NIC: the watermark and the
    # shared NICs make ranks wait for each other's traffic
    "tight-ring-one-nic": (
        S / "llama3-70b-p8-d2.toml",
        [
            "workload.requests=30",
            "decode.staging_pool_mb=1300",
            "cluster.prefill_instances=3",
            "cluster.nics_per_node=1",
            "workload.rate_per_s=5",
            'workload.prompt="fixed"',
            "workload.prompt_tokens=32768",
            "workload.max_prompt_tokens=32768",
        ],
    ),
    "slice": (
        S / "llama3-8b-p4-d2.toml",
        ["workload.requests=30", 'transfer.path="slice"', "cluster.prefill_instances=2"],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_folded_runs_give_every_room_the_same_latencies(case):
    path, sets = CASES[case]
    full = simulate(load_scenario(path, [*sets, "cluster.fold=false"]))
    folded = simulate(load_scenario(path, [*sets, "cluster.fold=true"]))
    assert full.rooms_done == folded.rooms_done == len(full.requests)
    assert not full.violations and not folded.violations
    a, b = room_latencies(full.records), room_latencies(folded.records)
    assert a.keys() == b.keys()
    for room, info in a.items():
        other = dict(b[room])
        # every gap between tokens, a list: compared element by element
        assert info.get("itls", []) == pytest.approx(other.pop("itls", []), abs=1e-9), room
        assert {k: v for k, v in info.items() if k != "itls"} == pytest.approx(other, abs=1e-9)
    assert folded.events < full.events
    # the simulated ranks wrote the same rows as in the full run; messages of one instant
    # may be handled in another order, so the ring occupancy a row snapshots may differ
    kept = {(r.role, r.rank) for r in folded.records}

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

    assert sorted(map(key, (r for r in full.records if (r.role, r.rank) in kept))) == sorted(
        map(key, folded.records)
    )


def test_folding_needs_ranks_that_are_alike():
    with pytest.raises(ScenarioError, match=r"cluster.fold = true: cannot fold ranks: \[faults\]"):
        load_scenario(S / "faults" / "kill-prefill.toml", ["cluster.fold=true"])
    with pytest.raises(ScenarioError, match="cpu-loop host model"):
        load_scenario(
            S / "llama3-8b-p4-d2.toml",
            [
                "cluster.fold=true",
                'links.host_model="cpu-loop"',
                "links.host_cores=2",
                "links.engine_thread_cores=0.5",
                "links.event_us=40",
                "links.fill_latency_us=200",
                "links.fill_bandwidth_gbs=2",
            ],
        )
