"""Two-batch overlap in prefill (`prefill.two_batch_overlap`, shared/serving/prefill_tbo.py).

Bounds computed here from datasheet numbers, not read from the code under test: H100 SXM
1,979 TFLOP/s dense FP8 and 3.35 TB/s HBM ([D] gpus.py's page); DeepSeek-V3 37 B active
parameters, FP8 weights (1 byte each)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstage.shared.scenario import ScenarioError, load_scenario
from kvstage.shared.serving import compute
from kvstage.shared.serving.compute import prefill_forward, prefill_forward_s
from kvstage.shared.serving.mixed import prefill_step_s
from kvstage.shared.serving.prefill_tbo import schedule_s, split_halves

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "scenarios" / "llama3-8b-p4-d2.toml"
PEAK_FP8, HBM = 1979e12, 3350e9  # [D] H100 SXM
ACTIVE = 37e9  # [P] DeepSeek-V3 model card

# DeepSeek-V3 FP8 prefill on H100 nodes of 8: TP1 x EP32 with DP attention (LMSYS's)
DSV3 = [
    'transfer.path="slice"',
    "model.preset=deepseek-v3",
    "model.weight_dtype=fp8",
    "prefill.chunked_prefill_size=16384",
    *(f"{side}.{key}" for side in ("prefill", "decode") for key in ("tp=1", "ep=32")),
]
TBO = [*DSV3, "prefill.two_batch_overlap=true"]


def test_the_split_follows_sglang_whole_prompts_or_two_chunks():
    # 16 prompts: 8 and 8 whole prompts
    a, b = split_halves(1024, 0, 16)
    assert [(p.count, p.tokens, p.context) for p in a] == [(8, 1024, 0)]
    assert [(p.count, p.tokens, p.context) for p in b] == [(8, 1024, 0)]
    # one prompt: two chunks, the second attending to the first's KV, and ending it
    a, b = split_halves(1024, 100, 1)
    assert [(p.count, p.tokens, p.context, p.ends) for p in a] == [(1, 512, 100, 0)]
    assert [(p.count, p.tokens, p.context, p.ends) for p in b] == [(1, 512, 612, 1)]
    # 3 prompts: whole prompts would split 2:1 (a third < 0.48), so 1.5 : 1.5
    a, b = split_halves(1000, 0, 3)
    assert sum(p.total for p in a) == sum(p.total for p in b) == 1500
    assert sum(p.ends for p in a) + sum(p.ends for p in b) == 3
    # the attention's keys are the whole forward's, however it splits
    whole = 3 * 1000 * (1000 + 1) / 2
    assert sum(p.keys for p in (*a, *b)) == pytest.approx(whole)
    assert split_halves(1, 0, 1) is None  # one token cannot split


def test_overlap_hides_communication_but_never_beats_compute_comm_or_the_bounds():
    plain, tbo = load_scenario(BASE, DSV3), load_scenario(BASE, TBO)
    for tokens, prompts in ((1024, 1), (4096, 1), (1024, 16)):
        one, two = (
            prefill_forward(plain, tokens, prompts=prompts),
            prefill_forward(tbo, tokens, prompts=prompts),
        )
        n = tokens * prompts
        comm = two.alltoall_s
        compute = two.total_s + two.overlap_s - comm  # both halves' compute
        assert two.overlap_s > 0
        assert two.total_s >= max(comm, compute) - 1e-12  # one stream each
        assert two.total_s < one.total_s  # here there is communication to hide
        # never faster than the whole batch's FLOPs or its active weights over HBM
        assert two.total_s >= 2 * ACTIVE * n / PEAK_FP8
        assert two.total_s >= ACTIVE * 1.0 / HBM
        # the split's own cost: each half's compute is no less than its share of one's
        assert compute >= one.total_s - one.alltoall_s
        assert prefill_forward_s(tbo, n) == pytest.approx(prefill_forward(tbo, n).total_s)


def test_a_forward_that_cannot_split_or_has_nothing_to_hide_is_unchanged():
    plain, tbo = load_scenario(BASE, DSV3), load_scenario(BASE, TBO)
    assert prefill_forward(tbo, 1).total_s == prefill_forward(plain, 1).total_s
    # without an all-to-all (experts split by TP) the option changes nothing, where a
    # scenario holds it without validation (a loaded one is refused, below)
    dense = load_scenario(BASE, ['transfer.path="slice"'])
    forced = dense.model_copy(update={"prefill": dense.prefill.model_copy(
        update={"two_batch_overlap": True})})  # fmt: skip
    assert prefill_forward(forced, 4096).total_s == prefill_forward(dense, 4096).total_s
    # two tokens split, but there is almost nothing to hide: the split's cost shows
    assert prefill_forward(tbo, 2).total_s > prefill_forward(plain, 2).total_s


def test_it_is_refused_where_it_cannot_apply():
    with pytest.raises(ScenarioError, match="needs a MoE model with prefill.ep > prefill.tp"):
        load_scenario(BASE, ["prefill.two_batch_overlap=true"])
    with pytest.raises(ScenarioError, match="needs a MoE model with prefill.ep > prefill.tp"):
        load_scenario(BASE, [*DSV3, "prefill.ep=1", "prefill.two_batch_overlap=true"])
    with pytest.raises(ScenarioError, match="known for: h100-sxm"):
        load_scenario(BASE, [*TBO, "prefill.gpu=h20", "decode.gpu=h20"])


def test_a_colocated_forward_keeps_the_overlap():
    """shared/serving/mixed.py prices a colocated instance's prompt chunks from the same
    forward: its communication is what the overlap leaves exposed."""
    tbo = load_scenario(BASE, TBO)
    compute, fixed = prefill_step_s(tbo, [(4096, 0)])
    assert compute + fixed == pytest.approx(prefill_forward(tbo, 4096).total_s)
    compute_two, fixed_two = prefill_step_s(tbo, [(2048, 0), (2048, 0)])
    plain = prefill_step_s(load_scenario(BASE, DSV3), [(2048, 0), (2048, 0)])
    assert 0 <= fixed_two and compute_two + fixed_two < sum(plain)  # the all-to-all partly hidden


def test_a_stage_slows_only_while_communication_runs_beside_it():
    # one layer, every op 1 s: A attention [0, 1] alone, its dispatch [1, 2]; B attention
    # from 1, beside that dispatch until 2 (twice slower: half its work), the other
    # half alone: ends 2.5; its dispatch [2.5, 3.5]; A experts from 2.5, beside it until
    # 3.5, ends 4; A combine [4, 5]; B experts from 4, beside it until 5, ends 5.5; B
    # combine [5.5, 6.5]. Without the slowdown: 5 s.
    ones = (1.0, 1.0)
    assert schedule_s(ones, ones, ones, ones, 1) == pytest.approx(5.0)
    assert schedule_s(ones, ones, ones, ones, 1, (2.0, 2.0), (2.0, 2.0)) == pytest.approx(6.5)
    # nothing to communicate: nothing beside the compute, nothing slowed
    zeros = (0.0, 0.0)
    assert schedule_s(ones, ones, zeros, zeros, 3, (2.0, 2.0), (2.0, 2.0)) == pytest.approx(12.0)


def test_the_contention_beside_deepep_costs_at_most_the_parts_stretch(monkeypatch):
    tbo = load_scenario(BASE, TBO)
    slowed = prefill_forward(tbo, 1024, prompts=16)
    monkeypatch.setitem(compute.GEMM_CONTENTION, "h100-sxm", 1.0)
    monkeypatch.setattr(compute, "attention_contention", lambda gpu: 1.0)
    free = prefill_forward(tbo, 1024, prompts=16)
    # the parts alone are the same; the stretch shows as less saved by the overlap
    assert slowed.linear_s == free.linear_s and slowed.attention_s == free.attention_s
    assert slowed.total_s > free.total_s
    # [P] x1.056 a matmul (DeepSeek's trace), [C] 132 / 112 the attention (20 SMs held):
    # no more than every matmul and all the attention slowed the whole time
    stretch = 0.056 * slowed.linear_s + (132 / 112 - 1) * slowed.attention_s
    assert slowed.total_s - free.total_s <= stretch
    assert slowed.overlap_s > 0
