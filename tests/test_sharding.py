"""shared/serving/sharding.py: the weights every TP rank holds whole (MLA's fused q_a /
kv_a projection, the MoE router), by hand from the models' config.json numbers."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstage.shared.scenario import load_scenario
from kvstage.shared.serving.compute import prefill_forward, vocab_params, weight_bytes
from kvstage.shared.serving.memory import expert_split, weights_per_gpu_bytes
from kvstage.shared.serving.sharding import replicated_params

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "scenarios" / "llama3-8b-p4-d2.toml"

# [P] DeepSeek-V3 config.json: 61 layers, hidden 7168, q_lora_rank 1536, kv_lora_rank
# 512, qk_rope_head_dim 64, 256 routed experts
DS_WHOLE = 61 * 7168 * (1536 + 512 + 64) + 61 * 7168 * 256


def load(*sets: str):
    return load_scenario(BASE, ['transfer.path="slice"', *sets])


def deepseek(tp: int):
    return load("model.preset=deepseek-v3", "model.weight_dtype=fp8", "prefill.gpu=h200",
                "decode.gpu=h200", f"prefill.tp={tp}", f"decode.tp={tp}")  # fmt: skip


def test_what_each_model_replicates():
    assert replicated_params(deepseek(8)) == DS_WHOLE  # 0.92 B + 0.11 B
    assert replicated_params(load("model.preset=mixtral-8x7b")) == 32 * 4096 * 8  # router
    assert replicated_params(load()) == 0  # dense GQA: every matmul split


def test_a_tp8_rank_holds_the_replicated_weights_whole():
    s = deepseek(8)
    dense, e = expert_split(s)
    # FP8: one byte a parameter; the experts split over the 8 GPUs as before
    expected = (dense - DS_WHOLE) / 8 + DS_WHOLE + 256 * e / 8
    assert weights_per_gpu_bytes(s, "prefill") == pytest.approx(expected)
    # 0.9 GB more on each GPU than splitting everything would give
    assert weights_per_gpu_bytes(s, "prefill") - (dense + 256 * e) / 8 == pytest.approx(
        DS_WHOLE * 7 / 8
    )


def test_a_tp8_forward_multiplies_the_replicated_weights_whole():
    s = deepseek(8)
    dense, e = expert_split(s)
    embed, head, table = vocab_params(s)
    f = prefill_forward(s, 1600)
    split = (dense - embed - head - DS_WHOLE) / 8
    expected = 2 * ((split + DS_WHOLE) * 1600 + table / 8) + 2 * 8 * e * 1600 / 8
    assert f.linear_flops == pytest.approx(expected)


def test_a_decode_step_reads_the_replicated_weights_whole():
    s = deepseek(8)
    dense, _ = expert_split(s)
    embed, _, _ = vocab_params(s)
    dense_bytes, _ = weight_bytes(s, "decode", 1)
    assert dense_bytes == pytest.approx((dense - embed - DS_WHOLE) / 8 + DS_WHOLE)


def test_tp1_is_unchanged():
    s = deepseek(8)
    one = load("model.preset=deepseek-v3", "model.weight_dtype=fp8", "prefill.tp=1",
               "prefill.ep=32", "decode.tp=1", "decode.ep=32")  # fmt: skip
    dense, e = expert_split(one)
    assert weights_per_gpu_bytes(one, "prefill") == pytest.approx(dense + 256 * e / 32)
    assert replicated_params(one) == replicated_params(s)
