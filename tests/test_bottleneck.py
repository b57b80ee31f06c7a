"""The bottleneck verdict (kvstage/metrics/bottleneck.py) on cases whose answer is known: an
overloaded prefill, a decode KV capacity far below what the load keeps resident, a slow
link; the TTFT split; the sweep saying why a target is out of reach."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstage.explore.sweep import STATUS_OK
from kvstage.explore.sweep_target import parse_target, why_unmet
from kvstage.metrics.bottleneck import DECODE, KV, NIC, PREFILL, QUEUE, RING, ttft_parts
from kvstage.metrics.rooms import room_latencies
from kvstage.run.summary import simulation_summary
from kvstage.shared.scenario import load_scenario
from kvstage.shared.serving.capacity import (
    nic_counts,
    prefill_capacity,
    prefill_work,
    prompt_forward_s,
)
from kvstage.shared.serving.compute import prefill_forward_s
from kvstage.shared.serving.decode_model import GIB, DecodeModel
from kvstage.sim.driver import simulate

ROOT = Path(__file__).resolve().parents[1]
P8D2 = ROOT / "scenarios" / "llama3-70b-p8-d2.toml"


def verdict(*sets: str, requests: int = 8):
    s = load_scenario(
        P8D2,
        [
            'workload.prompt="fixed"',
            'workload.arrival="fixed"',
            f"workload.requests={requests}",
            "slo.ttft_s=2",
            *sets,
        ],
    )
    res = simulate(s)
    return s, simulation_summary(s, res)


def test_prefill_far_above_its_capacity_is_prefill_compute():
    """The capacity engineer's case: 4 req/s of 32k prompts into one TP8 prefill."""
    s, summary = verdict("workload.rate_per_s=4", "workload.prompt_tokens=32768")
    b = summary["bottleneck"]
    assert (b["stage"], b["reason"]) == (PREFILL, "overloaded")
    # the simulator's forwards of one 32k prompt: four 8k chunks, each after the ones before
    seconds = sum(prefill_forward_s(s, 8192, p) for p in range(0, 32768, 8192))
    capacity = 32768 / seconds
    assert b["stages"][PREFILL]["capacity_tokens_per_s"] == pytest.approx(capacity)
    assert b["stages"][PREFILL]["utilization"] == pytest.approx(4 * 32768 / capacity)
    assert b["offered"]["prompt_tokens_per_s"] == pytest.approx(4 * 32768)
    assert "prefill compute: 4.00 req/s x 32,768 prompt tokens" in b["explanation"]
    # the requests wait in the prefill's queue: that is where their TTFT goes
    assert b["stages"][QUEUE]["ttft_share"] > 0.5


def test_a_light_load_names_the_largest_share_of_ttft():
    s, summary = verdict("workload.rate_per_s=0.25", "workload.prompt_tokens=32768", requests=4)
    b = summary["bottleneck"]
    assert (b["stage"], b["reason"]) == (PREFILL, "largest share of TTFT")
    assert b["stages"][PREFILL]["utilization"] < 1
    assert b["stages"][PREFILL]["ttft_share"] > 0.9  # the forward is the TTFT
    seconds = sum(prefill_forward_s(s, 8192, p) for p in range(0, 32768, 8192))
    assert b["stages"][PREFILL]["forward_per_request_s"] == pytest.approx(seconds)


def test_prefill_capacity_is_the_simulators():
    """The capacity's forward time of each request is what the simulated run took to
    forward it (no queueing at this rate): mixed prompts, a decode prefix, one chunk
    not a whole number of pages."""
    s = load_scenario(
        P8D2,
        [
            'workload.prompt="uniform"',
            "workload.prompt_min=100",
            "workload.prompt_max=20000",
            'workload.arrival="fixed"',
            "workload.rate_per_s=0.05",
            "workload.requests=6",
            "decode.prefix_tokens=64",
            "prefill.chunked_prefill_size=8200",
        ],
    )
    res = simulate(s)
    rooms = room_latencies(res.records)
    for r in res.requests:
        took = rooms[r.room]["forward_end"] - rooms[r.room]["forward_start"]
        assert took == pytest.approx(prompt_forward_s(s, r.prompt_tokens, r.prefix_tokens))
    tokens, seconds = prefill_work(s, res.requests)
    assert prefill_capacity(s, res.requests) == pytest.approx(tokens / seconds)


def test_a_tiny_kv_capacity_is_decode_kv_capacity():
    m = DecodeModel(load_scenario(P8D2))
    gib = (
        m.weight_bytes + 10_000 * m.kv_bytes_per_token
    ) / GIB  # ~10k tokens: one room of 8192 + 256
    s, summary = verdict(
        "workload.rate_per_s=1",
        "workload.prompt_tokens=8192",
        "workload.output_tokens=256",
        f"decode.gpu_memory_gib={gib}",
        "decode.memory_utilization=1.0",
    )
    b = summary["bottleneck"]
    assert (b["stage"], b["reason"]) == (KV, "overloaded")
    kv = b["stages"][KV]
    assert kv["capacity_tokens"] == DecodeModel(s).capacity_tokens
    assert kv["utilization"] > b["stages"][PREFILL]["utilization"]
    assert summary["decode_admission_wait_s"]["max"] > 0  # requests did wait for pages


def test_a_slow_link_is_the_nic():
    s, summary = verdict(
        "workload.rate_per_s=1", "workload.prompt_tokens=4096", "links.inter_bandwidth_gbps=4"
    )
    b = summary["bottleneck"]
    assert (b["stage"], b["reason"]) == (NIC, "overloaded")
    nics = min(nic_counts(s))
    assert nic_counts(s) == (8, 2)  # TP8 on one node's eight rails; TP2 on two
    per_request = summary["payload_bytes"] / summary["requests_done"]
    assert b["stages"][NIC]["utilization"] == pytest.approx(1.0 * per_request / (nics * 4e9 / 8))


def test_ttft_parts_are_disjoint_and_sum_to_ttft():
    info = {
        "arrival": 0.0,
        "admitted": 3.0,
        "forward_start": 0.5,
        "forward_end": 2.0,
        "done": 3.5,
        "staging_wait": 0.2,
    }
    parts = ttft_parts(info)
    assert parts == pytest.approx({QUEUE: 0.5, PREFILL: 1.5, KV: 1.0, RING: 0.2, NIC: 0.3})
    assert sum(parts.values()) == pytest.approx(info["done"] - info["arrival"])
    assert ttft_parts({**info, "failed": 1.0}) is None


def test_a_tpot_target_the_weights_alone_miss_is_decode_compute():
    _, summary = verdict(
        "workload.rate_per_s=0.5",
        "workload.prompt_tokens=4096",
        "workload.output_tokens=8",
        "slo.tpot_s=0.001",
        requests=3,
    )
    b = summary["bottleneck"]
    assert b["stage"] == DECODE and b["stages"][DECODE]["infeasible"]


def test_sweep_says_why_a_transfer_target_is_out_of_reach():
    """No pool size gives transfer p99 < 1 s: the forward alone is 1.45 s of it, and
    the verdict at the best point says what limits the run."""
    why_b = "prefill compute: 4.00 req/s x 32,768 prompt tokens = 131,072 tokens/s offered vs 22,663 tokens/s"
    rows = [
        {
            "decode.staging_pool_mb": pool,
            "status": STATUS_OK,
            "requests_failed": 0,
            "requests_done": 32,
            "transfer_latency_s.p99": 1.45 + kv,
            "prefill_compute_s.p99": 1.45,
            "kv_transfer_latency_s.p99": kv,
            "bottleneck": PREFILL,
            "bottleneck_why": why_b,
        }
        for pool, kv in ((2048, 0.2), (4096, 0.03))
    ]
    why = why_unmet(rows, parse_target("transfer_latency_s.p99<1"), "decode.staging_pool_mb")
    assert "prefill_compute_s.p99 alone is 1.45 s there and misses the target at every point" in why
    assert (
        "kv_transfer_latency_s.p99 30 ms (the part the request waits for after its forward)" in why
    )
    assert f"what limits it there: {why_b}" in why
    # an SLO figure on points without [slo]: say how to get it
    bare = [{"decode.staging_pool_mb": 2048, "status": STATUS_OK, "requests_failed": 0}]
    assert "give [slo] targets" in why_unmet(
        bare, parse_target("slo_attainment>=0.9"), "decode.staging_pool_mb"
    )


# --- the staging ring's capacity figure -------------------------------------------------
MIB = 1 << 20


def _row(role: str, rank: int, phase: str, start: float, end: float, **kw):
    from kvstage.shared.trace import TraceRecord

    return TraceRecord(role, rank, phase, start, end, **kw)


def test_ring_hold_is_region_bytes_times_first_write_to_free_per_decode_rank():
    rows = [  # room 0, two chunks, two writers into each of two decode ranks
        _row("prefill", 0, "write", 1.0, 1.2, room=0, chunk=0, peer=0, bytes=50),
        _row("prefill", 1, "write", 1.1, 1.3, room=0, chunk=0, peer=0, bytes=50),
        _row("prefill", 0, "write", 1.0, 1.2, room=0, chunk=0, peer=1, bytes=50),
        _row("decode", 0, "free", 1.5, 1.5, room=0, chunk=0, bytes=100),  # 100 B x 0.5 s
        _row("decode", 1, "free", 1.7, 1.7, room=0, chunk=0, bytes=100),  # 100 B x 0.7 s
        _row("prefill", 0, "write", 2.0, 2.1, room=0, chunk=1, peer=0, bytes=60),
        _row("prefill", 0, "write", 2.0, 2.1, room=0, chunk=1, peer=1, bytes=60),
        _row("decode", 0, "free", 2.25, 2.25, room=0, chunk=1, bytes=60),  # 60 B x 0.25 s
        _row("decode", 1, "free", 2.25, 2.25, room=0, chunk=1, bytes=60),
        _row(
            "decode", 0, "free", 3.0, 3.0, room=1, chunk=0, bytes=100
        ),  # never written: held nothing
    ]
    info = room_latencies(rows)
    assert info[0]["ring_byte_s"] == pytest.approx(((50 + 15) + (70 + 15)) / 2)
    assert info[0]["ring_bytes"] == 160 and info[0]["ring_region_bytes"] == 100
    assert "ring_byte_s" not in info[1]


def _ring_case(byte_s: float, *sets: str):
    """Five requests a second apart (1 req/s) whose rooms each held `byte_s` of a ring
    of 4096 MiB in regions of 1280 MiB: three fit, 3840 MiB usable."""
    from kvstage.metrics.bottleneck import bottleneck
    from kvstage.shared.workload import Request

    s = load_scenario(P8D2, list(sets))
    requests = [Request(i, float(i), 8192, 0) for i in range(5)]
    rooms = {
        i: {"ring_byte_s": byte_s, "ring_bytes": 1280.0 * MIB, "ring_region_bytes": 1280.0 * MIB}
        for i in range(5)
    }
    return bottleneck(s, requests, rooms, {})


def test_ring_utilization_by_hand():
    usable = 3 * 1280 * MIB
    b = _ring_case(0.5 * usable)  # 1 req/s x half the usable bytes for 1 s each
    ring = b["stages"][RING]
    assert (ring["regions_that_fit"], ring["usable_bytes"], ring["pool_bytes"]) == (
        3,
        usable,
        4096 * MIB,
    )
    assert ring["utilization"] == pytest.approx(0.5)
    assert ring["hold_s"] == pytest.approx(0.5 * usable / (1280 * MIB))
    # two decode instances share the requests: each ring holds half as much
    two = _ring_case(0.5 * usable, "cluster.decode_instances=2")["stages"][RING]
    assert two["utilization"] == pytest.approx(0.25)
    # a pool a little short of four regions still holds three
    short = _ring_case(0.5 * usable, f"decode.staging_pool_mb={4 * 1280 - 1}")["stages"][RING]
    assert short["utilization"] == pytest.approx(0.5)
    over = _ring_case(1.5 * usable)
    assert (over["stage"], over["reason"]) == (RING, "overloaded")
    assert (
        over["explanation"].startswith("staging ring: 1.00 req/s x ")
        and "150% of capacity" in over["explanation"]
    )


def _fan_in(pool_mb: int, rate: float):
    """24 prefill instances (TP8) writing 8k-token rooms (one 1280 MiB region per decode
    rank) into one decode instance (TP2). (24, not 16 as before issue 22: the forward
    now pays attention FLOPs and TP all-reduces, and 16 instances' prefill compute
    would be the busiest stage at 40 req/s.)"""
    return verdict(
        "cluster.prefill_instances=24",
        f"workload.rate_per_s={rate}",
        "workload.prompt_tokens=8192",
        f"decode.staging_pool_mb={pool_mb}",
        # KV room for 16 prefills' worth of prompts: 80 GiB H100s at decode TP2 hold
        # 40k tokens a rank, and KV capacity would be the busiest stage
        "decode.gpu_memory_gib=141",
        requests=48,
    )


def test_a_ring_of_one_region_is_the_staging_ring():
    s, summary = _fan_in(1300, 40)  # one region at a time: ~30 ms each, 40 req/s
    b = summary["bottleneck"]
    assert (b["stage"], b["reason"]) == (RING, "overloaded")
    ring = b["stages"][RING]
    assert ring["regions_that_fit"] == 1 and ring["region_bytes"] == s.geometry().region_bytes(
        8192 // 16
    )
    assert ring["utilization"] > max(
        v.get("utilization") or 0 for k, v in b["stages"].items() if k != RING
    )
    assert summary["watermark_stall_s"]["total"] > 0  # chunks did wait for the ring
    # the same load with a roomy pool: the NIC limits (the ring holds three regions)
    _, roomy = _fan_in(4096, 40)
    assert roomy["bottleneck"]["stage"] == NIC
    _, light = _fan_in(4096, 30)
    assert light["bottleneck"]["stage"] != RING
    assert light["bottleneck"]["stages"][RING]["utilization"] < 0.5
    assert "staging ring" not in light["bottleneck"]["explanation"]
    _, tight = _fan_in(1300, 30)  # 90%: not overloaded, and named as the busiest stage
    assert "highest utilization: staging ring 9" in tight["bottleneck"]["explanation"]
