"""Models people deploy: presets (with their published numbers), MoE active parameters
in the forward's FLOPs, `kvstage presets` / `kvstage profiles`, and `validate`'s share
of duplicate staged bytes when prefill TP exceeds the KV head count."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvstage.analysis.layout_report import duplicate_share
from kvstage.cli.main import app
from kvstage.shared.scenario import ScenarioError, load_scenario, scaled
from kvstage.shared.scenario.presets import PRESETS
from kvstage.shared.serving.compute import (
    elementwise_bytes,
    elementwise_s,
    prefill_forward,
    prefill_forward_s,
)

SCENARIO = Path(__file__).resolve().parents[1] / "scenarios" / "llama3-8b-p4-d2.toml"
WIDE = {"COLUMNS": "300"}


def load(*sets: str):
    return load_scenario(SCENARIO, overrides=["decode.staging_pool_mb=16384", *sets])


@pytest.mark.parametrize(
    ("name", "layers", "kv_heads", "head_dim", "params", "active"),
    [
        ("llama-3-8b", 32, 8, 128, 8.0, None),
        ("llama-3-70b", 80, 8, 128, 70.6, None),
        ("llama-3-405b", 126, 8, 128, 405.0, None),
        ("qwen2.5-7b", 28, 4, 128, 7.6, None),
        ("qwen2.5-72b", 80, 8, 128, 72.7, None),
        ("qwen3-235b-a22b", 94, 4, 128, 235.0, 22.0),
        ("mixtral-8x7b", 32, 8, 128, 46.7, 12.9),
    ],
)
def test_presets_carry_the_published_numbers(name, layers, kv_heads, head_dim, params, active):
    p = PRESETS[name]
    assert (p.layers, p.kv_heads, p.head_dim, p.params_b, p.active_params_b) == (
        layers,
        kv_heads,
        head_dim,
        params,
        active,
    )
    assert p.source  # where the numbers come from


def test_moe_forward_uses_active_parameters():
    dense = load("model.preset=mixtral-8x7b", "model.active_params_b=46.7")
    moe = load("model.preset=mixtral-8x7b")
    assert moe.model.params_b == 46.7 and moe.model.active_params_b == 12.9
    # The figure moved (issue 22): the forward adds attention FLOPs and the TP
    # all-reduces, and a MoE layer's matmuls have the rows each expert receives.
    # By hand: P = D + 8 e = 46.7e9, A = D + 2 e = 12.9e9 -> e = 5.633e9, D = 1.633e9.
    e = (46.7e9 - 12.9e9) / 6
    d = 12.9e9 - 2 * e
    peak, tp, c = 989e12, 4, 8192
    # dense rows 8192: the H100's BF16 table (cuBLAS, vLLM PR 23939), halfway in log2
    # between M = 4,096 (711.45 TFLOP/s) and 16,384 (714.78); the grouped expert
    # matmuls keep the default curve: rows 8192 x 2 / 8 = 2048, log2 between the 128
    # (0.19) and 4096 (0.40) points: 0.19 + 0.8 x 0.21 = 0.358
    # issue 35: the embedding (vocab 32,000 x 4,096) is a lookup, the LM head (as
    # many) runs on the chunk's last token; 32 layers x 14 kernels (10 + 4 for the
    # routed experts) x 5 us; each all-reduce (8192 x 4096 x 2 B = 64 MiB, past the
    # custom kernel's 8 MiB) NCCL's: on 4 GPUs its 8-GPU curve at 128 MiB (412 GB/s),
    # capped at the ring's 0.8 of 450 GB/s, the latency inside the curve
    table = 32000 * 4096
    dense_flops = 2 * ((d - 2 * table) * c + table) / tp
    dense_mfu = (711.45 + 714.78) / 2 / 989
    linear = dense_flops / (peak * dense_mfu) + 2 * 2 * e * c / tp / (peak * 0.358)
    attention = 4 * 32 * 32 * 128 * c * (c + 1) / 2 / tp / (peak * 0.5)
    allreduce = 2 * 32 * (c * 4096 * 2 * 2 * 3 / 4 / (450e9 * 0.8))
    fixed = 32 * 14 * 5e-6
    # issue 35: the memory-bound kernels between the dense matmuls (priced from a GEMM
    # table, so they are not in it), 16-bit elements a token and layer: two fused
    # add + RMSNorms, 8 x 4,096 on every rank; rotary and the KV write, 2 x (4,096 + 2 x
    # 1,024) / 4; the dense MLP's activation, the dense parameters a layer beyond the
    # attention's (the router's) / 4,096 / 4; at 0.8 of the H100's 3.35 TB/s (the
    # grouped experts' activation keeps the default curve, which holds it)
    attn_params = 4096 * 6144 + 4096 * 4096
    dense_mlp = (d - 2 * table) / 32 - attn_params
    per_layer = 8 * 4096 + (2 * 6144 + dense_mlp / 4096) / tp
    elementwise = c * 32 * per_layer * 2 / (3350e9 * 0.8)
    total = linear + attention + allreduce + fixed + elementwise
    assert prefill_forward_s(moe, 8192) == pytest.approx(total, rel=1e-3)
    # every expert's FLOPs as active: the linear FLOPs grow 3.6x (46.7 / 12.9), all of
    # them dense matmuls now (a higher MFU than the grouped ones), the rest the same
    fd, fm = prefill_forward(dense, 8192), prefill_forward(moe, 8192)
    assert fd.linear_flops > 3.5 * fm.linear_flops
    assert fd.total_s > 1.5 * fm.total_s
    # a dense preset, or a preset whose params_b is given explicitly: FLOPs from params_b
    assert load().model.flops_params_b == 8.0
    assert load("model.preset=mixtral-8x7b", "model.params_b=40").model.flops_params_b == 40


def test_the_norms_and_activations_move_their_bytes():
    """Issue 35: a forward's memory-bound kernels between the matmuls (fused add +
    RMSNorm twice, rotary and the KV write, SiLU-and-mul), by their bytes at 0.8 of HBM,
    where the matmuls are priced from a GEMM kernel table."""
    one = load("model.preset=llama-3-8b", "prefill.tp=1")
    # Llama 3 8B (params_b 8.0): a layer's MLP = (8.0e9 - 2 x 128,256 x 4,096) / 32 less
    # the attention's 4,096 x 6,144 + 4,096^2; 16-bit elements a token and layer: 8 x
    # 4,096 (norms) + 2 x 6,144 (q, k, v in and out) + the MLP's parameters / 4,096
    table = 128256 * 4096
    mlp = (8.0e9 - 2 * table) / 32 - (4096 * 6144 + 4096 * 4096)
    per_token = 32 * 2 * (8 * 4096 + 2 * 6144 + mlp / 4096)
    assert elementwise_bytes(one, "prefill", 1000) == pytest.approx((1000 * per_token, 0.0))
    # the H100's BF16 GEMM table times the GEMMs alone: the bytes at 0.8 of 3.35 TB/s
    assert elementwise_s(one, "prefill", 1000) == pytest.approx(1000 * per_token / 2.68e12)
    assert prefill_forward(one, 1000).elementwise_s == elementwise_s(one, "prefill", 1000)
    # the norms run on the whole residual stream on every rank: TP4 divides the rest only
    four = load("model.preset=llama-3-8b", "prefill.tp=4")
    split = 32 * 2 * (8 * 4096 + (2 * 6144 + mlp / 4096) / 4)
    assert elementwise_bytes(four, "prefill", 1000)[0] == pytest.approx(1000 * split)
    # the default curve (Llama 3's end-to-end MFU) and a given MFU already hold them
    assert elementwise_s(load("prefill.gpu=l40s", "decode.gpu=l40s"), "prefill", 1000) == 0
    assert elementwise_s(load("prefill.mfu=0.5"), "prefill", 1000) == 0


def test_block_scaled_fp8_pays_its_casts_and_deepep_normal_its_permutation():
    """Issue 35: block-scaled FP8 GEMMs take inputs quantized per 128-element group by a
    kernel of their own (SGLang's `sglang_per_token_group_quant_fp8`: 2 B read, 1 B and a
    4 B scale a group written), and DeepEP normal mode's MoE copies each arrival to a row
    per local expert and gathers the outputs back (`ep_scatter`, `ep_gather`). DeepSeek-V3
    from its config.json: hidden 7,168, 128 heads, v 128, kv_lora 512, q_lora 1,536, 256
    experts of which 8 a token, 671B / 37B parameters, vocabulary 129,280, 61 layers."""
    h, layers, k = 7168, 61, 8
    e = (671e9 - 37e9) / (256 - 8)  # one expert's parameters, all layers
    dense = 37e9 - k * e
    attention = 7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168
    dense_mlp = (dense - 2 * 129280 * 7168) / layers - attention  # shared experts, dense MLPs
    quant = 2 + 1 + 4 / 128
    # TP8 on H200s, the experts split by TP: O's and the down projections' inputs / 8
    cast_in = (h + 1536 + 512 + 128 * 128 / 8) + (h + dense_mlp / (3 * h) / 8) + h  # a token's
    cast_copy = k * (e / layers) / (3 * h) / 8  # each copy's down projection input
    sets = [
        'transfer.path="slice"',
        "model.preset=deepseek-v3",
        "model.weight_dtype=fp8",
        "prefill.gpu=h200",
        "decode.gpu=h200",
        "decode.tp=8",
    ]
    block = load(*sets, "prefill.tp=8")
    tensor = load(*sets, "prefill.tp=8", 'model.fp8_scaling="tensor"')
    (ba, bx), (ta, tx) = (elementwise_bytes(x, "prefill", 1000) for x in (block, tensor))
    assert ba - ta == pytest.approx(1000 * layers * quant * cast_in)
    assert bx - tx == pytest.approx(1000 * layers * quant * cast_copy)
    # TP1 x EP32 with DP attention: each token arrives at 32 (1 - (31/32)^8) ranks, FP8
    # rows (1 + 4/128 B an element) copied per expert, BF16 outputs gathered per arrival
    arrivals = 32 * (1 - (31 / 32) ** 8)
    perm = h * ((arrivals + k) * (1 + 4 / 128) + (k + arrivals) * 2)
    act = 2 * 3 * k * (e / layers) / (3 * h)  # SiLU-and-mul, 16-bit (as before)
    ep = load(*sets, "prefill.tp=1", "prefill.ep=32")
    after = 1000 * layers * (act + quant * cast_copy * 8 + perm)
    assert elementwise_bytes(ep, "prefill", 1000)[1] == pytest.approx(after)
    # the permutation is the prefill's DeepEP normal mode: the decode side (TP8) has none
    decode = 1000 * layers * (act / 8 + quant * cast_copy)
    assert elementwise_bytes(ep, "decode", 1000)[1] == pytest.approx(decode)


def test_active_parameters_are_checked_scaled_and_kept():
    with pytest.raises(ScenarioError, match="active_params_b"):
        load("model.preset=mixtral-8x7b", "model.active_params_b=50")
    moe = load("model.preset=mixtral-8x7b", "hardware.scale_down.enabled=true")
    small = scaled(moe)
    assert small.model.layers == 4
    assert small.model.active_params_b == pytest.approx(12.9 * 4 / 32)
    assert small.model.params_b == pytest.approx(46.7 * 4 / 32)
    assert "active_params_b = 12.9" in moe.to_toml()


def test_duplicate_share_of_staged_bytes():
    assert duplicate_share(load()) == 0  # TP4 -> TP2, 8 heads: every head written once
    qwen = load(
        "model.preset=qwen3-235b-a22b",
        "prefill.tp=8",
        "model.weight_dtype=fp8",  # 235 GB of weights: 109 GiB per decode GPU at TP2
        "decode.gpu=h200",
        "decode.staging_pool_mb=65536",
    )
    assert duplicate_share(qwen) == 0.5  # 4 heads on 8 prefill ranks: each written twice
    tiny = load("model.preset=qwen2.5-0.5b", "prefill.tp=8", "decode.tp=1")
    assert duplicate_share(tiny) == 0.75  # 2 heads, 8 writers into one decode rank
    # decode TP > heads replicates on the decode side: each rank needs its own copy
    assert duplicate_share(load("model.preset=qwen2.5-7b", "prefill.tp=2", "decode.tp=8")) == 0
    res = CliRunner().invoke(
        app,
        [
            "validate",
            str(SCENARIO),
            "--set",
            "model.preset=qwen3-235b-a22b",
            "--set",
            "prefill.tp=8",
            "--set",
            "decode.staging_pool_mb=65536",
            "--set",
            "model.weight_dtype=fp8",
            "--set",
            "decode.gpu=h200",
        ],
        env=WIDE,
    )
    assert res.exit_code == 0, res.output
    assert "50% (prefill TP8 > 4 KV heads: 2 prefill ranks hold each head" in res.output


def test_presets_and_profiles_commands():
    res = CliRunner().invoke(app, ["presets"], env=WIDE)
    assert res.exit_code == 0, res.output
    for name in (
        "llama-3-405b",
        "qwen3-235b-a22b",
        "mixtral-8x7b",
        "huggingface.co/Qwen/Qwen2.5-72B",
        'decode.engine = "vllm-v0"',  # each decode engine's host work a step
    ):
        assert name in res.output
    res = CliRunner().invoke(app, ["profiles"], env=WIDE)
    assert res.exit_code == 0, res.output
    for name in ("rdma-400g", "tcp-25g", "nvlink", "loopback-cpu"):
        assert name in res.output
    assert "cannot load" not in res.output


def test_a_short_moe_prefill_streams_its_expert_weights():
    """A prefill matmul is no faster than reading its weights once: 16 tokens of Mixtral
    on one H200 pick nearly every expert (E (1 - (1 - k/E)^16) = 7.92 of 8), whose bytes
    take longer than their few rows' FLOPs; 8,192 tokens are FLOP-bound again."""
    from kvstage.shared.serving.compute import weight_bytes

    s = load("model.preset=mixtral-8x7b", "prefill.gpu=h200", "prefill.tp=1", "decode.gpu=h200")
    hbm = 4.8e12 * 0.8  # the H200's HBM at decode_hbm
    dense, experts = weight_bytes(s, "prefill", 16)
    assert experts == pytest.approx(8 * (1 - 0.75**16) * (46.7e9 - 12.9e9) / 6 * 2)
    short = prefill_forward(s, 16)
    # the dense matmuls at 16 rows: FLOPs at the H200's BF16 table (0.051 below 16 rows)
    table = 32000 * 4096
    d = 12.9e9 - 2 * (46.7e9 - 12.9e9) / 6
    dense_flop_s = 2 * ((d - 2 * table) * 16 + table) / (989e12 * 50.48 / 989)
    assert short.linear_s == pytest.approx(max(dense / hbm, dense_flop_s) + experts / hbm)
    long = prefill_forward(s, 8192)
    dense, experts = weight_bytes(s, "prefill", 8192)
    assert long.linear_s > 3 * (dense + experts) / hbm  # the FLOPs bind
