"""`kvstage calibrate --fit-serving SCENARIO --from RUN...`: the serving model fitted to
many measured points, its error on points held out of the fit, and the profile a
scenario names. Points made by the model itself at known values must give those values
back (closed form); the fixtures' logs go through the whole command."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstage.calibrate.serving import (
    HOLD_EVERY,
    fit_decode_points,
    fit_prefill_points,
    fit_request_points,
    split_points,
)
from kvstage.calibrate.serving_points import (
    DecodePoint,
    PrefillPoint,
    RequestPoint,
    points_from_runs,
)
from kvstage.measured.formats import read_measured
from kvstage.measured.rundir import write_measured_run
from kvstage.run.rundir import load_run
from kvstage.shared.scenario import ScenarioError, load_scenario
from kvstage.shared.serving.compute import decode_step, prefill_forward_s

ROOT = Path(__file__).resolve().parents[1]
P8D2 = ROOT / "scenarios" / "llama3-70b-p8-d2.toml"
DATA = ROOT / "tests" / "data" / "measured"


def test_decode_points_made_by_the_model_give_its_hbm_share_and_overhead_back():
    truth = load_scenario(P8D2, ["decode.hbm_efficiency=0.62", "decode.step_overhead_ms=2.5"])
    pts = [
        DecodePoint(b, b * ctx, decode_step(truth, b, b * ctx).total_s)
        for b in (1, 2, 4, 8, 16)
        for ctx in (1024, 4096)
    ]
    fit = fit_decode_points(P8D2, pts)
    assert fit.values["decode.hbm_efficiency"] == pytest.approx(0.62, rel=1e-6)
    assert fit.values["decode.step_overhead_ms"] == pytest.approx(2.5, rel=1e-6)
    assert (fit.fitted, fit.held_out) == (8, 2)
    assert fit.held_out_mape == pytest.approx(0.0, abs=1e-9)


def test_prefill_points_made_by_the_model_give_its_mfu_back():
    truth = load_scenario(P8D2, ["prefill.mfu=0.33"])
    pts = [PrefillPoint(n, c, prefill_forward_s(truth, n, c)) for n, c in
           ((8192, 0), (8192, 8192), (4096, 0), (2048, 512), (1024, 0))]  # fmt: skip
    fit = fit_prefill_points(P8D2, pts)
    assert fit.values["prefill.mfu"] == pytest.approx(0.33, rel=1e-4)
    assert fit.held_out == 1 and fit.held_out_mape == pytest.approx(0.0, abs=1e-4)


def test_request_cost_is_idle_ttft_less_the_forward_and_is_scored_held_out():
    s = load_scenario(P8D2)
    chunk = s.prefill.chunked_prefill_size

    def forward(prompt):
        return sum(prefill_forward_s(s, min(chunk, prompt - p), p) for p in range(0, prompt, chunk))

    pts = [RequestPoint(n, 0.08 + forward(n)) for n in (512, 1024, 2048, 4096, 8192)]
    fit = fit_request_points(P8D2, pts, [])
    assert fit.values["request_ms"] == pytest.approx(80.0, rel=1e-9)
    assert fit.held_out_mape == pytest.approx(0.0, abs=1e-12)


def test_every_fourth_point_is_held_out():
    fit, held = split_points(list(range(10)))
    assert held == [3, 7] and len(fit) == 8 and HOLD_EVERY == 4
    assert split_points([1, 2]) == ([1, 2], [])


def test_points_come_from_the_logs_and_the_idle_requests(tmp_path):
    runs = [
        load_run(write_measured_run(read_measured(DATA / n), tmp_path / n))
        for n in ("sglang_pd_decode.log", "sglang_prefill.log", "vllm_bench_detailed.json")
    ]
    pts = points_from_runs(runs)
    # a step = running / gen throughput
    assert pts.decode[0] == DecodePoint(1, 2100, pytest.approx(1 / 40))
    assert pts.decode[2].step_s == pytest.approx(4 / 145.45)
    # batch i-1's forward = line i's new tokens / its throughput, when i-1 left a queue
    assert [(p.tokens, p.cached) for p in pts.prefill] == [(8192, 0), (8192, 0), (4096, 512)]
    assert [p.forward_s for p in pts.prefill] == pytest.approx([0.5, 0.5, 2048 / 9000])
    # requests 0, 1, 2 of the vllm file each arrive after the one before finished
    assert [p.prompt_tokens for p in pts.requests] == [100, 200, 300]


def test_the_cli_writes_a_profile_a_scenario_names(tmp_path):
    from typer.testing import CliRunner

    from kvstage.cli.main import app

    runs = [
        write_measured_run(read_measured(DATA / n), tmp_path / n)
        for n in ("sglang_pd_decode.log", "sglang_prefill.log")
    ]
    prof = tmp_path / "prof.toml"
    args = ["calibrate", "--fit-serving", str(P8D2), "--serving-profile", str(prof)]
    res = CliRunner().invoke(app, [*args, *(x for r in runs for x in ("--from", str(r)))])
    assert res.exit_code == 0, res.output
    assert "held-out error" in res.output
    text = P8D2.read_text()
    scen = tmp_path / "s.toml"
    scen.write_text(text + '\n[serving]\nprofile = "prof.toml"\n')
    s = load_scenario(scen)
    fitted = {
        line.split(" = ")[0]: float(line.split(" = ")[1])
        for line in prof.read_text().splitlines()
        if " = " in line and not line.startswith("#")
    }
    assert s.prefill.mfu == pytest.approx(fitted["mfu"])
    assert s.decode.hbm_efficiency == pytest.approx(fitted["hbm_efficiency"])
    # the scenario's own key wins over the profile's
    assert load_scenario(scen, ["prefill.mfu=0.2"]).prefill.mfu == 0.2
    # a profile may set only the fitted keys
    prof.write_text("[decode]\ntp = 4\n")
    with pytest.raises(ScenarioError, match=r"\[decode\] tp: a serving profile sets only"):
        load_scenario(scen)
    # nothing to fit: one line, exit 2
    bad = CliRunner().invoke(app, [*args[:3], "--from", str(tmp_path / "nothing")])
    assert bad.exit_code == 2


def test_ttft_under_load_replays_a_clients_requests_through_the_simulation(tmp_path):
    """A simulated run's requests, as a client with send times would record them, replayed
    by `ttft_under_load` with the same model: every TTFT comes back (error 0), so the
    replay keeps the load and matches requests in order of arrival; a slower model
    (half the decode HBM share, the same load) misses by a measurable amount."""
    from kvstage.calibrate.serving import ttft_under_load
    from kvstage.calibrate.serving_points import LoadedRequest
    from kvstage.metrics.rooms import request_figures, room_latencies
    from kvstage.sim.driver import simulate

    sets = ['workload.prompt="fixed"', "workload.prompt_tokens=4096", "workload.requests=12",
            "workload.output_tokens=24", "workload.rate_per_s=6", "decode.max_running_requests=2"]  # fmt: skip
    s = load_scenario(P8D2, sets)
    res = simulate(s)
    by_room = {r.room: r for r in res.requests}
    rooms = room_latencies(res.records)
    reqs = [
        LoadedRequest(by_room[k].arrival_s, 4096, 24, request_figures(rooms[k])["ttft_s"])
        for k in sorted(rooms)
    ]
    cluster = ["decode.max_running_requests=2"]  # the cluster; the load comes from the client
    fit = ttft_under_load(P8D2, reqs, cluster, tmp_path)
    assert fit.held_out == 12 and fit.held_out_mape == pytest.approx(0.0, abs=1e-9)
    slow = ttft_under_load(P8D2, reqs, [*cluster, "decode.hbm_efficiency=0.4"], tmp_path)
    assert slow.held_out_mape > 0.01
