"""The bottleneck verdict (kvstage/bottleneck.py) on cases whose answer is known: an
overloaded prefill, a decode KV capacity far below what the load keeps resident, a slow
link; the TTFT split; the sweep saying why a target is out of reach."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstage.bottleneck import DECODE, KV, NIC, PREFILL, QUEUE, RING, nic_counts, ttft_parts
from kvstage.shared.decode_model import GIB, DecodeModel
from kvstage.shared.scenario import load_scenario
from kvstage.sim.driver import simulate
from kvstage.simrun import simulation_summary
from kvstage.sweep import STATUS_OK
from kvstage.sweep_target import parse_target, why_unmet

ROOT = Path(__file__).resolve().parents[1]
P8D2 = ROOT / "scenarios" / "llama3-70b-p8-d2.toml"


def verdict(*sets: str, requests: int = 8):
    s = load_scenario(P8D2, ['workload.prompt="fixed"', 'workload.arrival="fixed"', f"workload.requests={requests}",
                             "slo.ttft_s=2", *sets])
    res = simulate(s)
    return s, simulation_summary(s, res)


def test_prefill_far_above_its_capacity_is_prefill_compute():
    """The capacity engineer's case: 4 req/s of 32k prompts into one TP8 prefill."""
    s, summary = verdict("workload.rate_per_s=4", "workload.prompt_tokens=32768")
    b = summary["bottleneck"]
    assert (b["stage"], b["reason"]) == (PREFILL, "overloaded")
    capacity = 8192 / s.forward_time_s(8192)
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
    assert b["stages"][PREFILL]["forward_per_request_s"] == pytest.approx(s.forward_time_s(32768))


def test_a_tiny_kv_capacity_is_decode_kv_capacity():
    m = DecodeModel(load_scenario(P8D2))
    gib = (m.weight_bytes + 10_000 * m.kv_bytes_per_token) / GIB  # ~10k tokens: one room of 8192 + 256
    s, summary = verdict("workload.rate_per_s=1", "workload.prompt_tokens=8192", "workload.output_tokens=256",
                         f"decode.gpu_memory_gib={gib}", "decode.memory_utilization=1.0")
    b = summary["bottleneck"]
    assert (b["stage"], b["reason"]) == (KV, "overloaded")
    kv = b["stages"][KV]
    assert kv["capacity_tokens"] == DecodeModel(s).capacity_tokens
    assert kv["utilization"] > b["stages"][PREFILL]["utilization"]
    assert summary["decode_admission_wait_s"]["max"] > 0  # requests did wait for pages


def test_a_slow_link_is_the_nic():
    s, summary = verdict("workload.rate_per_s=1", "workload.prompt_tokens=4096", "links.inter_bandwidth_gbps=4")
    b = summary["bottleneck"]
    assert (b["stage"], b["reason"]) == (NIC, "overloaded")
    nics = min(nic_counts(s))
    assert nic_counts(s) == (8, 2)  # TP8 on one node's eight rails; TP2 on two
    per_request = summary["payload_bytes"] / summary["requests_done"]
    assert b["stages"][NIC]["utilization"] == pytest.approx(1.0 * per_request / (nics * 4e9 / 8))


def test_ttft_parts_are_disjoint_and_sum_to_ttft():
    info = {"arrival": 0.0, "admitted": 3.0, "forward_start": 0.5, "forward_end": 2.0, "done": 3.5,
            "staging_wait": 0.2}
    parts = ttft_parts(info)
    assert parts == pytest.approx({QUEUE: 0.5, PREFILL: 1.5, KV: 1.0, RING: 0.2, NIC: 0.3})
    assert sum(parts.values()) == pytest.approx(info["done"] - info["arrival"])
    assert ttft_parts({**info, "failed": 1.0}) is None


def test_a_tpot_target_the_weights_alone_miss_is_decode_compute():
    _, summary = verdict("workload.rate_per_s=0.5", "workload.prompt_tokens=4096", "workload.output_tokens=8",
                         "slo.tpot_s=0.001", requests=3)
    b = summary["bottleneck"]
    assert b["stage"] == DECODE and b["stages"][DECODE]["infeasible"]


def test_sweep_says_why_a_transfer_target_is_out_of_reach():
    """No pool size gives transfer p99 < 1 s: the forward alone is 1.45 s of it, and
    the verdict at the best point says what limits the run."""
    why_b = "prefill compute: 4.00 req/s x 32,768 prompt tokens = 131,072 tokens/s offered vs 22,663 tokens/s"
    rows = [{"decode.staging_pool_mb": pool, "status": STATUS_OK, "requests_failed": 0, "requests_done": 32,
             "transfer_latency_s.p99": 1.45 + kv, "prefill_compute_s.p99": 1.45, "kv_transfer_latency_s.p99": kv,
             "bottleneck": PREFILL, "bottleneck_why": why_b} for pool, kv in ((2048, 0.2), (4096, 0.03))]
    why = why_unmet(rows, parse_target("transfer_latency_s.p99<1"), "decode.staging_pool_mb")
    assert "prefill_compute_s.p99 alone is 1.45 s there and misses the target at every point" in why
    assert "kv_transfer_latency_s.p99 30 ms (the part the request waits for after its forward)" in why
    assert f"what limits it there: {why_b}" in why
    # an SLO figure on points without [slo]: say how to get it
    bare = [{"decode.staging_pool_mb": 2048, "status": STATUS_OK, "requests_failed": 0}]
    assert "give [slo] targets" in why_unmet(bare, parse_target("slo_attainment>=0.9"), "decode.staging_pool_mb")
