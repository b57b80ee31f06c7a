"""Physical bounds of the serving model (issue 22), checked by hand from datasheets.

Every expected number here is computed in the test from the datasheet figures written
below (not read from shared/serving/gpus.py) and the models' published config.json
numbers, so a wrong catalogue entry or formula in the code under test fails here:

- a decode step never beats its FLOP floor (2 x active params x B / tp / peak) nor its
  HBM floor (the weights it must read + the batch's KV, over the datasheet HBM);
- a prefill forward, alone or packed with others, never beats peak FLOPs (nor a packed
  one its weights' HBM floor); an all-reduce never beats the link;
- weights never exceed memory in any configuration `validate` (and so `plan`) accepts;
- attention makes a 126k-token prompt cost more per token than a 1k prompt;
- a MoE model's decode step at batch 1 reads only the experts one token picks.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstage.shared.scenario import ScenarioError, load_scenario
from kvstage.shared.serving.compute import (
    allreduce_s,
    decode_step,
    packed_forward,
    prefill_forward,
    prefill_forward_s,
)
from kvstage.shared.serving.decode_model import DecodeModel

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "scenarios" / "llama3-8b-p4-d2.toml"
GIB = 1 << 30

# [D] the datasheets (gpus.py cites the same pages): memory GiB, HBM GB/s, dense BF16
# and FP8 TFLOP/s (FP8 absent: the BF16 rate), scale-up GB/s per direction
SHEET = {
    "a10": (24, 600, 125, 125, 32),
    "a100-80g": (80, 2039, 312, 312, 300),
    "h100-sxm": (80, 3350, 989, 1979, 450),
    "h200": (141, 4800, 989, 1979, 450),
    "b200": (180, 8000, 2250, 4500, 900),
    "l40s": (48, 864, 362, 733, 32),
    "h20": (96, 4000, 148, 296, 450),
    "mi300x": (192, 5300, 1307.4, 2614.9, 448),
    # issue 35: H800 (the Ant Group / LMSYS table), H20 141 GB ([A] the H200's HBM),
    # L40 (NVIDIA's datasheet), GB200 (the NVL72 rack's figures / 72, sparsity halved)
    "h800": (80, 3352, 989, 1979, 200),
    "h20-141g": (141, 4800, 148, 296, 450),
    "l40": (48, 864, 181, 362, 32),
    "gb200": (186, 8000, 2500, 5000, 900),
}
# [P] config.json / model cards: params, active params, layers, KV heads x head_dim,
# MLA latent, hidden, weight dtype
MODELS = {
    "llama-3-8b": (8.0, 8.0, 32, 8 * 128, 0, 4096, "bf16"),
    "llama-3-70b": (70.6, 70.6, 80, 8 * 128, 0, 8192, "bf16"),
    "qwen3-30b-a3b": (30.5, 3.3, 48, 4 * 128, 0, 2048, "bf16"),
    "mixtral-8x7b": (46.7, 12.9, 32, 8 * 128, 0, 4096, "bf16"),
    "deepseek-v3": (671.0, 37.0, 61, 0, 576, 7168, "fp8"),
}
TPS = (1, 2, 4, 8)


def scenario(model: str, gpu: str, tp: int, *extra: str):
    """A scenario of `model` on `gpu` at prefill and decode TP `tp`, or None where
    validate refuses it (weights or one chunk of KV do not fit)."""
    dtype = MODELS[model][6]
    sets = [
        f"model.preset={model}",
        f"model.weight_dtype={dtype}",
        f"prefill.gpu={gpu}",
        f"decode.gpu={gpu}",
        f"prefill.tp={tp}",
        f"decode.tp={tp}",
        'transfer.path="slice"',
        *extra,
    ]
    try:
        return load_scenario(BASE, sets)
    except ScenarioError:
        return None


def fitting():
    for model in MODELS:
        for gpu in SHEET:
            for tp in TPS:
                s = scenario(model, gpu, tp)
                if s is not None:
                    yield model, gpu, tp, s


CASES = list(fitting())


def test_some_of_every_model_and_gpu_fit():
    assert {m for m, *_ in CASES} == set(MODELS)
    assert {g for _, g, *_ in CASES} == set(SHEET)


def _peak(gpu: str, dtype: str) -> float:
    return SHEET[gpu][3 if dtype == "fp8" else 2] * 1e12


def _kv_per_token(model: str, tp: int) -> float:
    """KV bytes of one token on one rank: K and V of its heads (GQA heads are not
    split below one per rank), or the MLA latent whole on every rank."""
    _, _, layers, kv, latent, _, _ = MODELS[model]
    if latent:
        return layers * latent * 2
    heads = kv // 128
    return layers * 2 * max(1, heads // tp) * 128 * 2


@pytest.mark.parametrize(("model", "gpu", "tp", "s"), CASES, ids=lambda v: str(v)[:20])
def test_weights_never_exceed_memory(model, gpu, tp, s):
    params, *_, dtype = MODELS[model]
    per = 1 if dtype == "fp8" else 2
    usable = SHEET[gpu][0] * GIB * 0.9
    assert params * 1e9 * per / tp <= usable  # ep = 1: every weight split over TP


def test_what_does_not_fit_is_refused_in_words():
    with pytest.raises(ScenarioError, match=r"131.5 GiB of weights per GPU > 72 GiB usable"):
        load_scenario(BASE, ["model.preset=llama-3-70b", "prefill.tp=1", "decode.tp=2"])
    # DeepSeek-V3 in fp8 at TP4 on H200: 671 GB / 4 = 156 GiB > 126.9 usable
    assert scenario("deepseek-v3", "h200", 4) is None
    assert scenario("deepseek-v3", "h200", 8) is not None


@pytest.mark.parametrize(("model", "gpu", "tp", "s"), CASES, ids=lambda v: str(v)[:20])
def test_a_decode_step_never_beats_its_flop_or_hbm_floor(model, gpu, tp, s):
    params, active, *_, dtype = MODELS[model]
    per = 1 if dtype == "fp8" else 2
    m = DecodeModel(s)
    for batch, context in ((1, 1000), (32, 4000), (256, 2000)):
        kv = batch * context
        step = m.step_time_s(kv, batch)
        assert step >= 2 * active * 1e9 * batch / tp / _peak(gpu, dtype)
        # HBM: at least the active weights of one token (all of a dense model's) and
        # the batch's KV cross the HBM once
        floor = (active * 1e9 * per / tp + kv * _kv_per_token(model, tp)) / (SHEET[gpu][1] * 1e9)
        assert step >= floor
        if params == active:  # dense: every weight, every step
            assert step >= (params * 1e9 * per / tp) / (SHEET[gpu][1] * 1e9)


@pytest.mark.parametrize(("model", "gpu", "tp", "s"), CASES, ids=lambda v: str(v)[:20])
def test_a_prefill_forward_never_beats_peak_flops(model, gpu, tp, s):
    _, active, layers, _, _, hidden, dtype = MODELS[model]
    for tokens, context in ((128, 0), (8192, 0), (8192, 32768)):
        f = prefill_forward(s, tokens, context)
        assert f.total_s >= 2 * active * 1e9 * tokens / tp / _peak(gpu, dtype)
        assert prefill_forward_s(s, tokens, context) == f.total_s
    if tp > 1:  # two all-reduces a layer of 8192 x hidden x 2 B, ring 2 (n-1)/n
        link = SHEET[gpu][4] * 1e9
        nbytes = 8192 * hidden * 2 * 2 * (tp - 1) / tp
        assert allreduce_s(s, "prefill", 8192) >= 2 * layers * nbytes / link


@pytest.mark.parametrize(("model", "gpu", "tp", "s"), CASES, ids=lambda v: str(v)[:20])
def test_a_packed_prefill_forward_never_beats_peak_flops_or_hbm(model, gpu, tp, s):
    """Prompts packed into one forward (shared/serving/prefill_batch.py): its matmuls
    never beat the peak over all its tokens, nor its weights the HBM (read at least
    once: the active parameters of one token, all of a dense model's)."""
    params, active, *_, dtype = MODELS[model]
    per = 1 if dtype == "fp8" else 2
    for chunks in ([(512, 0)] * 16, [(1024, 0), (256, 4096), (2048, 0), (96, 0)]):
        tokens = sum(t for t, _ in chunks)
        f = packed_forward(s, chunks)
        assert f.total_s >= 2 * active * 1e9 * tokens / tp / _peak(gpu, dtype)
        assert f.total_s >= active * 1e9 * per / tp / (SHEET[gpu][1] * 1e9)
        if params == active:
            assert f.total_s >= params * 1e9 * per / tp / (SHEET[gpu][1] * 1e9)


def test_prefill_attention_is_quadratic_in_the_context():
    """Llama-3-8B at TP1: a 126k-token prompt, chunk by chunk, costs more per token
    than a 1k prompt, by the attention FLOPs worked out here."""
    s = scenario("llama-3-8b", "h100-sxm", 1)
    chunk, n = 8192, 126 * 1024
    long = sum(prefill_forward_s(s, min(chunk, n - p), p) for p in range(0, n, chunk)) / n
    short = prefill_forward_s(s, 1024) / 1024
    assert long > 1.5 * short
    # by hand: 4 x layers x heads x head_dim x sum over query tokens of keys seen
    keys = n * (n + 1) / 2
    flops = 4 * 32 * 32 * 128 * keys
    f = [prefill_forward(s, min(chunk, n - p), p) for p in range(0, n, chunk)]
    assert sum(x.attention_flops for x in f) == pytest.approx(flops, rel=1e-9)
    assert sum(x.attention_s for x in f) >= flops / 989e12  # never beats the peak


def test_a_moe_decode_step_reads_only_the_experts_it_picks():
    """DeepSeek-V3 fp8 on 8 H200 (TP8, experts split over TP): at batch 1 the step reads
    A / 8 of weights (the dense part and 8 of 256 experts; the replicated q_a / kv_a
    projection and router whole), at batch 256 nearly all."""
    s = scenario("deepseek-v3", "h200", 8)
    one, full = decode_step(s, 1, 2000), decode_step(s, 256, 256 * 2000)
    # P = D + 256 e, A = D + 8 e: e = (671 - 37) / 248 = 2.556e9, D = 16.55e9
    e = (671e9 - 37e9) / 248
    d = 37e9 - 8 * e - 129280 * 7168  # the embedding is a lookup, not read whole
    # on every rank whole: 7168 x (1536 + 512 + 64) (q_a / kv_a) + 7168 x 256 (router)
    whole = 61 * 7168 * (1536 + 512 + 64 + 256)
    dense = (d - whole) / 8 + whole
    assert one.weight_bytes == pytest.approx(dense + e)  # 1 B a weight, 8 / 8 experts
    touched = 256 * (1 - (1 - 8 / 256) ** 256)  # expected distinct experts at batch 256
    assert full.weight_bytes == pytest.approx(dense + touched * e / 8)
    assert touched > 250
    m = DecodeModel(s)
    assert m.step_time_s(2000, 1) < 0.5 * m.step_time_s(256 * 2000, 256)


def test_expert_parallelism_divides_the_experts_and_pays_the_all_to_all():
    """DeepSeek-V3 fp8 at TP1 with EP32 (DP attention over 32 GPUs): one GPU holds the
    dense part and 8 of the 256 experts; each token's 8 copies cross NVLink to the 7
    other GPUs of its node and the NIC once per other node it picks."""
    s = scenario("deepseek-v3", "h200", 8, "prefill.gpu=h100-sxm", "prefill.tp=1", "prefill.ep=32")
    assert s is not None
    from kvstage.shared.serving.compute import alltoall_s
    from kvstage.shared.serving.memory import weights_per_gpu_bytes

    e = (671e9 - 37e9) / 248
    d = 37e9 - 8 * e
    assert weights_per_gpu_bytes(s, "prefill") == pytest.approx(d + 256 / 32 * e)
    per_copy = 7168 * (1 + 2)  # FP8 dispatch + BF16 combine
    nvlink = 8 * 7 / 32 * per_copy / (450e9 * 0.8)
    nic = 3 * (1 - (3 / 4) ** 8) * per_copy / (370e9 / 8)  # rdma-400g: 370 Gb/s a GPU
    # the layer waits for the busiest EP rank (EPLB's residual skew and the batch's own
    # randomness, shared/serving/ep_balance.py): never below the mean rank's time
    from kvstage.shared.serving.ep_balance import busiest_rank

    busiest = busiest_rank(s, "prefill", 1000)
    assert 1.0 < busiest < 1.2
    assert alltoall_s(s, "prefill", 1000) == pytest.approx(1000 * 61 * (nvlink + nic) * busiest)
    with pytest.raises(ScenarioError, match="ep must be 1 or a multiple of tp"):
        load_scenario(BASE, ["prefill.ep=3"])
    with pytest.raises(ScenarioError, match="expert parallelism needs a MoE model"):
        load_scenario(BASE, ["prefill.ep=4"])


def test_the_summary_names_the_gpus_and_efficiencies_it_used():
    from kvstage.run.summary import simulation_summary
    from kvstage.sim.driver import simulate

    s = load_scenario(BASE, ["workload.requests=2", "decode.gpu=h200", "decode.hbm_efficiency=0.7"])
    fig = simulation_summary(s, simulate(s))["serving_model"]
    assert (fig["prefill_gpu"], fig["decode_gpu"]) == ("h100-sxm", "h200")
    # 8,192-token chunks, BF16 on an H100: the GPU's own table (cuBLAS, vLLM PR 23939),
    # halfway in log2 between M = 4,096 (711.45 TFLOP/s) and 16,384 (714.78)
    assert fig["prefill_mfu_at_chunk"] == pytest.approx((711.45 + 714.78) / 2 / 989)
    assert fig["decode_hbm_efficiency"] == 0.7 and fig["step_overhead_ms"] == 1.0


def test_an_ada_fp8_forward_runs_at_its_gpus_measured_gemm_rate():
    """FP8 weights on an L40S / L40: the dense matmuls at the GPU's own published FP8
    GEMM rate (cuBLASLt on an L40S at Llama 2 7B's shapes, 373.4 TFLOP/s from 512 rows,
    vLLM PR 6677; SGLang's CUTLASS kernel on an L40, 281.0 TFLOP/s from 2,048 rows,
    sglang PR 3047), under the datasheet's FP8 peak; a MoE's grouped GEMMs keep the
    default curve (a dense GEMM's rate is not a grouped one's)."""
    from kvstage.shared.serving.gpus import efficiency

    for gpu, tflops in (("l40s", 373.4), ("l40", 281.0)):
        s = scenario("llama-3-8b", gpu, 1, "model.weight_dtype=fp8")
        eff = efficiency(s)
        share = eff.gemm_share(gpu, "fp8", 16384)
        assert share * _peak(gpu, "fp8") == pytest.approx(tflops * 1e12)
        assert share < 1 and eff.gemm_share(gpu, "fp8", 16384, grouped=True) == eff.mfu(16384)
        f = prefill_forward(s, 2048, prompts=8)
        assert f.linear_flops / f.linear_s == pytest.approx(tflops * 1e12)
        assert f.total_s > f.linear_flops / _peak(gpu, "fp8")


def test_fp8_gemms_take_the_table_of_their_scaling():
    """A per-tensor FP8 checkpoint's dense matmuls on an H100 / H200 run at kvstage's
    measured cuBLASLt rate (benchmarks/data/kernels/, 0.606 of the peak at 4,096 rows);
    DeepSeek-V3's block-scaled FP8 (its preset: config.json weight_block_size) at
    DeepGEMM's (0.533), grouped or dense; a per-tensor MoE's grouped GEMMs, with no
    per-tensor grouped measurement, take DeepGEMM's; both under the FP8 peak."""
    from kvstage.shared.serving.compute import gemm_dtype
    from kvstage.shared.serving.gpus import efficiency

    llama = scenario("llama-3-8b", "h100-sxm", 1, "model.weight_dtype=fp8")
    ds = scenario("deepseek-v3", "h200", 8)
    assert llama.model.fp8_scaling == "tensor" and ds.model.fp8_scaling == "block"
    assert gemm_dtype(llama) == "fp8" and gemm_dtype(ds) == "fp8-block"
    eff = efficiency(llama)
    for gpu in ("h100-sxm", "h200"):
        tensor, block = eff.gemm_share(gpu, "fp8", 4096), eff.gemm_share(gpu, "fp8-block", 4096)
        assert tensor == pytest.approx(0.606) and block == pytest.approx(1054 / 1979)
        assert eff.gemm_share(gpu, "fp8", 4096, grouped=True) == block
        assert eff.gemm_share(gpu, "fp8-block", 4096, grouped=True) == block
        assert max(tensor, block) < 1
    f = prefill_forward(llama, 4096)
    assert f.linear_flops / f.linear_s <= 0.606 * _peak("h100-sxm", "fp8") * (1 + 1e-9)
    own = scenario("deepseek-v3", "h200", 8, "model.fp8_scaling=tensor")
    assert own.model.fp8_scaling == "tensor"  # a checkpoint of one's own
    with pytest.raises(ScenarioError, match="fp8_scaling") as bad:
        load_scenario(ROOT / "scenarios" / "llama3-8b-p4-d2.toml", ["model.fp8_scaling=row"])
    assert "tensor" in str(bad.value) and "block" in str(bad.value)  # what is allowed


def test_a_users_fp8_kernel_table_prices_block_scaled_fp8_too(tmp_path):
    """`[serving] kernels` rows of dtype fp8 are the user's GPU's FP8 GEMMs: a
    block-scaled model takes them before DeepGEMM's default."""
    from kvstage.shared.serving.gpus import efficiency

    csv = tmp_path / "k.csv"
    csv.write_text(
        "op,gpu,dtype,M,N,K,time_us,source\ngemm,h200,fp8,4096,4096,4096,200,a test's own figure\n"
    )
    s = scenario("deepseek-v3", "h200", 8, f'serving.kernels="{csv}"')
    want = 2 * 4096**3 / 200e-6 / _peak("h200", "fp8")
    assert efficiency(s).gemm_share("h200", "fp8-block", 4096) == pytest.approx(want)


P8D2 = ROOT / "scenarios" / "llama3-70b-p8-d2.toml"


def test_fit_serving_recovers_the_efficiencies_that_made_the_figures():
    """A throughput and a step time the model gives at MFU 0.33 and 60% of HBM fit back
    to those shares; the CLI prints the lines to paste."""
    from typer.testing import CliRunner

    from kvstage.calibrate.serving import fit_serving
    from kvstage.cli.main import app

    made = load_scenario(P8D2, ["prefill.mfu=0.33", "decode.hbm_efficiency=0.6"])
    prompt = 12000  # two chunks, the second after 8,192 tokens of context
    seconds = prefill_forward_s(made, 8192) + prefill_forward_s(made, prompt - 8192, 8192)
    step = decode_step(made, 16, 16 * 3000).total_s
    fit = fit_serving(P8D2, prefill=(prompt / seconds, prompt), decode=(step, 16, 3000))
    assert fit.prefill_mfu == pytest.approx(0.33, abs=1e-6)
    assert fit.decode_hbm_efficiency == pytest.approx(0.6, abs=1e-6)
    args = ["calibrate", "--fit-serving", str(P8D2), "--decode-step-ms", f"{step * 1e3}"]
    res = CliRunner().invoke(app, [*args, "--decode-batch", "16", "--decode-context", "3000"])
    assert res.exit_code == 0 and "[decode]\nhbm_efficiency = 0.600" in res.output
    # bad input: one line naming the option, exit 2
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2 and "--decode-batch, --decode-context missing" in res.output
    res = CliRunner().invoke(app, [*args[:3], "--decode-step-ms", "1", "--decode-batch", "1",
                                   "--decode-context", "0"])  # fmt: skip
    assert res.exit_code == 2 and "faster than the model's step at 100% of HBM" in res.output
