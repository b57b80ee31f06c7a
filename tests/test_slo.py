"""[slo] targets -> slo_attainment, goodput_rps and goodput per GPU in summary.json,
checked by hand against the per-request spans of a small simulated run; the keys are
absent without targets; the console table and the sweep carry them."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from kvstage.explore.sweep import METRICS, run_point
from kvstage.explore.sweep_target import parse_target
from kvstage.metrics.rooms import room_latencies
from kvstage.run.summary import simulation_summary
from kvstage.run.summary_table import print_summary
from kvstage.shared.scenario import ScenarioError, load_scenario
from kvstage.sim.driver import simulate

ROOT = Path(__file__).resolve().parents[1]
P8D2 = ROOT / "scenarios" / "llama3-70b-p8-d2.toml"
ABORT = ROOT / "scenarios" / "faults" / "abort-mid-write.toml"
# six 4k prompts arriving faster than one TP8 prefill serves them: TTFT grows request by request
BASE = [
    'workload.prompt="fixed"',
    "workload.prompt_tokens=4096",
    "workload.requests=6",
    'workload.arrival="fixed"',
    "workload.rate_per_s=8",
    "workload.output_tokens=16",
    "decode.gpu_memory_gib=141",
]


def run(path: Path, sets: list[str]):
    s = load_scenario(path, sets)
    res = simulate(s)
    return s, res, simulation_summary(s, res)


def test_attainment_and_goodput_by_hand():
    _, res, _ = run(P8D2, BASE)
    rooms = room_latencies(res.records)
    # the client's figures, by hand from the trace rows: the first token when the room
    # joins the decode's batch, TPOT over the 15 tokens after it
    ttft = {k: i["generate_start"] - i["arrival"] for k, i in rooms.items()}
    tpot = {k: (i["generate_end"] - i["generate_start"]) / 15 for k, i in rooms.items()}
    target = sorted(ttft.values())[2] + 1e-9  # the first three meet it
    s, res, summary = run(
        P8D2, [*BASE, f"slo.ttft_s={target}", f"slo.tpot_s={max(tpot.values()) + 1e-9}"]
    )
    met = [k for k in rooms if ttft[k] <= target]
    assert len(met) == 3
    span = max(i["generate_end"] for i in rooms.values()) - min(
        i["arrival"] for i in rooms.values()
    )
    assert summary["slo"] == {"ttft_s": target, "tpot_s": pytest.approx(max(tpot.values()) + 1e-9)}
    assert summary["slo_met"] == 3
    assert summary["slo_attainment"] == pytest.approx(3 / 6)
    assert summary["serving_span_s"] == pytest.approx(span)
    assert summary["goodput_rps"] == pytest.approx(3 / span)
    gpus = 8 + 2  # one prefill instance of TP8, one decode instance of TP2
    assert summary["goodput_per_gpu_rps"] == pytest.approx(3 / span / gpus)
    assert summary["offered_load_rps"] == pytest.approx(8.0)  # fixed arrivals 1/8 s apart
    # a TPOT target below every request's TPOT: nobody meets the SLO
    _, _, tight = run(P8D2, [*BASE, f"slo.ttft_s={target}", f"slo.tpot_s={min(tpot.values()) / 2}"])
    assert tight["slo_attainment"] == 0.0 and tight["goodput_rps"] == 0.0


def test_failed_requests_count_as_missed():
    _, res, summary = run(ABORT, ["slo.ttft_s=1000"])
    assert summary["requests_failed"] == 1
    assert summary["slo_met"] == summary["requests"] - 1
    assert summary["slo_attainment"] == pytest.approx(
        (summary["requests"] - 1) / summary["requests"]
    )


def test_a_target_without_its_figure_is_named_and_missed():
    _, _, summary = run(
        P8D2, ["workload.requests=3", "slo.tpot_s=0.05"]
    )  # no output tokens: no TPOT
    assert summary["slo_unmeasured"] == ["tpot_s"]
    assert summary["slo_attainment"] == 0.0
    console = Console(record=True, width=200)
    print_summary(summary, console)
    assert "no figure of tpot_s: counted as missed" in console.export_text()


def test_without_targets_or_decode_side_no_key_is_added():
    _, _, summary = run(P8D2, ["workload.requests=3"])
    for key in (
        "slo",
        "slo_attainment",
        "goodput_rps",
        "goodput_per_gpu_rps",
        "offered_load_rps",
        "bottleneck",
    ):
        assert key not in summary


def test_slo_table_is_validated_and_round_trips(tmp_path):
    with pytest.raises(ScenarioError, match="slo.ttft_s"):
        load_scenario(P8D2, ["slo.ttft_s=0"])
    with pytest.raises(ScenarioError, match="slo.ttfb_s"):
        load_scenario(P8D2, ["slo.ttfb_s=1"])
    s = load_scenario(P8D2, ["slo.ttft_s=2", "slo.e2e_s=30"])
    assert s.slo.targets() == {"ttft_s": 2.0, "e2e_s": 30.0}
    (tmp_path / "s.toml").write_text(s.to_toml())
    assert load_scenario(tmp_path / "s.toml").slo == s.slo
    assert load_scenario(P8D2).slo.targets() == {}


def test_console_table_shows_attainment_goodput_and_bottleneck():
    _, _, summary = run(P8D2, [*BASE, "slo.ttft_s=1"])
    console = Console(record=True, width=240)
    print_summary(summary, console)
    text = console.export_text()
    assert "SLO attainment (ttft_s <= 1,000.00 ms)" in text
    assert "goodput (met SLO / serving span)" in text and "per GPU" in text
    assert f"bottleneck ({summary['bottleneck']['reason']})" in text


def test_sweep_rows_carry_slo_figures_and_the_verdict():
    for name in (
        "ttft_s.p99",
        "tpot_s.p90",
        "e2e_s.p50",
        "kv_transfer_latency_s.p99",
        "slo_attainment",
        "goodput_rps",
        "goodput_per_gpu_rps",
        "offered_load_rps",
        "decode_admission_wait_s.max",
    ):
        assert name in METRICS
        assert parse_target(f"{name}>0").metric == name
    row = run_point(load_scenario(P8D2, [*BASE, "slo.ttft_s=1"]))
    assert row["status"] == "ok" and 0 <= row["slo_attainment"] <= 1 and row["goodput_rps"] >= 0
    assert row["tpot_s.p50"] > 0 and row["bottleneck"] and row["bottleneck_why"]
    plain = run_point(
        load_scenario(P8D2, ["workload.requests=3"])
    )  # no [slo]: a verdict all the same
    assert plain["slo_attainment"] is None and plain["bottleneck"]
