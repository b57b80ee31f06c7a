"""compare_runs: error metrics of run B against run A, from real simulated traces."""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from kvstage.analysis.compare import (
    chunk_latencies,
    compare_runs,
    error_metrics,
    phase_breakdown,
    to_json,
)
from kvstage.cli.main import app
from kvstage.run.rundir import RunError, load_run
from kvstage.run.simrun import run_simulation
from kvstage.run.tracefile import read_records, write_trace
from kvstage.shared.scenario import load_scenario

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "scenarios" / "llama3-8b-p4-d2.toml"
# small and quick, with a pool tight enough that some chunks wait for the watermark:
# one chunk of pool, and a prefill fast enough (200k tokens/s over TP4: 2 x 8.03e9 x
# 2e5 / 4 = 0.8 PFLOP/s per GPU, 81% of the H100's dense bf16 peak) that chunks arrive
# faster than the decode frees them; at the default MFU prefill is the bottleneck and
# the ring never waits
SETS = [
    "workload.requests=16",
    "workload.rate_per_s=40",
    "decode.staging_pool_mb=512",
    "prefill.tokens_per_s=200000",
]


def simulate(out: Path, extra: list[str] | None = None) -> Path:
    scenario = load_scenario(SCENARIO, overrides=SETS + list(extra or []))
    code = run_simulation(scenario, out=out, progress=False, console=Console(file=io.StringIO()))
    assert code == 0
    return out


def rewrite(
    src: Path, dst: Path, *, scale: float = 1.0, drop_room: int | None = None, fmt: str = "parquet"
) -> Path:
    """A copy of run `src` whose times are all multiplied by `scale` (relative to t=0),
    optionally without one room's rows."""
    mode, records = read_records(src)
    dst.mkdir(parents=True)
    kept = []
    for r in records:
        if drop_room is not None and r.room == drop_room:
            continue
        r.start *= scale
        r.end *= scale
        kept.append(r)
    write_trace(dst / f"trace.{fmt}", kept, mode)
    for name in ("summary.json", "scenario.toml"):
        shutil.copy(src / name, dst / name)
    return dst


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("compare")
    staging = simulate(base / "staging")
    return {
        "staging": staging,
        "slice": simulate(base / "slice", ["transfer.path=slice"]),
        "scaled": rewrite(staging, base / "scaled", scale=1.2),
        "dropped": rewrite(staging, base / "dropped", drop_room=3),
        "jsonl": rewrite(staging, base / "jsonl", fmt="jsonl"),
    }


def test_run_with_itself_has_zero_error(runs):
    res = compare_runs(runs["staging"], runs["staging"])
    for key in ("transfer_latency", "ttft", "chunk_latency"):
        assert res[key]["count"] > 0
        assert res[key]["mape"] == 0.0
        assert res[key]["bias"] == 0.0
        assert res[key]["p99"]["diff_s"] == 0.0
    assert res["rooms"]["matched"] == 16
    assert res["rooms"]["only_in_a"] == res["rooms"]["only_in_b"] == 0
    assert res["verdict"].startswith("B within 15% MAPE of A")
    assert res["scenario_diff"] == []


def test_times_scaled_by_1_2_give_20_percent_error(runs):
    res = compare_runs(runs["staging"], runs["scaled"])
    for key in ("transfer_latency", "ttft", "chunk_latency"):
        m = res[key]
        assert m["count"] > 0
        assert m["mape"] == pytest.approx(0.2, abs=1e-6)
        assert m["bias"] == pytest.approx(0.2, abs=1e-6)
        assert m["max_abs_rel_error"] == pytest.approx(0.2, abs=1e-6)
        for q in ("p50", "p99"):
            assert m[q]["rel"] == pytest.approx(0.2, abs=1e-6)
            assert m[q]["diff_s"] == pytest.approx(0.2 * m[q]["a"], rel=1e-6)
    for key, p in res["phases"].items():
        assert p["b"]["count"] == p["a"]["count"], key
        assert p["b"]["total_s"] == pytest.approx(1.2 * p["a"]["total_s"], rel=1e-6, abs=1e-12), key
    assert res["verdict"].startswith("B is 20% slower than A (bias")
    # and the other way round: A is 1/1.2 of B
    back = compare_runs(runs["scaled"], runs["staging"])
    assert back["transfer_latency"]["bias"] == pytest.approx(1 / 1.2 - 1, abs=1e-6)
    assert "faster" in back["verdict"]


def test_rooms_present_in_one_run_only_are_counted(runs):
    res = compare_runs(runs["staging"], runs["dropped"])
    r = res["rooms"]
    assert r["only_in_a"] == 1 and r["only_in_a_rooms"] == [3]
    assert r["only_in_b"] == 0
    assert r["matched"] == 15
    assert res["transfer_latency"]["count"] == 15
    assert res["chunk_latency"]["only_in_a"] > 0
    assert "rooms only in A: 1" in res["verdict"]
    rev = compare_runs(runs["dropped"], runs["staging"])
    assert rev["rooms"]["only_in_b"] == 1 and rev["rooms"]["only_in_b_rooms"] == [3]


def test_jsonl_and_parquet_traces_compare_equal(runs):
    res = compare_runs(runs["staging"], runs["jsonl"])
    assert res["transfer_latency"]["mape"] == 0.0
    assert res["chunk_latency"]["mape"] == 0.0


def test_staging_against_slice(runs):
    res = compare_runs(runs["staging"], runs["slice"])
    assert res["a"]["transfer_path"] == "staging" and res["b"]["transfer_path"] == "slice"
    # the slice path: no gather / bulk write / scatter, but many small writes
    assert res["phases"]["slice_write"]["b"]["count"] > 0
    assert res["phases"]["write"]["b"]["count"] == 0
    assert res["phases"]["gather"]["a"]["count"] > 0
    # both land every chunk, so chunk latency is matched chunk by chunk
    assert res["chunk_latency"]["count"] == res["a"]["chunks"] == res["b"]["chunks"]
    assert res["transfer_latency"]["bias"] > 0  # the baseline is slower here
    assert res["scenario_diff"] == [{"field": "transfer.path", "a": "staging", "b": "slice"}]
    assert "scenario fields differ: transfer.path staging vs slice" in res["verdict"]
    doc = json.loads(to_json(res))  # JSON without NaN / inf
    assert doc["verdict"] == res["verdict"]


def test_chunk_latency_and_phases_are_sane(runs):
    run = load_run(runs["staging"])
    chunks = chunk_latencies(run.records)
    scattered = {
        (r.room, r.chunk, r.rank)
        for r in run.records
        if r.role == "decode" and r.phase == "scatter"
    }
    assert set(chunks) == scattered
    assert all(v > 0 for v in chunks.values())
    ph = phase_breakdown(run.records)
    assert ph["gather"]["count"] == sum(1 for r in run.records if r.phase == "gather")
    assert ph["control_req_rsp"]["count"] > 0 and ph["control_req_rsp"]["mean_s"] > 0
    assert ph["control_chunk_ready"]["count"] == len(scattered)
    assert ph["wm_wait"]["count"] > 0  # the pool is tight on purpose


def test_error_metrics_by_hand():
    m = error_metrics([(1.0, 1.1), (2.0, 1.8), (4.0, 4.0)])
    assert m["mape"] == pytest.approx((0.1 + 0.1 + 0.0) / 3)
    assert m["bias"] == pytest.approx((0.1 - 0.1 + 0.0) / 3, abs=1e-12)
    assert m["p50"]["a"] == 2.0 and m["p50"]["b"] == pytest.approx(1.8)
    assert m["p50"]["rel"] == pytest.approx(-0.1)
    empty = error_metrics([])
    assert empty["count"] == 0 and math.isnan(empty["mape"])


def test_not_a_run_directory(tmp_path):
    with pytest.raises(RunError, match="not a run directory"):
        load_run(tmp_path)
    with pytest.raises(RunError, match="no such run directory"):
        load_run(tmp_path / "missing")
    (tmp_path / "trace.parquet").write_text("not parquet")
    with pytest.raises(RunError, match="cannot read the trace"):
        load_run(tmp_path)


def test_cli_compare(runs, tmp_path):
    out = tmp_path / "cmp.json"
    figs = tmp_path / "figs"
    result = CliRunner().invoke(
        app,
        [
            "compare",
            str(runs["staging"]),
            str(runs["slice"]),
            "--json",
            str(out),
            "--plots",
            str(figs),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "verdict:" in result.output
    doc = json.loads(out.read_text())
    assert doc["rooms"]["matched"] == 16
    names = sorted(p.name for p in figs.iterdir())
    assert names == ["compare_scatter.png", "latency_cdf.png", "phases.png", "staging_vs_slice.png"]
    assert all((figs / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for n in names)
    # unmatched rooms reach the printed verdict (brackets are text, not console markup)
    result = CliRunner().invoke(
        app, ["compare", str(runs["staging"]), str(runs["dropped"])], env={"COLUMNS": "250"}
    )
    assert result.exit_code == 0, result.output
    assert "[rooms only in A: 1, only in B: 0]" in result.output


def test_cli_compare_bad_input_exits_2_without_traceback(runs, tmp_path):
    kvstage = Path(sys.executable).with_name("kvstage")
    cmd = [str(kvstage)] if kvstage.exists() else [sys.executable, "-m", "kvstage.cli"]
    proc = subprocess.run(
        cmd + ["compare", str(runs["staging"]), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert proc.returncode == 2
    assert "is not a run directory" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert len(proc.stderr.strip().splitlines()) == 1


def as_hw(src: Path, dst: Path, *, conditions: dict | None = None) -> Path:
    """A copy of run `src` that says it was a hardware run, with another link model in its
    scenario (a hardware run does not use it) and the given host conditions."""
    mode, records = read_records(src)
    dst.mkdir(parents=True)
    write_trace(dst / "trace.parquet", records, "hw")
    summary = json.loads((src / "summary.json").read_text())
    summary.update(mode="hw", backend="nixl", device="cpu")
    if conditions is not None:
        summary["conditions"] = conditions
    (dst / "summary.json").write_text(json.dumps(summary))
    text = (src / "scenario.toml").read_text()
    text = text.replace('profile = "rdma-400g"', 'profile = "loopback-nixl"')
    text = text.replace("inter_bandwidth_gbps = 370.0", "inter_bandwidth_gbps = 18.8")
    text = text.replace("control_latency_us = 30.0", "control_latency_us = 150.0")
    assert text.count("loopback-nixl") == 1 and "18.8" in text
    (dst / "scenario.toml").write_text(text)
    return dst


LOADED = {
    "cores": 2,
    "loadavg_before": [2.5, 2.0, 1.0],
    "loadavg_after": [3.1, 2.2, 1.1],
    "wall_s": 10.0,
    "cpu_busy_s": 19.0,
    "cpu_own_s": 9.0,
    "cpu_other_s": 10.0,
    "other_cpu_share": 0.5,
    "loaded": True,
}
QUIET = {**LOADED, "cpu_busy_s": 9.4, "cpu_other_s": 0.4, "other_cpu_share": 0.02, "loaded": False}


def test_hw_vs_sim_lists_only_fields_that_matter(runs, tmp_path):
    """Link-model fields differ between a hardware run and a simulation, but the hardware
    run never used them: one line says so instead of a row per field."""
    hw = as_hw(runs["staging"], tmp_path / "hw", conditions=QUIET)
    res = compare_runs(hw, runs["slice"])
    assert res["a"]["mode"] == "hw"
    assert res["scenario_diff"] == [{"field": "transfer.path", "a": "staging", "b": "slice"}]
    assert res["scenario_diff_note"].startswith("3 links.* field(s) differ but are not compared")
    assert "hardware run (A)" in res["scenario_diff_note"]
    assert res["warnings"] == []
    # two simulations: the same link fields do matter
    sim_other = rewrite(runs["staging"], tmp_path / "sim", scale=1.0)
    (sim_other / "scenario.toml").write_text((hw / "scenario.toml").read_text())
    res = compare_runs(sim_other, runs["staging"])
    assert {d["field"] for d in res["scenario_diff"]} == {
        "links.profile",
        "links.inter_bandwidth_gbps",
        "links.control_latency_us",
    }
    assert res["scenario_diff_note"] == ""


@pytest.mark.slow
def test_loaded_host_is_warned_of(runs, tmp_path):
    hw = as_hw(runs["staging"], tmp_path / "hw", conditions=LOADED)
    res = compare_runs(runs["staging"], hw)
    assert len(res["warnings"]) == 1
    assert res["warnings"][0].startswith(
        "B was taken on a loaded host: other processes took 50% of the 2 cores"
    )
    assert res["conditions"]["b"]["other_cpu_share"] == 0.5
    out = CliRunner().invoke(app, ["compare", str(runs["staging"]), str(hw)])
    assert out.exit_code == 0, out.output
    assert "warning: B was taken on a loaded host" in " ".join(out.output.split())
    # a quiet hardware run, or a simulation on a loaded host (simulated time does not depend on it): no warning
    quiet = as_hw(runs["staging"], tmp_path / "quiet", conditions=QUIET)
    assert compare_runs(runs["staging"], quiet)["warnings"] == []
    sim = rewrite(runs["staging"], tmp_path / "sim")
    summary = json.loads((sim / "summary.json").read_text())
    (sim / "summary.json").write_text(json.dumps({**summary, "conditions": LOADED}))
    assert compare_runs(sim, quiet)["warnings"] == []
    # the report says it too, at the top and in the run's section
    from kvstage.analysis.report import build_report

    text = build_report([runs["staging"], hw], tmp_path / "r.html").read_text()
    assert text.count("was taken on a loaded host") == 3  # header, run section, comparison
