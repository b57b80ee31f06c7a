"""The simulator end to end: request counts by hand, determinism, liveness, every
scenario of the catalogue, the `kvstage sim` / `kvstage check` commands, and the
invariant checker catching a broken readiness rule."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

import kvstage.shared.prefill
from kvstage.cli.main import app
from kvstage.metrics.rooms import summarize
from kvstage.run.rundir import write_run
from kvstage.run.tracefile import read_records, write_trace
from kvstage.shared.invariants import check_records
from kvstage.shared.scenario import Scenario, load_scenario
from kvstage.shared.workload import generate_requests
from kvstage.sim.driver import SimResult, simulate

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ROOT / "scenarios"
FLAGSHIP = SCENARIOS / "llama3-70b-p8-d2.toml"
# The catalogue: scenarios/*.toml. Not profiles/ (link numbers, not scenarios), and
# not faults/: their [faults] are injected by the hardware driver only so far, and
# their [expect] tables describe outcomes the simulation does not reproduce yet.
CATALOGUE = sorted(SCENARIOS.glob("*.toml"))


def load(path: Path, *sets: str) -> Scenario:
    return load_scenario(path, overrides=list(sets))


def summary_of(result: SimResult) -> dict:
    s = result.scenario
    return summarize(
        result.records, mode="sim", pool_bytes=s.pool_bytes, requests=len(result.requests)
    )


def assert_clean(result: SimResult, requests: int) -> None:
    """Every room done at every rank, nothing failed, no invariant broken."""
    assert not result.violations, "\n".join(v.format() for v in result.violations[:5])
    assert result.rooms_done == requests and result.rooms_failed == 0, result.failures
    assert not result.failures


# --- the slice path's transfer requests, counted by hand --------------------------------


def test_slice_requests_partial_rows_one_per_token():
    """Llama-3-8B, prefill TP4 -> decode TP2: a prefill rank holds 8/4 = 2 KV heads, a
    decode rank 8/2 = 4. A writer's 2 heads are half a row on the decode side, so every
    (token, layer, K/V) is its own strided piece: one request per token."""
    s = load(
        SCENARIOS / "llama3-8b-p4-d2.toml",
        "workload.requests=3",
        "workload.prompt=fixed",
        "workload.prompt_tokens=1000",
        "workload.prompt_min=1000",
        "prefill.chunked_prefill_size=256",  # 16-page chunks: 16 + 16 + 16 + 15 pages
        "transfer.path=slice",
    )
    g = s.geometry()
    assert (g.layers, g.page_size, g.prefill_heads, g.decode_heads) == (32, 16, 2, 4)
    pages = -(-1000 // 16)  # 63 pages; the last one is partly filled but moves whole
    tokens = pages * 16  # 1008 token rows
    per_writer = tokens * 32 * 2  # token rows x layers x (K, V) = 64,512 requests
    writers = 2 * 2  # 2 decode ranks x 2 writers each (prefill ranks 0,1 -> 0; 2,3 -> 1)
    per_room = writers * per_writer  # 258,048
    expected = 3 * per_room  # 774,144

    result = simulate(s)
    assert_clean(result, 3)
    rows = [r for r in result.records if r.phase == "slice_write"]
    assert len(rows) == 3 * writers * 4  # rooms x writers x 4 chunks
    assert sum(r.requests for r in rows) == expected == 774_144
    summary = summary_of(result)
    assert summary["transfer_requests"] == {"total": expected, "per_request": per_room}


def test_slice_requests_equal_tp_one_per_page():
    """Llama-3-8B, TP4 -> TP4: both sides hold the same 2 heads, so a page of 16 tokens
    is one contiguous run per (layer, K/V): one request per page."""
    s = load(
        SCENARIOS / "llama3-8b-p4-d4.toml",
        "workload.requests=3",
        "workload.prompt=fixed",
        "workload.prompt_tokens=1000",
        "transfer.path=slice",
    )
    g = s.geometry()
    assert (g.layers, g.prefill_heads, g.decode_heads) == (32, 2, 2)
    pages = -(-1000 // 16)  # 63
    per_writer = pages * 32 * 2  # pages x layers x (K, V) = 4,032
    writers = 4  # decode rank d has the one writer prefill rank d
    expected = 3 * writers * per_writer  # 48,384

    result = simulate(s)
    assert_clean(result, 3)
    rows = [r for r in result.records if r.phase == "slice_write"]
    assert sum(r.requests for r in rows) == expected == 48_384
    assert summary_of(result)["transfer_requests"]["total"] == expected


# --- determinism ----------------------------------------------------------------------------


def test_same_seed_same_bytes_other_seed_differs(tmp_path: Path):
    def trace_bytes(seed: int, name: str) -> tuple[bytes, bytes, bytes]:
        s = load(FLAGSHIP, "workload.requests=12", "workload.rate_per_s=6", f"workload.seed={seed}")
        result = simulate(s)
        assert_clean(result, 12)
        run = tmp_path / name
        run.mkdir()
        paths = write_run(run, s, result.records, summary_of(result), "sim")
        jsonl = write_trace(run / "trace.jsonl", result.records, "sim")
        return paths["trace"].read_bytes(), jsonl.read_bytes(), paths["scenario"].read_bytes()

    a = trace_bytes(3, "a")
    b = trace_bytes(3, "b")
    assert a == b  # parquet, jsonl and resolved scenario: byte for byte
    c = trace_bytes(4, "c")
    assert c[0] != a[0] and c[1] != a[1]


# --- liveness and pool size ----------------------------------------------------------------


def test_pool_of_exactly_one_chunk_completes_every_room():
    s = load(
        FLAGSHIP, "workload.requests=12", "workload.rate_per_s=8", "decode.staging_pool_mb=1280"
    )
    g = s.geometry()
    assert s.pool_bytes == g.chunk_bytes() == 8192 * 80 * 2 * 4 * 128 * 2
    assert any(r.prompt_tokens > 8192 for r in generate_requests(s)), "want multi-chunk rooms"
    result = simulate(s)
    assert_clean(result, 12)
    stalls = [r for r in result.records if r.phase == "wm_wait"]
    assert stalls, "a one-chunk pool should make writers wait for the watermark"
    # regions overcommit the ring (a new round is placed over live bytes; the
    # watermark keeps writes off them), so reservations may exceed the pool, live bytes never
    summary = summary_of(result)
    assert summary["ring_reserved_peak_bytes"] >= s.pool_bytes
    assert 0 < summary["ring_live_peak_bytes"] <= s.pool_bytes


# Compute-bound load: the prefill forward (2 x 70.6e9 x tokens / 8 at 150k tokens/s
# per rank here) is the bottleneck, so a one-chunk pool stalls writers behind the
# watermark and shows in p99, and every larger pool removes stalls.
#
# Not asserted, because it is false in this model: with the NIC the bottleneck
# (prefill.tokens_per_s=400000, rate 10/s) a larger pool lets more chunks share the
# decode NIC at once (max-min fair = processor sharing), which can delay the slowest
# room: seed 0 gives p99 0.105 s at 1280 MiB and 0.157 s at 10240 MiB. A one-chunk
# pool serves rooms in ring (arrival) order instead.
POOL_LOAD = ("workload.requests=24", "workload.rate_per_s=4", "prefill.tokens_per_s=150000")


@pytest.mark.parametrize("seed", [0, 3])
def test_larger_pool_never_worse_p99_under_compute_bound_load(seed: int):
    p99, stall = [], []
    for mb in (1280, 2560, 5120, 10240):
        result = simulate(
            load(FLAGSHIP, *POOL_LOAD, f"decode.staging_pool_mb={mb}", f"workload.seed={seed}")
        )
        assert_clean(result, 24)
        summary = summary_of(result)
        p99.append(summary["transfer_latency_s"]["p99"])
        stall.append(summary["watermark_stall_s"]["total"])
    assert stall[0] > 0.5, "the smallest pool must stall for the test to mean anything"
    assert all(a >= b for a, b in zip(stall, stall[1:], strict=False)), stall
    assert all(a >= b for a, b in zip(p99, p99[1:], strict=False)), p99
    assert p99[0] > p99[-1], "stalls at the smallest pool should cost latency"


# --- the whole catalogue --------------------------------------------------------------------


@pytest.mark.parametrize("path", ["staging", "slice"])
@pytest.mark.parametrize("scenario", CATALOGUE, ids=lambda p: p.stem)
def test_every_scenario_simulates(scenario: Path, path: str):
    s = load(scenario, "workload.requests=6", f"transfer.path={path}")
    result = simulate(s)
    assert_clean(result, 6)
    phases = {r.phase for r in result.records}
    assert ("slice_write" in phases) == (path == "slice")
    assert ("write" in phases) == (path == "staging")
    # the same trace, checked offline as `kvstage check` does, agrees
    assert check_records(result.records, path) == []


# --- staging against the slice path ----------------------------------------------------------


def test_flagship_slice_path_far_more_requests_and_slower():
    results = {
        path: summary_of(simulate(load(FLAGSHIP, "workload.requests=6", f"transfer.path={path}")))
        for path in ("staging", "slice")
    }
    staging, sliced = results["staging"], results["slice"]
    assert staging["requests_done"] == sliced["requests_done"] == 6
    # staging: one bulk write per (writer, chunk); slice: one per (token, layer, K/V)
    assert sliced["transfer_requests"]["total"] > 10_000 * staging["transfer_requests"]["total"]
    # slice: each prefill rank posts its requests on one posting thread (rdma-400g, NIXL);
    # the wait after the forward (transfer_latency_s from the room's first forward holds
    # the prefill compute too, which packed forwards share with other rooms)
    kv = "kv_transfer_latency_s"
    assert sliced[kv]["p50"] > 1.2 * staging[kv]["p50"]
    assert sliced["transfer_latency_s"]["p99"] > staging["transfer_latency_s"]["p99"]


# --- the invariant checker catches a broken readiness rule ---------------------------------


STALL_PRONE = (
    "workload.requests=8",
    "workload.rate_per_s=8",
    "decode.staging_pool_mb=1280",
)


def test_ignoring_the_watermark_is_a_safety_violation(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(kvstage.shared.prefill, "is_ready", lambda round, end, wm: True)
    result = simulate(load(FLAGSHIP, *STALL_PRONE))
    assert result.violations
    assert "safety" in {v.invariant for v in result.violations}


def test_cli_sim_exits_nonzero_on_violation(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setattr(kvstage.shared.prefill, "is_ready", lambda round, end, wm: True)
    args = ["sim", str(FLAGSHIP), "--out", str(tmp_path / "run"), "--no-progress"]
    for s in STALL_PRONE:
        args += ["--set", s]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1, result.output
    assert "[safety]" in result.output
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["invariant_violations"] > 0


# --- the command line -------------------------------------------------------------------------


def test_cli_sim_writes_run_dir_and_check_passes(tmp_path: Path):
    run = tmp_path / "run"
    runner = CliRunner()
    result = runner.invoke(
        app,
        ["sim", str(FLAGSHIP), "--set", "workload.requests=6", "--out", str(run), "--no-progress"],
    )
    assert result.exit_code == 0, result.output
    assert {p.name for p in run.iterdir()} >= {"trace.parquet", "scenario.toml", "summary.json"}

    summary = json.loads((run / "summary.json").read_text())
    assert summary["mode"] == "sim"
    assert summary["requests_done"] == 6 and summary["requests_failed"] == 0
    for key in ("transfer_latency_s", "ttft_s", "kv_transfer_latency_s", "prefill_compute_s"):
        lat = summary[key]
        assert set(lat) >= {"p50", "p90", "p99", "mean", "max"}
        assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"]
    assert summary["throughput_gbps"] > 0
    for kind in ("live", "reserved"):
        assert summary[f"ring_{kind}_peak_bytes"] > 0
        assert (
            summary[f"ring_{kind}_peak_fraction"]
            == summary[f"ring_{kind}_peak_bytes"] / load(FLAGSHIP).pool_bytes
        )
    assert set(summary["watermark_stall_s"]) >= {"total", "p99"}
    assert (
        summary["transfer_requests"]["total"] == 6 * summary["transfer_requests"]["per_request"] > 0
    )
    for key in ("events", "sim_time_s", "wall_s"):
        assert summary[key] > 0
    # the resolved scenario in the run directory loads back to the same scenario
    assert load(run / "scenario.toml").to_toml() == (run / "scenario.toml").read_text()

    checked = runner.invoke(app, ["check", str(run)])
    assert checked.exit_code == 0, checked.output

    # a trace edited to scatter one chunk twice must fail the check
    mode, records = read_records(run)
    scatter = next(r for r in records if r.phase == "scatter")
    again = replace(scatter, start=scatter.end, end=scatter.end + 1e-3)
    write_trace(run / "trace.parquet", [*records, again], mode)
    broken = runner.invoke(app, ["check", str(run)])
    assert broken.exit_code == 1, broken.output
    assert "exactly_once" in broken.output and "scattered 2 times" in broken.output


def test_cli_bad_set_is_one_clear_error(tmp_path: Path):
    kvstage = Path(sys.executable).parent / "kvstage"
    cmd = [str(kvstage)] if kvstage.exists() else [sys.executable, "-m", "kvstage.cli"]
    proc = subprocess.run(
        [*cmd, "sim", str(FLAGSHIP), "--set", "decode.staging_pool_mb=lots", "--out", str(tmp_path / "r"),
         "--no-progress"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out
    assert out.count("error:") == 1
    assert "decode.staging_pool_mb" in out
    assert not (tmp_path / "r").exists()
