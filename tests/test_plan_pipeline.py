"""Prefill pipeline parallelism as a plan axis (`--prefill-pp`): its GPUs counted, a
model one node cannot hold fitted by stages, and pp > 1 screened but not simulated,
saying why."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvstage.explore.plan import DEFAULT_GRID, KEYS, plan_candidates
from kvstage.explore.plan_point import gpus_of

LLAMA70 = "scenarios/llama3-70b-p8-d2.toml"
SETS = ["slo.ttft_s=5", "workload.output_tokens=64"]


def _grid(**axes: str) -> dict[str, str | None]:
    base = {"prefill.tp": "4,8", "decode.tp": "8", "cluster.prefill_instances": "1,2"}
    return {**DEFAULT_GRID, **base, "cluster.decode_instances": "1", **axes}


def test_the_default_keeps_the_scenarios_own_pp():
    assert KEYS["prefill.pp"] == "--prefill-pp" and DEFAULT_GRID["prefill.pp"] is None
    c = plan_candidates(LLAMA70, _grid(), SETS, screen=False)
    assert {p.settings["prefill.pp"] for p in c.points} == {1}
    assert not any(r["skipped_by"] == "simulation" for r in c.skipped)


def test_pp_counts_its_gpus_and_is_simulated():
    c = plan_candidates(LLAMA70, _grid(**{"prefill.pp": "1,2"}), SETS, screen=False)
    staged = [p.settings for p in c.points if p.settings["prefill.pp"] == 2]
    assert len(staged) == 4  # TP4 and TP8, one and two instances
    for r in staged:
        want = r["cluster.prefill_instances"] * r["prefill.tp"] * 2 + 8
        assert gpus_of(r) == want
    assert not any(r["skipped_by"] == "simulation" for r in c.skipped)


def test_pp_under_a_host_model_is_screened_not_simulated():
    host = ['links.host_model="cpu-loop"', "links.host_cores=2", "links.engine_thread_cores=0.5",
            "links.event_us=40", "links.fill_latency_us=200", "links.fill_bandwidth_gbs=2"]  # fmt: skip
    c = plan_candidates(LLAMA70, _grid(**{"prefill.pp": "1,2"}), [*SETS, *host], screen=False)
    staged = [r for r in c.skipped if r["prefill.pp"] == 2]
    assert len(staged) == 4 and {p.settings["prefill.pp"] for p in c.points} == {1}
    for r in staged:
        assert r["skipped_by"] == "simulation" and "fits and screens" in r["reason"]
        assert "cpu-loop host model" in r["reason"]


@pytest.mark.slow
def test_stages_fit_a_model_one_node_cannot_hold(tmp_path):
    # Llama-3.1-405B in BF16 (810 GB): TP8 on one node of 8 H100s cannot hold it, TP8 PP2
    # over two can; the plan simulates it and exports SGLang's --pp-size
    sets = [*SETS, "model.preset=llama-3.1-405b", "decode.gpu=h200", "workload.rate_per_s=0.5",
            "workload.requests=40"]  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "kvstage.cli", "plan", LLAMA70, "--prefill-tp", "8",
         "--decode-tp", "8", "--prefill-instances", "1", "--decode-instances", "1",
         "--prefill-pp", "1,2", "--no-colocated", "--workers", "1", "--export", "sglang",
         "--out", str(tmp_path), *(x for s in sets for x in ("--set", s))],
        capture_output=True, text=True, env={"COLUMNS": "300", "PATH": ""},
    )  # fmt: skip
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "weights per GPU > 72 GiB usable on h100-sxm at TP8" in text  # pp 1 skipped
    assert "winner: 24 GPUs, P 1xTP8 PP2 + D 1xTP8" in text and "1 x TP8 PP2" in text
    launch = [x for x in text.splitlines() if "--disaggregation-mode prefill" in x]
    assert len(launch) == 1 and "--tp-size 8 --pp-size 2" in launch[0]
