"""The per-request breakdown of summary.json (kvstage/metrics/rooms.py): queueing, prefill
compute, exposed KV transfer and staging wait, checked against a hand-made trace, a
small simulation's own rows and the forward-time model; and why a sweep target that
none meets is out of reach (kvstage/explore/sweep_target.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from rich.console import Console

from kvstage.explore.sweep import METRICS, STATUS_OK
from kvstage.explore.sweep_target import parse_target, why_unmet
from kvstage.metrics.rooms import percentiles, room_latencies, summarize
from kvstage.run.summary_table import print_summary
from kvstage.shared.scenario import load_scenario
from kvstage.shared.serving.compute import prefill_forward_s
from kvstage.shared.trace import TraceRecord
from kvstage.sim.driver import simulate

SCENARIO = Path(__file__).resolve().parents[1] / "scenarios" / "llama3-8b-p4-d2.toml"


def _rec(role, rank, phase, start, end=None, room=0, chunk=-1):
    return TraceRecord(
        role, rank, phase, start, start if end is None else end, room=room, chunk=chunk
    )


def _hand_trace() -> list[TraceRecord]:
    """One room, 2 prefill ranks, 2 decode ranks: arrives at 1.0, forwards 1.5..2.5
    (chunk 0 1.5..2.0, chunk 1 2.0..2.5), waits for the watermark 1.9..2.1 and
    2.0..2.2 (overlapping: 0.3 s in all), decode ready at 2.75 (the later rank)."""
    rows = [_rec("decode", d, "room_open", 1.0) for d in (0, 1)]
    for p in (0, 1):
        rows.append(_rec("prefill", p, "room_open", 1.5))
        rows.append(_rec("prefill", p, "compute", 1.5, 2.0, chunk=0))
        rows.append(_rec("prefill", p, "compute", 2.0, 2.5 - 0.01 * (1 - p), chunk=1))
    rows.append(_rec("prefill", 0, "wm_wait", 1.9, 2.1, chunk=0))
    rows.append(_rec("prefill", 1, "wm_wait", 2.0, 2.2, chunk=0))
    rows.append(_rec("decode", 0, "room_done", 2.7))
    rows.append(_rec("decode", 1, "room_done", 2.75))
    return rows


def test_breakdown_of_a_hand_made_trace():
    info = room_latencies(_hand_trace())[0]
    assert info["arrival"] == 1.0 and info["forward_start"] == 1.5
    assert info["forward_end"] == 2.5 and info["done"] == 2.75
    assert info["staging_wait"] == pytest.approx(0.3)
    s = summarize(_hand_trace(), mode="sim", pool_bytes=1, requests=1)
    assert s["requests_done"] == 1
    expect = {
        "queueing_s": 0.5,
        "prefill_compute_s": 1.0,
        "kv_transfer_latency_s": 0.25,
        "staging_wait_s": 0.3,
        "transfer_latency_s": 1.25,
        "ttft_s": 1.75,
    }
    for key, value in expect.items():
        assert s[key]["p99"] == pytest.approx(value), key
        assert s[key]["count"] == 1


def test_a_failed_or_unfinished_room_has_no_breakdown():
    rows = _hand_trace()[:-1]  # decode rank 1 never finished it
    s = summarize(rows, mode="sim", pool_bytes=1, requests=1)
    assert s["requests_done"] == 0
    assert s["kv_transfer_latency_s"]["count"] == 0 and math.isnan(s["prefill_compute_s"]["p99"])


@pytest.fixture(scope="module")
def small_run():
    # 4 requests of 16k tokens (2 chunks of 8k), 1 s apart: no request waits for another.
    s = load_scenario(
        SCENARIO,
        overrides=[
            "workload.requests=4",
            "workload.arrival=fixed",
            "workload.rate_per_s=1",
            "workload.prompt=fixed",
            "workload.prompt_tokens=16384",
        ],
    )
    return s, simulate(s)


def test_simulated_breakdown_matches_its_trace_and_the_forward_model(small_run):
    s, result = small_run
    summary = summarize(result.records, mode="sim", pool_bytes=s.pool_bytes, requests=4)
    assert summary["requests_done"] == 4
    # two chunks of 8,192 tokens, one after the other; the second attends to the
    # first's 8,192 tokens of context too (shared/serving/compute.py)
    forward = prefill_forward_s(s, 8192) + prefill_forward_s(s, 8192, context=8192)
    kv, compute = [], []
    for req in result.requests:
        rows = [r for r in result.records if r.room == req.room]
        computes = [r for r in rows if r.role == "prefill" and r.phase == "compute"]
        first = min(r.start for r in computes)
        last = max(r.end for r in computes)
        ready = max(r.end for r in rows if r.role == "decode" and r.phase == "room_done")
        opened = min(r.start for r in rows if r.role == "decode" and r.phase == "room_open")
        assert opened == pytest.approx(req.arrival_s)  # the decode opens the room on arrival
        assert first == pytest.approx(req.arrival_s)  # idle prefill: no queueing
        assert last - first == pytest.approx(forward)
        assert 0 < ready - last < forward
        kv.append(ready - last)
        compute.append(last - first)
    assert summary["kv_transfer_latency_s"] == pytest.approx(percentiles(kv))
    assert summary["prefill_compute_s"] == pytest.approx(percentiles(compute))
    assert summary["queueing_s"]["max"] == pytest.approx(0.0, abs=1e-9)
    # transfer_latency_s starts at the first forward, so it is compute + exposed transfer
    total = summary["transfer_latency_s"]["mean"]
    assert total == pytest.approx(
        summary["prefill_compute_s"]["mean"] + summary["kv_transfer_latency_s"]["mean"]
    )


def test_summary_table_shows_the_breakdown(small_run):
    s, result = small_run
    summary = summarize(result.records, mode="sim", pool_bytes=s.pool_bytes, requests=4)
    console = Console(record=True, width=200)
    print_summary(summary, console)
    text = console.export_text()
    for label in ("queueing", "prefill compute", "exposed KV transfer", "staging wait"):
        assert label in text
    del summary["kv_transfer_latency_s"]  # an older summary.json still prints
    print_summary(summary, Console(record=True, width=200))


def _row(pool, compute, kv, failed=0):
    return {
        "decode.staging_pool_mb": pool,
        "status": STATUS_OK,
        "requests_failed": failed,
        "requests_done": 64 - failed,
        "transfer_latency_s.p99": compute + kv,
        "prefill_compute_s.p99": compute,
        "kv_transfer_latency_s.p99": kv,
    }


def test_sweep_metrics_name_the_breakdown():
    for name in (
        "kv_transfer_latency_s.p99",
        "prefill_compute_s.p50",
        "queueing_s.max",
        "staging_wait_s.p90",
    ):
        assert name in METRICS
        assert parse_target(f"{name}<1").metric == name


def test_why_a_transfer_target_is_out_of_reach():
    rows = [_row(1280, 1.45, 0.2), _row(2560, 1.45, 0.03), _row(5120, 1.45, 0.05)]
    why = why_unmet(rows, parse_target("transfer_latency_s.p99<1"), "decode.staging_pool_mb")
    assert "transfer_latency_s.p99 is at best 1.48 s (decode.staging_pool_mb=2560)" in why
    assert "includes the prefill forward: prefill_compute_s.p99 alone is 1.45 s" in why
    assert "kv_transfer_latency_s.p99 30 ms" in why
    # the KV part is what misses: no claim about the forward
    rows = [_row(1280, 0.2, 1.5), _row(2560, 0.2, 1.2)]
    why = why_unmet(rows, parse_target("transfer_latency_s.p99<1"), "decode.staging_pool_mb")
    assert "includes" not in why and "kv_transfer_latency_s.p99 1.2 s" in why


def test_why_counts_failed_requests_and_points_that_did_not_run():
    rows = [_row(1280, 0.2, 0.1, failed=17), _row(2560, 0.2, 2.0)]
    why = why_unmet(rows, parse_target("transfer_latency_s.p99<1"), "decode.staging_pool_mb")
    assert "1 point(s) meet it only over the requests that survived" in why
    assert "17 failed, 47 done" in why
    bad = [{"decode.staging_pool_mb": 256, "status": "invalid"}]
    assert (
        why_unmet(bad, parse_target("transfer_latency_s.p99<1"), "decode.staging_pool_mb")
        == "no point ran (invalid)"
    )
