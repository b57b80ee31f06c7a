"""`kvstage plan`: the fewest GPUs that meet the SLO, the Pareto front, skipped
configurations, the files, the report section, the no-SLO error and Ray == local.

The scenario is a tiny model whose answer can be told by hand. Prefill runs at a fixed
3,000 tokens/s per instance whatever its TP (`prefill.tokens_per_s`), so 1,024-token
prompts arriving every 0.25 s (4 req/s) overload one instance (~2.9 req/s) and queue,
while two serve them in ~0.34 s: TTFT <= 1 s needs two prefill instances. The decode
GPU (2 GiB, 90% usable) cannot hold the 1B model's 1.86 GiB of weights at TP1, so decode
TP1 is skipped; at TP2 a 2 MiB pool is smaller than one 4 MiB chunk, skipped too.
Fewest GPUs: 2 prefill instances of TP1 + 1 decode instance of TP2 = 4.
"""

from __future__ import annotations

import csv
import json
import os
import random
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvstage.analysis.report import write_report
from kvstage.cli.main import app
from kvstage.explore.plan import (
    DEFAULT_GRID,
    PlanError,
    PlanResult,
    beats,
    judge,
    pareto_front,
    plan_candidates,
    run_plan,
    skip_reasons,
)
from kvstage.explore.plan_point import gpus_of

SCENARIO = """
[model]
layers = 4
kv_heads = 8
head_dim = 64
params_b = 1.0

[prefill]
tp = 1
chunked_prefill_size = 1024
tokens_per_s = 3000

[decode]
tp = 2
staging_pool_mb = 64
gpu_memory_gib = 2

[links]
profile = "rdma-400g"
placement = "inter"

[workload]
requests = 24
arrival = "fixed"
rate_per_s = 4.0
prompt = "fixed"
prompt_tokens = 1024
output_tokens = 16
"""
SLO = "\n[slo]\nttft_s = 1.0\ntpot_s = 0.05\n"
GRID = {
    "prefill.tp": "1,2",
    "decode.tp": "1,2",
    "cluster.prefill_instances": "1,2,3",
    "cluster.decode_instances": "1,2",
    "decode.staging_pool_mb": "2,64",
}
WINNER = {
    "prefill.tp": 1,
    "cluster.prefill_instances": 2,
    "decode.tp": 2,
    "cluster.decode_instances": 1,
    "decode.staging_pool_mb": 64,
}
CLI_GRID = [
    "--prefill-tp",
    "1,2",
    "--decode-tp",
    "1,2",
    "--prefill-instances",
    "1,2,3",
    "--decode-instances",
    "1,2",
    "--pool-mb",
    "2,64",
]


@pytest.fixture(scope="module")
def scenario(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("plan") / "tiny.toml"
    path.write_text(SCENARIO + SLO)
    return path


@pytest.fixture(scope="module")
def cands(scenario):
    # without the capacity screen: the level search itself finds one prefill instance short
    return plan_candidates(scenario, GRID, screen=False)


@pytest.fixture(scope="module")
def result(scenario, cands):
    return run_plan(scenario, cands, workers=1)


def test_invalid_configurations_are_skipped_with_reasons(cands):
    assert len(cands.points) + len(cands.skipped) == 2 * 2 * 3 * 2 * 2
    assert all(
        p.settings["decode.tp"] == 2 and p.settings["decode.staging_pool_mb"] == 64
        for p in cands.points
    )
    assert len(cands.points) == 12
    groups = skip_reasons(cands.skipped)
    assert sum(g["count"] for g in groups) == 36
    assert len(groups) == 2
    text = " ".join(g["reason"] for g in groups)
    assert "decode.gpu_memory_gib" in text and "weights" in text  # decode TP1 cannot hold the model
    assert "smaller than one full chunk" in text  # the 2 MiB pool at decode TP2
    assert cands.targets == {"ttft_s": 1.0, "tpot_s": 0.05}


def test_max_gpus_skips_larger_configurations(scenario):
    c = plan_candidates(scenario, GRID, max_gpus=5)
    assert max(gpus_of(p.settings) for p in c.points) == 5
    assert any("over --max-gpus 5" in r["reason"] for r in c.skipped)


def test_winner_is_the_fewest_gpus_that_meet_the_slo(result):
    w = result.winner
    assert w is not None and {k: w[k] for k in WINNER} == WINNER
    assert w["gpus"] == 4 and w["meets"] and w["slo_attainment"] >= 0.9
    assert w["bottleneck"] and w["bottleneck_why"]
    ran = result.simulated
    # every configuration with fewer GPUs was simulated and misses: one prefill instance is overloaded
    smaller = [r for r in ran if r["gpus"] < 4]
    assert smaller and not any(r["meets"] for r in smaller)
    assert all(r["cluster.prefill_instances"] == 1 for r in ran if not r["meets"])
    one = [r for r in ran if r["cluster.prefill_instances"] == 1]
    assert all(r["bottleneck"].startswith("prefill") for r in one)
    # the search stopped one GPU count above 4 and left the larger ones out
    assert result.stopped_at == 5
    assert {r["gpus"] for r in ran} == {3, 4, 5}
    assert result.count("not run") == 12 - len(ran)


def test_exhaustive_search_agrees(scenario, cands, result):
    full = run_plan(scenario, cands, workers=1, exhaustive=True)
    assert full.count("not run") == 0 and len(full.simulated) == 12 and full.stopped_at is None
    assert {k: full.winner[k] for k in WINNER} == WINNER


def test_front_property(result):
    ran = [r for r in result.simulated if r["ttft_s.p90"] is not None]
    front = result.front
    assert front and all(r["on_front"] for r in front)
    for r in ran:  # on the front exactly when nothing beats it
        assert (r in front) == (not any(beats(o, r) for o in ran if o is not r))
    assert result.winner in front


def _synthetic(n, g, t, meets=True, gpus=4, half=0.0):
    return {
        "n": n, "status": "ok", "meets": meets, "gpus": gpus, "slo_attainment": 0.95 if meets else 0.5,
        "goodput_rps": g * gpus, "goodput_rps_lo": (g - half) * gpus, "goodput_rps_hi": (g + half) * gpus,
        "goodput_per_gpu_rps": g, "ttft_s.p90": t, "ttft_s.p90_lo": t - half, "ttft_s.p90_hi": t + half,
        "on_front": False, "winner": False,
    }  # fmt: skip


def test_front_ignores_differences_inside_the_intervals():
    # 7 ms faster but inside the interval, and clearly less goodput: beaten
    a, b = _synthetic(0, 1.0, 0.500, half=0.02), _synthetic(1, 0.8, 0.493, half=0.02)
    assert beats(a, b) and not beats(b, a)
    assert [r["n"] for r in pareto_front([a, b])] == [0]
    # without intervals the 7 ms would keep it on the front
    a0, b0 = _synthetic(0, 1.0, 0.500), _synthetic(1, 0.8, 0.493)
    assert sorted(r["n"] for r in pareto_front([a0, b0])) == [0, 1]
    # both inside each other's intervals: a tie, both stay
    c, d = _synthetic(2, 1.0, 0.5, half=0.05), _synthetic(3, 1.02, 0.51, half=0.05)
    assert sorted(r["n"] for r in pareto_front([c, d])) == [2, 3]
    # a point that misses the SLO never beats one that meets
    e = _synthetic(4, 2.0, 0.1, meets=False, gpus=2)
    assert not beats(e, a) and beats(a, e) is False  # more GPUs: a does not beat e either
    assert sorted(r["n"] for r in pareto_front([a, e])) == [0, 4]


def test_winner_is_always_on_the_front():
    """Whatever the points, the winner (fewest GPUs that meet, then goodput per GPU)
    is on the front: many random plans, including noisy and tied ones."""
    rng = random.Random(11)
    for trial in range(300):
        rows = [
            _synthetic(
                i,
                rng.choice([0.5, 1.0, 1.0 + rng.random()]),
                rng.choice([0.3, 0.5, rng.random()]),
                meets=rng.random() < 0.6,
                gpus=rng.randint(2, 8),
                half=rng.choice([0.0, 0.01, 0.2]),
            )
            for i in range(rng.randint(1, 12))
        ]
        res = PlanResult(rows, {"ttft_s": 1.0}, 0.9, "test", 0.0, None)
        judge(res)
        meeting = [r for r in rows if r["meets"]]
        if not meeting:
            assert res.winner is None
            continue
        assert res.winner is not None and res.winner in res.front, trial
        assert res.winner["gpus"] == min(r["gpus"] for r in meeting)


def test_cli_prints_the_winner_and_writes_files(scenario, tmp_path):
    out = tmp_path / "plan"
    res = CliRunner().invoke(
        app,
        ["plan", str(scenario), *CLI_GRID, "--workers", "1", "--out", str(out), "--no-progress"],
        env={"COLUMNS": "200"},
    )
    assert res.exit_code == 0, res.output
    assert "winner: 4 GPUs, P 2xTP1 + D 1xTP2, pool 64 MiB" in res.output
    assert "Pareto front" in res.output and "skipped before simulating" in res.output
    assert {p.name for p in out.iterdir()} == {
        "plan.csv",
        "plan.json",
        "plan_front.png",
        "colocated.csv",
    }
    with (out / "plan.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 48 and sum(r["winner"] == "true" for r in rows) == 1
    # successive halving (the default): 24 requests are one window, every candidate runs it
    assert {r["status"] for r in rows} == {"ok", "skipped"}
    assert {r["skipped_by"] for r in rows if r["status"] == "skipped"} == {"scenario", "capacity"}
    doc = json.loads((out / "plan.json").read_text())
    assert doc["winner"]["gpus"] == 4 and doc["verdict"].startswith("winner: 4 GPUs")
    assert doc["slo"] == {"ttft_s": 1.0, "tpot_s": 0.05} and doc["attainment"] == 0.9
    assert (out / "plan_front.png").read_bytes()[:4] == b"\x89PNG"
    html = tmp_path / "r.html"
    write_report([], html, plans=[out])
    page = html.read_text()
    assert "Plan 1: tiny" in page and "winner: 4 GPUs" in page and "data:image/png;base64," in page
    res = CliRunner().invoke(app, ["report", str(out), "--out", str(tmp_path / "r2.html")])
    assert res.exit_code == 0, res.output
    assert "Pareto front" in (tmp_path / "r2.html").read_text()


def test_quantile_columns_follow_the_attainment(scenario, tmp_path):
    out = tmp_path / "p99"
    res = CliRunner().invoke(
        app,
        ["plan", str(scenario), *CLI_GRID, "--workers", "1", "--out", str(out), "--no-progress",
         "--attainment", "0.99", "--max-gpus", "4"],
        env={"COLUMNS": "250"},
    )  # fmt: skip
    assert "TTFT p99" in res.output and "TTFT p90" not in res.output, res.output
    with (out / "plan.csv").open() as fh:
        header = next(csv.reader(fh))
    for key in ("ttft_s", "tpot_s", "e2e_s"):
        assert {f"{key}.p50", f"{key}.p90", f"{key}.p99", f"{key}.p99_lo", f"{key}.p99_hi"} <= set(
            header
        )
    assert "ttft_s.p90_lo" not in header
    doc = json.loads((out / "plan.json").read_text())
    assert doc["quantile"] == "p99" and "ttft_s.p99_hi" in doc["points"][0]
    # 24 requests cannot show a p99: the plan says so
    assert any("too few for the quantile" in w for w in doc["warnings"])


def test_no_configuration_meets(scenario, tmp_path):
    res = CliRunner().invoke(
        app,
        [
            "plan",
            str(scenario),
            *CLI_GRID,
            "--workers",
            "1",
            "--out",
            str(tmp_path / "p"),
            "--no-progress",
            "--max-gpus",
            "3",
            "--no-screen",
        ],
        env={"COLUMNS": "200"},
    )
    assert res.exit_code == 1, res.output
    assert "no configuration meets the SLO up to 3 GPUs; the best was 3 GPUs" in res.output
    assert "limited by prefill" in res.output


def test_no_slo_is_one_clear_error(tmp_path):
    path = tmp_path / "noslo.toml"
    path.write_text(SCENARIO)
    with pytest.raises(PlanError, match=r"no \[slo\] targets"):
        plan_candidates(path, DEFAULT_GRID)
    res = CliRunner().invoke(app, ["plan", str(path), "--no-progress"], env={"COLUMNS": "200"})
    assert res.exit_code == 2
    assert "no [slo] targets" in res.output and "ttft_s" in res.output and "tpot_s" in res.output
    assert "Traceback" not in res.output


def test_bad_option_names_the_option(scenario, tmp_path):
    res = CliRunner().invoke(
        app,
        ["plan", str(scenario), "--decode-tp", "2,0", "--no-progress", "--out", str(tmp_path)],
        env={"COLUMNS": "200"},
    )
    assert res.exit_code == 2 and "--decode-tp" in res.output, res.output


@pytest.mark.slow
def test_ray_gives_the_same_answer(scenario, cands, result):
    try:
        import ray  # noqa: F401
    except ImportError:
        if os.environ.get("CI") == "true":
            pytest.fail("Ray is not installed, and CI must run the Ray tests: pip install ray")
        pytest.skip("Ray is not installed")
    on_ray = run_plan(scenario, cands, workers=2, ray_address="local")
    assert on_ray.backend == "Ray (local)"
    assert {k: on_ray.winner[k] for k in WINNER} == WINNER
    assert len(on_ray.simulated) >= len(result.simulated)
