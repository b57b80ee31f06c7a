"""Prefill pipeline parallelism as a plan axis (`--prefill-pp`): its GPUs counted, a
model one node cannot hold fitted by stages, and pp > 1 screened but not simulated,
saying why."""

from __future__ import annotations

import subprocess
import sys

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


def test_pp_counts_its_gpus_and_is_screened_not_simulated():
    c = plan_candidates(LLAMA70, _grid(**{"prefill.pp": "1,2"}), SETS, screen=False)
    assert {p.settings["prefill.pp"] for p in c.points} == {1}
    staged = [r for r in c.skipped if r["prefill.pp"] == 2]
    assert len(staged) == 4  # TP4 and TP8, one and two instances
    for r in staged:
        assert r["skipped_by"] == "simulation"
        assert "prefill.pp 2: fits and screens" in r["reason"]
        assert "rank runtime and the simulator do not run yet" in r["reason"]
        want = r["cluster.prefill_instances"] * r["prefill.tp"] * 2 + 8
        assert r["gpus"] == gpus_of(r) == want


def test_stages_fit_a_model_one_node_cannot_hold():
    # Llama-3.1-405B in BF16 (810 GB): TP8 on one node of 8 H100s cannot hold it, PP2 can
    sets = [*SETS, "model.preset=llama-3.1-405b", "decode.gpu=h200", "workload.rate_per_s=0.5"]
    out = subprocess.run(
        [sys.executable, "-m", "kvstage.cli", "plan", LLAMA70, "--prefill-tp", "8",
         "--decode-tp", "8", "--prefill-instances", "1", "--decode-instances", "1",
         "--prefill-pp", "1,2", "--no-colocated", *(x for s in sets for x in ("--set", s))],
        capture_output=True, text=True, env={"COLUMNS": "300", "PATH": ""},
    )  # fmt: skip
    text = out.stdout + out.stderr
    assert out.returncode == 2 and text.count("\n") == 1, text
    # nothing left to simulate: TP8 does not fit, TP8 PP2 fits and is screened only
    assert "no configuration to simulate" in text
    assert "P 1xTP8 PP2 + D 1xTP8" in text and "prefill.pp 2: fits and screens" in text
