"""shared/serving/ep_balance.py: a MoE layer waits for its busiest expert-parallel rank."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from kvstage.shared.scenario import load_scenario
from kvstage.shared.serving.compute import alltoall_parts, decode_step, prefill_forward
from kvstage.shared.serving.ep_balance import (
    busiest_rank,
    expected_max_normal,
    imbalance,
    slot_cv,
)

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "scenarios" / "llama3-8b-p4-d2.toml"
DSV3 = [
    'transfer.path="slice"',
    "model.preset=deepseek-v3",
    "model.weight_dtype=fp8",
    "prefill.tp=1",
    "prefill.ep=32",
    "decode.tp=1",
    "decode.ep=72",
]


def test_expected_maximum_of_normals_matches_its_closed_forms():
    """E[max] of 2 standard normals is 1/sqrt(pi), of 3 it is 3 / (2 sqrt(pi))."""
    assert expected_max_normal(1) == 0.0
    assert expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-6)
    assert expected_max_normal(3) == pytest.approx(3 / (2 * math.sqrt(math.pi)), rel=1e-6)
    assert expected_max_normal(72) > expected_max_normal(16) > expected_max_normal(8)


def test_the_skew_reproduces_the_published_measurements_it_came_from():
    """TensorRT-LLM's wide-EP README: DeepSeek-R1 at 1,024 copies a rank, 8 slots a
    rank; EP32 without EPLB 1.564, EP36 with it 0.115 (imbalance = max / mean - 1)."""
    assert imbalance(1024, 32, slot_cv(False) / math.sqrt(8)) == pytest.approx(1.564)
    assert imbalance(1024, 36, slot_cv(True) / math.sqrt(8)) == pytest.approx(0.115)
    assert slot_cv(True) < slot_cv(False) / 10


def test_the_random_part_matches_a_multinomial_draw():
    """Uniform routing: 4,096 copies over 16 ranks, the busiest rank's excess over the
    mean, drawn, within 10% of the formula's (the normal approximation)."""
    rng = random.Random(35)
    ranks, copies, trials, excess = 16, 4096, 300, 0.0
    for _ in range(trials):
        load = [0] * ranks
        for _ in range(copies):
            load[rng.randrange(ranks)] += 1
        excess += max(load) / (copies / ranks) - 1
    assert imbalance(copies / ranks, ranks, 0.0) == pytest.approx(excess / trials, rel=0.1)


def test_no_expert_parallelism_no_imbalance_and_eplb_lowers_it():
    dense = load_scenario(BASE, [])
    assert busiest_rank(dense, "decode", 256) == 1.0
    tp8 = ["decode.tp=8", "prefill.tp=8", "prefill.gpu=h200", "decode.gpu=h200"]
    tp_experts = load_scenario(BASE, [*DSV3[:3], *tp8])
    assert busiest_rank(tp_experts, "decode", 256) == 1.0  # every rank a slice of each
    on = load_scenario(BASE, DSV3)
    off = load_scenario(BASE, [*DSV3, "decode.eplb=false", "prefill.eplb=false"])
    for tokens in (1, 16, 256):
        assert 1.0 < busiest_rank(on, "decode", tokens) < busiest_rank(off, "decode", tokens)
    # more tokens average the batch's randomness out; the skew stays
    assert busiest_rank(on, "decode", 1) > busiest_rank(on, "decode", 256) > 1.05
    assert busiest_rank(on, "decode", 1) <= 72  # all copies on one rank at most


def test_the_busiest_rank_slows_the_step_and_the_forward():
    """The expert matmuls, the expert weights read and the all-to-all are the busiest
    rank's: without EPLB a step and a forward take longer, the dense part unchanged."""
    on = load_scenario(BASE, DSV3)
    off = load_scenario(BASE, [*DSV3, "decode.eplb=false", "prefill.eplb=false"])
    a, b = decode_step(on, 256, 256 * 2000), decode_step(off, 256, 256 * 2000)
    assert b.alltoall_s / a.alltoall_s == pytest.approx(
        busiest_rank(off, "decode", 256) / busiest_rank(on, "decode", 256)
    )
    assert b.linear_s > a.linear_s and b.attention_s == a.attention_s
    assert b.total_s > a.total_s
    small_on, small_off = decode_step(on, 1, 2000), decode_step(off, 1, 2000)
    assert small_off.weight_bytes > small_on.weight_bytes  # more of the busiest's experts
    assert prefill_forward(off, 4096).total_s > prefill_forward(on, 4096).total_s
    d_on, _ = alltoall_parts(on, "prefill", 4096)
    d_off, _ = alltoall_parts(off, "prefill", 4096)
    assert d_off > d_on


def test_eplb_is_a_boolean_per_side():
    with pytest.raises(Exception, match="eplb"):
        load_scenario(BASE, [*DSV3, 'decode.eplb="sometimes"'])
