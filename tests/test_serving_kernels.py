"""shared/serving/kernels.py and the issue-35 mechanisms of the serving model, by hand:
kernels a layer launches, the all-reduce's latency by link and group, the LM head on
a prompt's last token, FP8 attention, and a speculative step's draft + verify."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstage.shared.scenario import ScenarioError, load_scenario
from kvstage.shared.serving.compute import decode_step, prefill_forward
from kvstage.shared.serving.kernels import (
    allreduce_latency_s,
    kernel_floor_s,
    kernels_per_layer,
)

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "scenarios" / "llama3-8b-p4-d2.toml"


def load(*sets: str):
    return load_scenario(BASE, ['transfer.path="slice"', *sets])


def test_kernels_per_layer_follow_the_architecture():
    assert kernels_per_layer(load()) == 10  # dense GQA, BF16
    assert kernels_per_layer(load("model.preset=mixtral-8x7b")) == 14  # + 4 routed-expert
    # DeepSeek-V3 FP8: 10 + 4 (routed) + 3 (shared experts) + 5 (MLA) + one FP8
    # quantization per dense GEMM: 4 + 2 (shared) + 3 (MLA's extra) = 9
    ds = load("model.preset=deepseek-v3", "model.weight_dtype=fp8", "decode.ep=16",
              "prefill.tp=8", "decode.tp=8", "decode.gpu=h200", "prefill.gpu=h200")  # fmt: skip
    assert kernels_per_layer(ds) == 31
    assert kernel_floor_s(ds) == pytest.approx(61 * 31 * 5e-6)


def test_allreduce_latency_grows_with_the_group_and_is_larger_over_pcie():
    nvlink = load("decode.gpu=h100-sxm")
    pcie = load("decode.gpu=l40s", "prefill.gpu=l40s")
    assert allreduce_latency_s(nvlink, "decode", 1) == 0.0
    assert allreduce_latency_s(nvlink, "decode", 2) == pytest.approx(6e-6)
    assert allreduce_latency_s(nvlink, "decode", 8) == pytest.approx(6e-6 + 6 * 3.95e-6)
    assert allreduce_latency_s(pcie, "decode", 8) == pytest.approx(48e-6)
    assert allreduce_latency_s(pcie, "decode", 4) > allreduce_latency_s(nvlink, "decode", 4)


def test_a_pcie_decode_step_pays_more_for_each_further_gpu():
    """Llama-3-8B at batch 1: going from TP2 to TP4 adds more all-reduce time to a step
    over PCIe (L40S) than over NVLink (H100), 2 per layer x the latencies above."""
    ar = {}
    for gpu in ("l40s", "h100-sxm"):
        for tp in (2, 4):
            s = load(f"decode.gpu={gpu}", f"prefill.gpu={gpu}", f"decode.tp={tp}",
                     f"prefill.tp={tp}")  # fmt: skip
            ar[gpu, tp] = decode_step(s, 1, 2000).allreduce_s
            assert ar[gpu, tp] >= 2 * 32 * allreduce_latency_s(s, "decode", tp)
    pcie, nvlink = ar["l40s", 4] - ar["l40s", 2], ar["h100-sxm", 4] - ar["h100-sxm", 2]
    assert pcie > 1.5 * nvlink


def test_the_lm_head_runs_on_each_prompts_last_token_only():
    s = load()
    table = 128256 * 4096
    one, two = prefill_forward(s, 4096), prefill_forward(s, 2048, prompts=2)
    # same tokens, one more sequence: one more LM head row, 2 x table / tp FLOPs
    assert two.linear_flops - one.linear_flops == pytest.approx(2 * table / 4)
    assert one.linear_flops == pytest.approx(2 * ((8e9 - 2 * table) * 4096 + table) / 4)


def test_fp8_attention_runs_at_flashattention3s_fp8_ratio():
    bf16 = prefill_forward(load(), 8192, 8192)
    fp8 = prefill_forward(load("model.kv_dtype=fp8"), 8192, 8192)
    assert bf16.attention_s / fp8.attention_s == pytest.approx(1200 / 740)
    # no FP8 tensor cores (A100): the BF16 rate
    a100 = ("prefill.gpu=a100-80g", "decode.gpu=a100-80g")
    assert prefill_forward(load(*a100, "model.kv_dtype=fp8"), 8192, 8192).attention_s == (
        pytest.approx(prefill_forward(load(*a100), 8192, 8192).attention_s)
    )


def test_h20_attention_runs_at_flashmlas_measured_share_of_its_peak():
    # FlashMLA's BF16 decode on H20 at DeepSeek's DP-attention MTP shape (b 128, s_q 2,
    # 4,096 keys, 128 heads): 123 of 148 TFLOP/s (deepseek-ai/FlashMLA issue #30)
    from kvstage.shared.serving.compute import attention_flops
    from kvstage.shared.serving.gpus import DEFAULT_EFFICIENCY, GPUS

    h20 = GPUS["h20"]
    assert DEFAULT_EFFICIENCY.attention_rate(h20, "bf16", 4864) == pytest.approx(123e12)
    # FP8 attention on it: that rate x FlashAttention-3's FP8 ratio, never below BF16
    fp8 = DEFAULT_EFFICIENCY.attention_rate(h20, "fp8", 4864)
    assert fp8 == pytest.approx(123e12 * 1200 / 740)
    # a GPU without a curve of its own keeps the default share
    h100 = GPUS["h100-sxm"]
    assert DEFAULT_EFFICIENCY.attention_rate(h100, "bf16", 4864) == pytest.approx(0.5 * 989e12)
    # and a decode step prices its MLA attention at that rate
    s = load_scenario(
        BASE,
        [
            'transfer.path="slice"',
            "model.preset=deepseek-v3",
            "model.weight_dtype=fp8",
            "prefill.gpu=h20",
            "prefill.tp=1",
            "prefill.ep=16",
            "decode.gpu=h20",
            "decode.tp=1",
            "decode.ep=16",
        ],
    )
    step = decode_step(s, 32, 32 * 4864)
    flops = attention_flops(s, 32, 32 * 4864, decode=True)
    assert step.attention_s == pytest.approx(flops / 123e12)


def test_a_speculative_step_costs_draft_plus_verify():
    plain = load()
    spec = load('decode.speculative.method="eagle"', "decode.speculative.draft_tokens=4",
                "decode.speculative.accept_length=2.5")  # fmt: skip
    p, q = decode_step(plain, 1, 2000), decode_step(spec, 1, 2000)
    assert q.draft_s > 0 and p.draft_s == 0
    # three draft forwards of one layer and the LM head, each at least its kernels
    assert q.draft_s >= 3 * (10 + 2) * 5e-6
    # the verify reads the same weights and KV, with 4 queries a request
    assert q.weight_bytes == p.weight_bytes and q.kv_bytes == p.kv_bytes
    assert q.flops == pytest.approx(4 * p.flops)
    assert q.total_s > p.total_s  # dearer a step...
    assert q.total_s / 2.5 < p.total_s  # ...cheaper a token at batch 1
    # at a large batch the verify's FLOPs dominate: speculation no longer pays
    big_p, big_q = decode_step(plain, 256, 256 * 2000), decode_step(spec, 256, 256 * 2000)
    assert big_q.total_s / 2.5 > 0.5 * big_p.total_s


def test_four_bit_weights_carry_their_scales_and_run_where_the_gpu_can():
    """int4 (GPTQ / AWQ, group 128: FP16 scale + 4-bit zero) and fp4 (NVFP4, an FP8 scale
    per 16): bytes per weight with the scales; int4 multiplies at the BF16 rate, fp4 at
    the native FP4 rate on Blackwell and, weight-only through CUDA's FP4 Marlin kernel,
    at BF16's elsewhere; a GPU with neither (ROCm) is refused."""
    from kvstage.shared.serving.gpus import GPUS

    int4 = load("model.weight_dtype=int4")
    assert int4.model.weight_bytes == pytest.approx(8e9 * (4 + 20 / 128) / 8)
    fp4 = load("model.weight_dtype=fp4")
    assert fp4.model.weight_bytes == pytest.approx(8e9 * 4.5 / 8)
    assert GPUS["h100-sxm"].peak_flops("int4") == 989e12
    assert GPUS["h100-sxm"].peak_flops("fp4") == 989e12  # W4A16: BF16 activations
    assert GPUS["b200"].peak_flops("fp4") == 9000e12
    assert GPUS["a100-80g"].peak_flops("fp4") == 312e12
    with pytest.raises(ScenarioError, match="FP4 weights run natively"):
        load("model.weight_dtype=fp4", "decode.gpu=mi300x")
    # a decode step at batch 1 reads about a quarter of the BF16 bytes
    bf16 = decode_step(load(), 1, 1000)
    assert decode_step(int4, 1, 1000).weight_bytes < 0.27 * bf16.weight_bytes
    with pytest.raises(ScenarioError, match="weight_dtype"):
        load("model.weight_dtype=int3")
