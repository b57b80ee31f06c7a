"""MoE layouts as plan axes: `--prefill-ep` / `--decode-ep` (DP attention when above
the TP), skipped where they do not apply, and on the colocated side too."""

from __future__ import annotations

import pytest

from kvstage.explore.colocated import colocated_from_plan
from kvstage.explore.plan import DEFAULT_GRID, KEYS, plan_candidates

DEEPSEEK = "scenarios/mla/deepseek-v3-p16-d8.toml"
SETS = ["slo.ttft_s=5", "workload.output_tokens=64"]


def _grid(**axes: str) -> dict[str, str | None]:
    base = {"prefill.tp": "8", "decode.tp": "8", "cluster.prefill_instances": "1,2"}
    return {**DEFAULT_GRID, **base, "cluster.decode_instances": "1,2,3", **axes}


@pytest.fixture(scope="module")
def cands():
    grid = _grid(**{"prefill.ep": "1,8,16", "decode.ep": "1,8,16"})
    return plan_candidates(DEEPSEEK, grid, SETS, screen=False)


def test_ep_is_an_axis_and_its_gpus_are_the_tp_groups(cands):
    assert {"prefill.ep", "decode.ep"} <= set(KEYS)
    eps = {(p.settings["prefill.ep"], p.settings["decode.ep"]) for p in cands.points}
    assert (16, 16) in eps and (16, 1) in eps
    for p in cands.points:  # DP attention spreads the experts, not the GPUs
        s = p.settings
        assert p.scenario.prefill.ep == s["prefill.ep"] and p.scenario.decode.ep == s["decode.ep"]


def test_expert_parallelism_lets_the_weights_fit(cands):
    # 671B in fp8 over TP8 is 78 GiB a GPU, over the H100's 72 usable: only EP16 fits
    # (the experts over 16 GPUs, two instances), so every prefill point has EP16
    assert {p.settings["prefill.ep"] for p in cands.points} == {16}
    reasons = [r["reason"] for r in cands.skipped]
    assert any("weights per GPU" in r and "prefill" in r for r in reasons)


def test_uneven_expert_groups_are_skipped_with_why(cands):
    uneven = [r for r in cands.skipped if "expert groups" in r["reason"]]
    assert uneven and all(r["skipped_by"] == "scenario" for r in uneven)
    assert all(
        r["cluster.prefill_instances"] % 2 or r["cluster.decode_instances"] % 2 for r in uneven
    )
    assert not any(
        p.settings["decode.ep"] == 16 and p.settings["cluster.decode_instances"] % 2
        for p in cands.points
    )


def test_a_dense_model_skips_expert_parallelism():
    c = plan_candidates(
        "scenarios/llama3-70b-p8-d2.toml",
        {**DEFAULT_GRID, "prefill.tp": "8", "decode.tp": "8", "cluster.prefill_instances": "1",
         "cluster.decode_instances": "1", "decode.ep": "1,8"},
        SETS,
        screen=False,
    )  # fmt: skip
    assert [p.settings["decode.ep"] for p in c.points] == [1]
    assert any("needs a MoE model" in r["reason"] for r in c.skipped)


def test_the_colocated_side_searches_ep_too(cands):
    cc = colocated_from_plan(cands, "1,2,4", None)
    layouts = {(s["colocated.ep"], s["colocated.instances"]) for s in cc.settings.values()}
    assert (16, 2) in layouts and (16, 4) in layouts and (16, 1) not in layouts
    assert any("expert groups of 2" in r["reason"] for r in cc.skipped)
    for i, s in cc.settings.items():
        assert cc.scenarios[i].decode.ep == s["colocated.ep"]
