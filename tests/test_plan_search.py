"""`kvstage plan`'s search by method: the capacity screen, successive halving (the
exhaustive winner on a small grid), cost figures by hand, the SGLang export of a
known winner, progress lines off a terminal, one-line errors for bad flag values,
and simulation tables without the host's LOADED line.

The scenario is test_plan.py's tiny model: prefill forwards 3,000 tokens/s per
instance whatever its TP, and 1,024-token prompts arrive at 4 req/s (4,096 tokens/s),
so one prefill instance is overloaded (137%) and two are not.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
from rich.console import Console
from test_plan import CLI_GRID, GRID, SCENARIO, SLO, WINNER  # noqa: E402  (the same tiny case)
from typer.testing import CliRunner

from kvstage.cli.main import app
from kvstage.explore.costs import cost_figures, parse_gpu_costs
from kvstage.explore.executor import ExploreError
from kvstage.explore.export import sglang_commands, sglang_flags
from kvstage.explore.halving import keep_count, relaxation_requests, schedule
from kvstage.explore.plan import KEYS, plan_candidates, run_plan
from kvstage.explore.progress import ProgressLog
from kvstage.explore.screen import capacity, screen
from kvstage.run.summary_table import print_summary


@pytest.fixture(scope="module")
def scenario(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("search") / "tiny.toml"
    path.write_text(SCENARIO + SLO)
    return path


def test_screen_skips_an_overloaded_configuration_with_its_reason(scenario):
    cands = plan_candidates(scenario, GRID)
    over = [r for r in cands.skipped if r.get("skipped_by") == "capacity"]
    # every valid configuration with one prefill instance, and only those
    assert over and all(r["cluster.prefill_instances"] == 1 for r in over)
    assert all(p.settings["cluster.prefill_instances"] >= 2 for p in cands.points)
    reason = over[0]["reason"]
    # 4 req/s x 1,024 tokens = 4,096 tokens/s against 3,000: 137%
    assert reason.startswith("prefill compute overloaded") and "4,096 tokens/s" in reason
    assert "3,000 tokens/s" in reason and "137% of capacity" in reason
    unscreened = plan_candidates(scenario, GRID, screen=False)
    assert len(unscreened.points) == len(cands.points) + len(over)
    one = next(p for p in unscreened.points if p.settings["cluster.prefill_instances"] == 1)
    assert capacity(one.scenario)["prefill compute"]["utilization"] == pytest.approx(4096 / 3000)
    assert screen(one.scenario) == reason


def test_screened_configurations_are_counted_by_reason_in_the_files(scenario, tmp_path):
    out = tmp_path / "p"
    res = CliRunner().invoke(
        app,
        ["plan", str(scenario), *CLI_GRID, "--workers", "1", "--out", str(out), "--no-progress"],
        env={"COLUMNS": "200"},
    )
    assert res.exit_code == 0, res.output
    assert "prefill compute overloaded" in res.output  # the intro's skipped table says so
    with (out / "plan.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    by = {}
    for r in rows:
        if r["status"] == "skipped":
            by[r["skipped_by"]] = by.get(r["skipped_by"], 0) + 1
    doc = json.loads((out / "plan.json").read_text())
    assert doc["skipped_by"] == by and by["capacity"] == 4 and by["scenario"] == 36
    assert any("overloaded" in g["reason"] for g in doc["skipped"])


@pytest.mark.slow
def test_successive_halving_gives_the_exhaustive_winner(tmp_path):
    # 900 Poisson requests: windows of 200, 600, then the whole 900 for the survivors
    path = tmp_path / "halving.toml"
    path.write_text(
        SCENARIO.replace("requests = 24", "requests = 900").replace(
            '"fixed"\nrate', '"poisson"\nrate'
        )
        + SLO
    )
    grid = {**GRID, "cluster.prefill_instances": "1,2,3", "decode.staging_pool_mb": "64"}
    cands = plan_candidates(path, grid, screen=False)
    full = run_plan(path, cands, workers=1, search="exhaustive")
    halved = run_plan(path, cands, workers=1, search="halving")
    assert full.winner is not None and halved.winner is not None
    assert {k: halved.winner[k] for k in KEYS} == {k: full.winner[k] for k in KEYS}
    assert {k: halved.winner[k] for k in WINNER} == WINNER
    assert halved.winner["requests"] == 900  # the winner ran the whole workload
    assert halved.count("pruned") > 0 and len(halved.rungs) >= 2
    assert halved.rungs[0][0] == len(cands.points)
    pruned = [r for r in halved.rows if r["status"] == "pruned"]
    # a busy configuration starts on a longer window (one prefill instance: the whole 900)
    assert {r["requests"] for r in pruned if r["cluster.prefill_instances"] >= 2} >= {200}
    assert all(
        r["requests"] == 900
        for r in halved.rows
        if r["cluster.prefill_instances"] == 1 and "rung" in r
    )
    assert all(r["reason"].startswith("pruned after rung") and not r["on_front"] for r in pruned)
    assert sum(r for _, r in halved.rungs) < len(cands.points) * 900


def test_halving_schedule_and_run_length():
    assert keep_count(100) == 34 and keep_count(4) == 3 and keep_count(2) == 2
    # near saturation a queue relaxes slowly: the first window grows
    assert relaxation_requests(0.5) == pytest.approx(0.5 / (1 - math.sqrt(0.5)) ** 2)
    assert relaxation_requests(0.95) > 100 * relaxation_requests(0.5)
    rungs = schedule([200] * 10, [1800] * 10)
    assert rungs == [(10, 2000), (4, 2400), (3, 5400)]


def test_gpu_hour_cost_arithmetic_by_hand():
    prices = parse_gpu_costs("h100-sxm=2.5, h200=3.6")
    assert prices == {"h100-sxm": 2.5, "h200": 3.6}
    row = {
        "cluster.prefill_instances": 2, "prefill.tp": 1, "cluster.decode_instances": 1,
        "decode.tp": 2, "gpus": 4, "prefill_gpu": "h100-sxm", "decode_gpu": "h200",
        "input_tokens_per_gpu_s": 1000.0, "output_tokens_per_gpu_s": 50.0,
    }  # fmt: skip
    c = cost_figures(row, prices)
    # prefill: 2 GPUs x 2.5 = 5.0 per hour for 4 GPUs x 1,000 = 4,000 input tokens/s
    # = 14.4 M tokens/h: 5 / 14.4 = 0.3472 per M; decode: 2 x 3.6 = 7.2 per hour for
    # 4 x 50 = 200 output tokens/s = 0.72 M/h: 10.0 per M
    assert c["cost_per_hour"] == pytest.approx(12.2)
    assert c["cost_per_m_input_tokens"] == pytest.approx(5 / 14.4)
    assert c["cost_per_m_output_tokens"] == pytest.approx(10.0)
    assert cost_figures({**row, "decode_gpu": "b200"}, prices)["cost_per_hour"] is None


def test_costs_reach_the_tables_and_files(scenario, tmp_path):
    out = tmp_path / "p"
    res = CliRunner().invoke(
        app,
        ["plan", str(scenario), *CLI_GRID, "--workers", "1", "--out", str(out), "--no-progress",
         "--gpu-hour-cost", "h100-sxm=2"],
        env={"COLUMNS": "250"},
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "$/M in" in res.output
    doc = json.loads((out / "plan.json").read_text())
    w = doc["winner"]
    assert w["cost_per_hour"] == pytest.approx(4 * 2.0)
    tokens_in = w["input_tokens_per_gpu_s"] * 4 * 3600 / 1e6
    assert w["cost_per_m_input_tokens"] == pytest.approx(2 * 2.0 / tokens_in)
    with (out / "plan.csv").open() as fh:
        header = next(csv.reader(fh))
    assert {"cost_per_hour", "cost_per_m_input_tokens", "cost_per_m_output_tokens"} <= set(header)


def test_export_sglang_flags_for_a_known_winner(scenario, tmp_path):
    cands = plan_candidates(scenario, GRID)
    point = next(p for p in cands.points if all(p.settings[k] == v for k, v in WINNER.items()))
    env, flags = sglang_flags(point.scenario, "prefill")
    text = " ".join(flags)
    assert "--disaggregation-mode prefill" in text and "--tp-size 1" in text
    assert "--chunked-prefill-size 1024" in text and "--page-size 16" in text
    assert "--disaggregation-transfer-backend nixl" in text
    assert env == {"SGLANG_DISAGG_STAGING_BUFFER": "1"}
    env, flags = sglang_flags(point.scenario, "decode")
    text = " ".join(flags)
    assert "--disaggregation-mode decode" in text and "--tp-size 2" in text
    assert "--chunked-prefill-size" not in text and "--page-size 16" in text
    assert env == {"SGLANG_DISAGG_STAGING_BUFFER": "1", "SGLANG_DISAGG_STAGING_POOL_SIZE_MB": "64"}
    lines = sglang_commands(point.scenario).splitlines()
    assert "prefill: 2 server(s)" in lines[1] and "decode: 1 server(s)" in lines[3]
    res = CliRunner().invoke(
        app,
        ["plan", str(scenario), *CLI_GRID, "--workers", "1", "--out", str(tmp_path / "p"),
         "--no-progress", "--export", "sglang"],
        env={"COLUMNS": "400"},
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "SGLANG_DISAGG_STAGING_POOL_SIZE_MB=64 python -m sglang.launch_server" in res.output


def test_progress_lines_when_stdout_is_not_a_terminal(scenario, tmp_path):
    res = CliRunner().invoke(
        app,
        ["plan", str(scenario), *CLI_GRID, "--workers", "1", "--out", str(tmp_path / "p")],
        env={"COLUMNS": "200"},
    )
    assert res.exit_code == 0, res.output
    lines = [x for x in res.output.splitlines() if x.startswith("planning: ")]
    assert lines and "simulations" in lines[0] and ("ETA" in lines[0] or "done" in lines[0])
    assert lines[-1].endswith("done") and "100% of the work" in lines[-1]


def test_progress_log_quarters_and_minutes():
    t = [0.0]
    out: list[str] = []
    log = ProgressLog(8, 800, out.append, clock=lambda: t[0])
    for _ in range(8):
        t[0] += 10
        log.advance(100)
    # one line per quarter of the work: after 2, 4, 6 and 8 of 8
    assert len(out) == 4 and out[0].startswith("planning: 2/8 simulations, 25% of the work")
    assert "20 s elapsed, ETA 1 min 0 s" in out[0] and out[-1].endswith("done")
    out.clear()
    slow = ProgressLog(100, 100, out.append, clock=lambda: t[0])
    t[0] += 61
    slow.advance(1)  # 1% of the work, but a minute passed: a line
    assert len(out) == 1 and "1/100" in out[0]
    slow.finish()  # the search ended under its estimate: a closing line says so
    assert (
        len(out) == 2
        and out[-1].startswith("planning: 1/1 simulations, 100%")
        and out[-1].endswith("done")
    )


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--gpu-hour-cost", "h999=1"], ["--gpu-hour-cost", "unknown GPU 'h999'", "h200"]),
        (["--gpu-hour-cost", "h200=cheap"], ["--gpu-hour-cost", "h200='cheap'", ">= 0"]),
        (["--gpu-hour-cost", "h200"], ["--gpu-hour-cost", "NAME=PRICE"]),
        (["--search", "random"], ["--search", "halving"]),
        (["--export", "trtllm"], ["--export", "sglang, vllm, lws", "dynamo-vllm", "llm-d"]),
        (["--router", "fastest"], ["--router", "round-robin"]),
        (["--path", "carrier-pigeon"], ["--path", "staging"]),
        (["--chunk", "0"], ["--chunk"]),
    ],
)
def test_bad_flag_values_give_one_line(scenario, tmp_path, args, words):
    res = CliRunner().invoke(
        app,
        ["plan", str(scenario), "--no-progress", "--out", str(tmp_path / "p"), *args],
        env={"COLUMNS": "300"},
    )
    assert res.exit_code == 2, res.output
    text = res.output.strip()
    assert "Traceback" not in text and len(text.splitlines()) == 1, text
    for w in words:
        assert w in text, text
    with pytest.raises(ExploreError):
        parse_gpu_costs("h200=-1")


def _table(summary: dict) -> str:
    console = Console(record=True, width=200)
    print_summary(summary, console)
    return console.export_text()


def test_loaded_stays_out_of_simulation_tables(scenario):
    from kvstage.metrics.rooms import room_latencies, summarize
    from kvstage.sim.shard import simulate_scenario

    point = plan_candidates(scenario, GRID).points[0]
    sim = simulate_scenario(point.scenario)
    rooms = room_latencies(sim.records)
    summary = summarize(
        sim.records, mode="sim", pool_bytes=point.scenario.pool_bytes,
        requests=len(sim.requests), rooms=rooms,
    )  # fmt: skip
    # a host where other processes took 60% of the cores: LOADED for a measured run
    summary["conditions"] = {"cores": 2, "other_cpu_share": 0.6}
    assert summary["mode"] == "sim" and "LOADED" not in _table(summary)
    assert "LOADED" in _table({**summary, "mode": "hw"})


def test_one_instance_prefill_work_is_shared_across_instance_counts():
    """The screen computes one prefill instance's work on the workload once per scenario
    up to its instance counts (kvstage/explore/screen.py): the counts do not enter it,
    and the screen's prefill stage is the one computed afresh."""
    from kvstage.explore.screen import _workload
    from kvstage.shared.scenario import load_scenario
    from kvstage.shared.serving.capacity import prefill_stage, prefill_work

    base = Path(__file__).resolve().parents[1] / "scenarios" / "llama3-8b-p1-d4.toml"
    sets = ["workload.requests=40", "slo.ttft_s=1", 'workload.prompt="uniform"']
    works, stages = set(), []
    for p, d in ((1, 1), (2, 3), (4, 2)):
        s = load_scenario(
            base, [*sets, f"cluster.prefill_instances={p}", f"cluster.decode_instances={d}"]
        )
        requests, load = _workload(s)
        works.add(prefill_work(s, requests))
        fresh = prefill_stage(s, requests, load)
        stages.append((capacity(s)["prefill compute"]["capacity"], fresh.capacity))
    assert len(works) == 1  # the counts do not enter one instance's work
    for screened, fresh in stages:
        assert screened == fresh > 0
    assert stages[1][0] == pytest.approx(2 * stages[0][0])


def test_a_short_window_of_a_trace_carries_only_its_rows(tmp_path):
    """A halving rung's scenario replays a trace's first rows: only those go with it to
    its worker, and its requests are the whole scenario's first ones."""
    import pickle

    from kvstage.explore.plan import _shortened
    from kvstage.shared.scenario import load_scenario
    from kvstage.shared.workload import generate_requests

    rows = [{"timestamp": 100 * i, "input_length": 300 + 7 * i} for i in range(50)]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = tmp_path / "s.toml"
    path.write_text(SCENARIO + SLO)
    trace = ['workload.arrival="trace"', 'workload.trace="t.jsonl"', 'workload.prompt="trace"']
    s = load_scenario(path, trace)
    short = _shortened(s, 12)
    assert len(short.workload.rows) == 12 and len(s.workload.rows) == 50
    assert len(pickle.dumps(short)) < len(pickle.dumps(s))
    assert generate_requests(short) == generate_requests(s)[:12]
