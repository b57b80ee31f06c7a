"""The compute model: how long a prefill forward and a decode step take on one GPU.

One home for the formulas, pure functions of a `Scenario` (the simulator, hardware
mode's `forward_delay`, the bottleneck verdict, `plan` and the benchmarks all ask
here). The GPU's datasheet numbers come from shared/serving/gpus.py (`Gpu`), the
achieved shares of them from `gpus.efficiency(s)` (gpus.Efficiency, with the
scenario's overrides).

Prefill forward of a chunk of c tokens after p tokens already in the prompt's KV:

- linear FLOPs 2 x active params x c, split over the TP group but for the weights the
  engines replicate on every rank (MLA's fused q_a / kv_a projection, the MoE router:
  shared/serving/sharding.py, whole on each GPU), less the embedding (a
  lookup, no FLOPs) and the LM head, which multiplies each sequence's last token only
  (2 x vocab x hidden per prompt in the forward; the model's vocab_size and
  tied_embeddings); the dense layers' matmuls have c rows, a MoE layer's have the
  tokens each expert receives (the group's tokens x k / E), each at the GPU's peak for
  the weight dtype x the share a matmul of that many rows reaches there
  (`Efficiency.gemm_share`: the GPU's own kernel table where one was published, else
  the default curve; `prefill.mfu` one figure for all); and no faster than streaming
  their weights once from HBM at `decode_hbm` (the dense part; the distinct experts
  the tokens pick, every one of them read once however few rows it gets): a roofline
  per matmul kind, so a short prompt on a MoE model is bound by its expert bytes;
- attention FLOPs, quadratic in the context: per query token, per head, per key,
  2 x (d_qk + d_v): 4 x layers x heads x head_dim x c x (p + c/2) / tp for MHA/GQA;
  MLA prefill runs in its MHA form (d_qk = qk_nope + qk_rope = 192, d_v = 128 in
  DeepSeek-V3) [C] SGLang's DeepseekV2 attention, forward_normal; at the BF16 peak x
  `attention_mfu` (the GPU's own `attention_tables` curve where a kernel benchmark of
  it was published: H20's), x `attention_fp8_gain` with an FP8 KV cache on a GPU with
  FP8 tensor cores (FP8 attention);
- two TP all-reduces per layer of c x hidden x 2 B (bf16 activations), ring
  2 (n-1)/n of it over the scale-up link: up to 8 MiB the engines' custom all-reduce
  at `allreduce` of the link plus the group's latency (shared/serving/kernels.py:
  NVLink or PCIe, growing with the GPUs), above it NCCL at its published bus
  bandwidth for that size and group (shared/serving/allreduce.py), not overlapped
  with compute; with DP attention (ep > tp) only the attention's one, the MoE's replaced by:
- the expert-parallel all-to-all (ep > tp): per token per MoE layer the k expert
  copies of the hidden state go out (dispatch, FP8, 1 B per element) and come back
  (combine, BF16, 2 B) [P] DeepSeek-V3 technical report, section 3.3
  (https://arxiv.org/abs/2412.19437). Copies to another GPU of the node cross the
  scale-up link; a token crosses the NIC once per other node it has experts on
  (DeepEP's normal kernels forward over NVLink inside the node [C]
  https://github.com/deepseek-ai/DeepEP README), the NIC numbers from the links
  profile. The all-to-all does not overlap compute in prefill unless
  `prefill.two_batch_overlap` (below);
- with experts placed by expert parallelism (ep > 1), the expert matmuls, the expert
  weights read and the all-to-all are the busiest EP rank's: its copies are the mean x
  `busiest_rank` (shared/serving/ep_balance.py: real routing's skew, with or without
  EPLB, and the batch's randomness), its distinct experts 1 - (1 - k/E)^(tokens x
  that), out of its share;
- the kernels' fixed costs: layers x kernels per layer x `kernel_launch_s`
  (shared/serving/kernels.py);
- the memory-bound kernels between the matmuls by their bytes (`elementwise_s`: two
  fused add + RMSNorms on the whole residual stream of every TP rank, rotary and the
  KV write, the MLP's activation) at `Efficiency.elementwise_hbm` of HBM, where the
  matmuls are priced from a GEMM kernel table (which times the GEMMs alone; the
  default curve is an end-to-end MFU that holds them). Left out of a decode step,
  whose tokens are its batch: Llama 3 8B at TP2 moves 3.9 MB a token there, 250 MB at
  batch 64 against 7.5 GB of weights a rank (3%).

Decode step of a batch of B requests holding K tokens of KV in all. Its kernels run one
after another, each overlapping its own reads and FLOPs (a roofline per kernel, not
one for the whole step: the weight matmuls cannot hide the attention's KV reads):
max(weights read / (HBM x decode_hbm), matmul FLOPs / (peak x plateau)) +
max(KV read / (HBM x decode_hbm), attention FLOPs / attention rate) + the kernels'
fixed costs + step overhead + the TP all-reduces + the all-to-all. Weights read: those
the step touches less the embedding (a lookup; dense: all of this GPU's, the
replicated ones whole (sharding.py); MoE: the
dense part plus the expected distinct experts the group's tokens pick,
E (1 - (1 - k/E)^tokens) per layer, of this GPU's share). FLOPs: as in prefill with one
token per request, every token a sequence's last (the LM head on each); the plateau is
the GPU's own table's large-matmul share where there is one, else `decode_mfu`; MLA
decodes in its absorbed form (d_qk = kv_lora_rank + qk_rope = 576, d_v = kv_lora_rank
= 512) [C] https://github.com/deepseek-ai/FlashMLA.

With `decode.speculative` a step verifies draft_tokens queries per request in one
forward (B x draft_tokens rows through the matmuls, each query attending to its
request's KV, the weights and the KV read once) after `steps` forwards of a one-layer
draft head over the batch (one layer's share of the weights plus the LM head each);
the simulator credits each request accept_length tokens a step.

Expert sizes come from params_b, active_params_b, experts and experts_per_token:
P = D + E e, A = D + k e, so e = (P - A) / (E - k) and D = A - k e. Every layer is
counted as a MoE layer ([A] DeepSeek-V3's first 3 of 61 are dense: the all-to-all is
~5% high there).

In a decode step the all-to-all is DeepEP's low-latency kernels by default
(shared/serving/deepep.py, `decode.deepep_mode`), and `decode.two_batch_overlap` runs
the step as two micro-batches on SGLang's decode schedule, one's communication under
the other's attention (`_two_batch_step`, shared/serving/decode_tbo.py). The engine's
host work a step (shared/serving/engine_step.py) adds to the GPU's time, or runs under
it where the engine overlaps it.

Pipeline parallelism on the prefill side (`prefill.pp`) takes these forwards a stage's
share at a time: shared/serving/pipeline.py.

`prefill.two_batch_overlap` runs a prefill forward as two micro-batches, one's DeepEP
dispatch and combine under the other's compute: shared/serving/prefill_tbo.py.

Left out: KV-cache quantization scales.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from kvstage.shared.serving.allreduce import allreduce_one_s
from kvstage.shared.serving.decode_tbo import HalfStages
from kvstage.shared.serving.decode_tbo import schedule_s as decode_schedule_s
from kvstage.shared.serving.deepep import low_latency_layer_s, nic_Bps
from kvstage.shared.serving.engine_step import engine_step
from kvstage.shared.serving.ep_balance import busiest_rank
from kvstage.shared.serving.gpus import WEIGHT_BYTES, efficiency, side_gpu
from kvstage.shared.serving.kernels import allreduce_latency_s, kernel_floor_s, kernels_per_layer
from kvstage.shared.serving.memory import expert_split, side_memory
from kvstage.shared.serving.prefill_tbo import (
    GEMM_CONTENTION,
    Piece,
    attention_contention,
    schedule_s,
    sm_share,
    split_chunks,
    split_halves,
)
from kvstage.shared.serving.sharding import _Q_LORA_DEFAULT, per_rank_params

if TYPE_CHECKING:
    from kvstage.shared.scenario import Scenario

__all__ = [
    "chunk_forward_s",
    "DecodeStep",
    "Forward",
    "allreduce_s",
    "alltoall_s",
    "decode_step",
    "decode_step_s",
    "describe_efficiency",
    "distinct_experts",
    "efficiency_figures",
    "gemm_dtype",
    "packed_forward",
    "packed_forward_s",
    "prefill_forward",
    "prefill_forward_s",
    "vocab_params",
    "weight_bytes",
]

ACT_BYTES = 2  # [A] activations in BF16 (all-reduce payload, combine)
DISPATCH_BYTES = 1  # [P] FP8 dispatch (DeepSeek-V3 report, section 3.3)
COMBINE_BYTES = 2  # [P] BF16 combine (same)
# [A] DeepSeek's MLA widths (qk_nope, qk_rope, v, kv_lora_rank) when a scenario gives
# attention = "mla" with no preset
_MLA_DEFAULT = (128, 64, 128, 512)


@dataclass(frozen=True, slots=True)
class Forward:
    """One prefill forward on one GPU, its parts in seconds (they add up to `total_s`)."""

    linear_flops: float
    attention_flops: float
    linear_s: float
    attention_s: float
    allreduce_s: float
    alltoall_s: float
    mfu: float  # of the dense matmuls
    fixed_s: float = 0.0  # the kernels' fixed costs (shared/serving/kernels.py)
    # two-batch overlap (shared/serving/prefill_tbo.py): the part of the two
    # micro-batches' communication and compute that ran at once (the parts above are
    # the two micro-batches' sums)
    overlap_s: float = 0.0
    # the memory-bound kernels between the matmuls (norms, residual adds, rotary and
    # the KV write, the MLP's activation) by their bytes (`elementwise_s`)
    elementwise_s: float = 0.0

    @property
    def total_s(self) -> float:
        return (
            self.linear_s
            + self.attention_s
            + self.allreduce_s
            + self.alltoall_s
            + self.fixed_s
            + self.elementwise_s
            - self.overlap_s
        )


@dataclass(frozen=True, slots=True)
class DecodeStep:
    """One decode step on one GPU. Its kernels run one after another, each reading and
    computing at once: the weight matmuls take the longer of their reads and their
    FLOPs (`linear_s`), the attention the longer of the KV's reads and its FLOPs
    (`kv_memory_s`, `attention_s`); to those the kernels' fixed costs, a speculative
    step's draft, the engine's overhead and the communication add. `memory_s` and
    `compute_s` are the step's reads and FLOPs over all its kernels (what bounds it)."""

    weight_bytes: float
    kv_bytes: float
    flops: float
    memory_s: float
    compute_s: float
    overhead_s: float
    allreduce_s: float
    alltoall_s: float
    mfu: float
    linear_s: float = 0.0
    kv_memory_s: float = 0.0
    attention_s: float = 0.0
    fixed_s: float = 0.0
    draft_s: float = 0.0
    # the engine's host work (overhead_s) runs under the GPU's (shared/serving/engine_step.py)
    host_overlapped: bool = False
    # two-batch overlap: the part of the micro-batches' communication and compute that
    # ran at once (the parts above are the two micro-batches' sums)
    overlap_s: float = 0.0

    @property
    def gpu_s(self) -> float:
        """The GPU's time: its kernels and communication, the engine's host work apart."""
        return (
            self.linear_s
            + max(self.kv_memory_s, self.attention_s)
            + self.fixed_s
            + self.draft_s
            + self.allreduce_s
            + self.alltoall_s
            - self.overlap_s
        )

    def with_host(self, gpu_s: float) -> float:
        """A step whose GPU work takes `gpu_s`, with the engine's host work: under it
        (an overlap scheduler) or after it."""
        if self.host_overlapped:
            return max(gpu_s, self.overhead_s)
        return gpu_s + self.overhead_s

    @property
    def total_s(self) -> float:
        return self.with_host(self.gpu_s)


# --------------------------------------------------------------------------- model shape


def distinct_experts(experts: int, per_token: int, tokens: float) -> float:
    """Expected distinct experts `tokens` tokens pick per layer (k of E each, uniformly):
    E (1 - (1 - k/E)^tokens)."""
    if not experts or tokens <= 0:
        return 0.0
    return experts * (1.0 - (1.0 - per_token / experts) ** tokens)


def vocab_params(s: Scenario) -> tuple[float, float, float]:
    """(embedding, LM head, vocab x hidden), in parameters: the first two as params_b
    counts them (the head 0 when tied), the third what the head multiplies a token by."""
    embed, head = s.model.vocab_params_b
    return embed * 1e9, head * 1e9, float(s.model.vocab_size * s.model.hidden)


def _cfg(s: Scenario, side: str):
    return s.prefill if side == "prefill" else s.decode


def _dp_attention(s: Scenario, side: str) -> bool:
    cfg = _cfg(s, side)
    return cfg.ep > cfg.tp and s.model.experts > 0


def _attn_dims(s: Scenario, decode: bool) -> tuple[int, int]:
    """(d_qk, d_v) per head of one attention pair."""
    m = s.model
    if m.attention != "mla":
        return m.head_dim, m.head_dim
    nope, rope, v, lora = m.mla_widths or _MLA_DEFAULT
    if decode:  # absorbed: attend over the latent (+ rope), values are the latent
        return lora + rope, lora
    return nope + rope, v


def attention_flops(s: Scenario, tokens: float, context_sum: float, decode: bool) -> float:
    """Attention FLOPs (QK^T and AV) of `tokens` query tokens whose key counts sum to
    `context_sum`, over all heads and layers (not divided by TP)."""
    dqk, dv = _attn_dims(s, decode)
    return 2.0 * (dqk + dv) * s.model.heads * s.model.layers * context_sum


# --------------------------------------------------------------------------- communication


def allreduce_s(s: Scenario, side: str, tokens: float) -> float:
    """The TP all-reduces of one forward of `tokens` tokens: 2 per layer (1 with DP
    attention, whose MoE half is an all-to-all), each of tokens x hidden x 2 B
    (shared/serving/allreduce.py: by message size and world size)."""
    tp = _cfg(s, side).tp
    if tp == 1:
        return 0.0
    per_layer = 1 if _dp_attention(s, side) else 2
    n = per_layer * s.model.layers
    return n * allreduce_one_s(s, side, tokens * s.model.hidden * ACT_BYTES, tp)


def alltoall_s(s: Scenario, side: str, tokens: float) -> float:
    """Expert-parallel dispatch + combine of `tokens` tokens on one GPU (ep > tp), every
    layer (`alltoall_parts`)."""
    return sum(alltoall_parts(s, side, tokens))


def alltoall_parts(s: Scenario, side: str, tokens: float) -> tuple[float, float]:
    """(dispatch, combine) of `tokens` tokens on one GPU (ep > tp) over all layers: k
    copies of the hidden state, FP8 out and BF16 back. DeepEP's normal kernels (prefill;
    decode with `decode.deepep_mode = "normal"`): NVLink inside the node, the NIC once
    per other node the token has experts on, on bandwidth. Its low-latency kernels
    (decode's default): shared/serving/deepep.py."""
    if not _dp_attention(s, side):
        return 0.0, 0.0
    m, ep = s.model, _cfg(s, side).ep
    busiest = busiest_rank(s, side, tokens)  # the layer waits for it (ep_balance.py)
    scale = side_gpu(s, side).scaleup_Bps * efficiency(s).allreduce
    if side == "decode" and s.decode.deepep_mode == "low_latency":  # its own table's ratio
        d, c = low_latency_layer_s(s, ep, tokens, side_gpu(s, side).scaleup_Bps)
        return m.layers * d * busiest, m.layers * c * busiest
    k = m.experts_per_token
    gpn = min(ep, s.cluster.gpus_per_node)
    nodes = math.ceil(ep / gpn)
    per_copy = m.hidden * (DISPATCH_BYTES + COMBINE_BYTES)
    nvlink_copies = k * (gpn - 1) / ep
    other_nodes = (nodes - 1) * (1.0 - (1.0 - 1.0 / nodes) ** k) if nodes > 1 else 0.0
    per_token = nvlink_copies * per_copy / scale + other_nodes * per_copy / nic_Bps(s)
    total = tokens * m.layers * per_token * busiest
    share = DISPATCH_BYTES / (DISPATCH_BYTES + COMBINE_BYTES)  # the bytes each way
    return total * share, total * (1 - share)


# --------------------------------------------------------------------------- prefill


def _linear_s(
    s: Scenario, side: str, tokens: float, sequences: float | None = None, flat: float | None = None
) -> tuple[float, float, float]:
    """(linear FLOPs on this GPU, their time, the dense matmuls' MFU) of a forward of
    `tokens` tokens of this instance in `sequences` sequences (all: every token is a
    sequence's last, as in decode); `flat`: one MFU for every matmul (decode)."""
    flops, t_dense, t_experts, mfu = linear_parts(s, side, tokens, sequences, flat)
    return flops, t_dense + t_experts, mfu


def linear_parts(
    s: Scenario,
    side: str,
    tokens: float,
    sequences: float | None = None,
    flat: float | None = None,
    sm_share: float = 1.0,
    roofline: bool | None = None,
) -> tuple[float, float, float, float]:
    """(linear FLOPs on this GPU, the dense matmuls' time, the expert matmuls' time, the
    dense matmuls' MFU) of a forward (`_linear_s`); `sm_share`: the share of the GPU's
    SMs the matmuls run on (two-batch overlap leaves DeepEP its own,
    shared/serving/prefill_tbo.py), slowing their FLOPs, not their weight reads;
    `roofline`: each kind no faster than streaming its weights (default: where no `flat`
    MFU is given; a one-batch decode step applies it to the whole step instead). With
    `prefill.tflops` the whole time is the dense part's ([A] no split given).

    The embedding is a lookup, no FLOPs; the LM head multiplies each sequence's last
    token only (an engine computes the logits it samples from)."""
    cfg, m = _cfg(s, side), s.model
    eff = efficiency(s)
    dense, e = expert_split(s)
    embed, head, table = vocab_params(s)
    seqs = tokens if sequences is None else sequences
    group_tokens = tokens * max(1, cfg.ep // cfg.tp) if _dp_attention(s, side) else tokens
    expert_rows = group_tokens * m.experts_per_token / m.experts if m.experts else tokens
    body = per_rank_params(s, dense - embed - head, cfg.tp)  # sharding.py: some whole
    d_flops = 2.0 * (body * tokens + table * seqs / cfg.tp)
    x_flops = 2.0 * m.experts_per_token * e * tokens / cfg.tp
    tflops = getattr(cfg, "tflops", None)
    if tflops is not None:  # prefill.tflops: sustained FLOP/s outright
        return d_flops + x_flops, (d_flops + x_flops) / (tflops * 1e12 * sm_share), 0.0, math.nan
    gpu = side_gpu(s, side)
    peak = gpu.peak_flops(m.weight_dtype) * sm_share
    given = getattr(cfg, "mfu", None)  # prefill.mfu: one MFU for every matmul

    def share(rows: float, grouped: bool = False) -> float:
        if flat or given:
            return flat or given
        return eff.gemm_share(gpu.name, gemm_dtype(s), max(1, round(rows)), grouped)

    mfu = share(tokens)
    t_dense = d_flops / (peak * mfu)
    t_experts = x_flops / (peak * share(expert_rows, grouped=True)) if x_flops else 0.0
    t_experts *= busiest_rank(s, side, tokens)  # the busiest EP rank's copies (ep_balance.py)
    if flat is None if roofline is None else roofline:  # a roofline per matmul kind
        hbm = gpu.hbm_Bps * eff.decode_hbm
        dense_bytes, expert_bytes = weight_bytes(s, side, tokens)
        t_dense = max(t_dense, dense_bytes / hbm)
        t_experts = max(t_experts, expert_bytes / hbm)
    return d_flops + x_flops, t_dense, t_experts, mfu


def _attention_projections(s: Scenario) -> tuple[float, float]:
    """(the projections before the attention kernel, those after it) of one layer, in
    parameters, whole (before TP splits them). GQA: QKV before, O after. MLA: q_a, q_b,
    kv_a and kv_b's key half (absorbed into the query in decode, w_kc) before, kv_b's
    value half (w_vc) and O after ([C] SGLang deepseek_v2.py `forward_absorb_prepare`,
    `forward_absorb_core`)."""
    m = s.model
    h = m.hidden
    if m.attention != "mla":
        q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
        return h * (q + 2 * kv), q * h
    nope, rope, v, lora = m.mla_widths or _MLA_DEFAULT
    q_lora, heads = m.mla_q_lora_rank or _Q_LORA_DEFAULT, m.heads
    before = h * q_lora + q_lora * heads * (nope + rope) + h * (lora + rope) + lora * heads * nope
    return before, lora * heads * v + heads * v * h


def _attention_shape(s: Scenario) -> tuple[float, float]:
    """(the q, k and v widths a token's attention computes, the attention's projection
    parameters) of one layer, whole (before TP splits them). GQA: q = heads x head_dim,
    k and v kv_heads x head_dim, the QKV and O projections; MLA in its prefill (MHA)
    form: q and k of qk_nope + qk_rope a head, v of v_head_dim, and its five projections
    (q_a, q_b, kv_a, kv_b, O)."""
    m = s.model
    before, after = _attention_projections(s)
    if m.attention != "mla":
        q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
        return q + 2 * kv, before + after
    nope, rope, v, _ = m.mla_widths or _MLA_DEFAULT
    return m.heads * (2 * (nope + rope) + v), before + after


def elementwise_bytes(s: Scenario, side: str, tokens: float) -> tuple[float, float]:
    """(around the dense matmuls, after the routed experts') bytes one GPU's memory-bound
    kernels between the matmuls move in a forward of `tokens` tokens ([C] the kernels of
    vLLM's LlamaDecoderLayer and TensorRT-LLM's Llama, shared/serving/kernels.py), at
    the activations' 16 bits, per layer and token:

    - two fused residual-add + RMSNorms, each reading the hidden state and the residual
      and writing both: 8 x hidden elements, on every rank of the TP group (the
      residual stream is whole on each after the all-reduce);
    - the attention's preprocessing (rotary on q and k, K and V written to the cache):
      reads and writes q, k and v, 2 x their widths / tp;
    - the MLP's activation: a gated one (SiLU-and-mul) reads 2 I and writes I, 3 I = its
      3 h I parameters / h; an ungated one reads and writes I, 2 I = its 2 h I / h:
      either way the MLP's parameters a token passes through / hidden, / tp. The dense
      MLP (and shared experts) in the first figure, the k routed experts' in the second.

    Block-scaled FP8 (`gemm_dtype` "fp8-block", DeepGEMM's GEMMs) adds the kernels that
    feed it: each matmul's input quantized per 128-element group by a kernel of its own,
    reading 16 bits and writing 8 and a 32-bit scale a group ([C] SGLang
    fp8_utils.py `deepgemm_w8a8_block_fp8_linear_with_fallback`: `sglang_per_token_group_quant_fp8`
    before each GEMM; ep_moe/layer.py `forward_deepgemm_contiguous`: before the experts'
    down projection): `_quantized_inputs`. A prefill's expert-parallel MoE on DeepEP's
    normal kernels adds their layout change ([C] the same `forward_deepgemm_contiguous`;
    [P] LMSYS's post, "DeepGEMM Integration": "a permutation is needed"): `ep_scatter`
    copies each received row (FP8 and its scales) to one row per local expert, and
    `ep_gather` reads the experts' BF16 outputs back into one row per received token:
    `_permuted_rows`.

    Left out: MLA's two latent norms (q_lora + kv_lora wide, under 4% of the rest in
    DeepSeek-V3) and per-tensor FP8 activation quantization, which TensorRT-LLM fuses into
    the kernel writing the GEMM's input ([A] the same bytes, 16-bit, for every weight
    dtype)."""
    m, tp = s.model, _cfg(s, side).tp
    dense, e = expert_split(s)
    embed, head, _ = vocab_params(s)
    qkv, attention = _attention_shape(s)
    dense_mlp = max(0.0, (dense - embed - head) / m.layers - attention)
    routed = m.experts_per_token * e / m.layers
    per_layer = 8 * m.hidden + (2 * qkv + dense_mlp / m.hidden) / tp
    scale = tokens * m.layers * ACT_BYTES
    around, after = scale * per_layer, scale * routed / m.hidden / tp
    if gemm_dtype(s) == "fp8-block":
        dense_in, expert_in = _quantized_inputs(s, tp, dense_mlp, routed)
        around += tokens * m.layers * QUANT_BYTES * dense_in
        after += tokens * m.layers * QUANT_BYTES * expert_in
    if side == "prefill" and _dp_attention(s, side) and m.experts:
        after += tokens * m.layers * _permuted_rows(s)
    return around, after


# [C] a per-128-group FP8 quantization (SGLang `sglang_per_token_group_quant_fp8`): reads
# BF16, writes FP8 and one FP32 scale a group of 128, bytes an element
QUANT_BYTES = 2 + 1 + 4 / 128
FP8_ROW = 1 + 4 / 128  # an FP8 element and its share of the group's scale


def _quantized_inputs(s: Scenario, tp: int, dense_mlp: float, routed: float) -> tuple[float, float]:
    """(per token, per token's expert copies) elements a layer quantizes for block-scaled
    FP8 matmuls: the attention's projection inputs (MLA's fused q_a/kv_a on the hidden
    state, q_b on q_lora, kv_b on the latent, O on heads x v / tp; GQA's QKV and O), the
    dense MLP's or shared experts' (gate-up on the hidden state, down on I / tp, gated:
    3 h I parameters), the routed experts' input once a token (quantized before its
    dispatch) and each copy's down projection input (I / tp)."""
    m, h = s.model, s.model.hidden
    if m.attention == "mla":
        _, _, v, lora = m.mla_widths or _MLA_DEFAULT
        q_lora = m.mla_q_lora_rank or _Q_LORA_DEFAULT  # as sharding.py and the FLOPs
        attention = h + q_lora + lora + m.heads * v / tp
    else:
        attention = h + m.heads * m.head_dim / tp
    mlp = h + dense_mlp / (3 * h) / tp if dense_mlp else 0.0
    experts_in = h if m.experts else 0.0
    return attention + mlp + experts_in, routed / (3 * h) / tp


def _permuted_rows(s: Scenario) -> float:
    """Bytes a token's rows move a layer through DeepEP normal mode's layout change (see
    `elementwise_bytes`): it arrives once at each EP rank holding one of its k experts
    (E(1 - (1 - 1/E)^k) ranks of E, experts spread evenly, [A] independently) and is
    copied to one row per expert there, FP8 with scales, read and written; the experts'
    BF16 outputs are read and summed into one row per arrival."""
    m, ep = s.model, s.prefill.ep
    k = m.experts_per_token
    arrivals = ep * (1.0 - (1.0 - 1.0 / ep) ** k)
    return m.hidden * ((arrivals + k) * FP8_ROW + (k + arrivals) * ACT_BYTES)


def elementwise_s(s: Scenario, side: str, tokens: float) -> float:
    """Seconds of `elementwise_bytes` at `Efficiency.elementwise_hbm` of the GPU's HBM,
    each part where the matmuls it sits between are priced from a kernel table of the
    GPU's own (gpus.py `gemm_tables`, `dense_gemm_tables`, a user's `serving.kernels`;
    the routed experts' from a table a grouped GEMM may take): those time the GEMM
    kernels alone. The default curve (`prefill_mfu`, Llama 3's end-to-end training
    MFU) and a scenario's `prefill.mfu` / `prefill.tflops` already hold what a forward
    loses outside its matmuls: nothing is added there."""
    cfg, eff = _cfg(s, side), efficiency(s)
    if getattr(cfg, "tflops", None) is not None or getattr(cfg, "mfu", None) is not None:
        return 0.0
    gpu, dtype = side_gpu(s, side), gemm_dtype(s)
    around_dense, after_experts = elementwise_bytes(s, side, tokens)
    moved = around_dense if eff.gemm_table(gpu.name, dtype) is not None else 0.0
    if after_experts and eff.gemm_table(gpu.name, dtype, grouped=True) is not None:
        moved += after_experts
    return moved / (gpu.hbm_Bps * eff.elementwise_hbm)


def gemm_dtype(s: Scenario) -> str:
    """The kind of GEMM the model's matmuls run, as `Efficiency.gemm_table` keys it: the
    weight dtype, and "fp8-block" for FP8 weights scaled per 128 x 128 block
    (`model.fp8_scaling`; a different kernel from a per-tensor FP8 GEMM)."""
    m = s.model
    return "fp8-block" if m.weight_dtype == "fp8" and m.fp8_scaling == "block" else m.weight_dtype


def attention_time_s(s: Scenario, side: str, flops: float, keys: float) -> float:
    """Seconds of `flops` attention FLOPs whose queries attend to `keys` keys each (the
    mean): at `Efficiency.attention_rate` (a kernel table's, or the default share)."""
    cfg = _cfg(s, side)
    tflops = getattr(cfg, "tflops", None)
    if tflops is not None:
        return flops / (tflops * 1e12)
    return flops / efficiency(s).attention_rate(side_gpu(s, side), s.model.kv_dtype, keys)


def prefill_forward(s: Scenario, tokens: int, context: int = 0, *, prompts: int = 1) -> Forward:
    """One prefill forward on one prefill GPU: `prompts` chunks of `tokens` tokens each,
    each after `context` tokens already in its prompt's KV. With
    `prefill.two_batch_overlap` (and an all-to-all to hide) the forward runs as two
    micro-batches (shared/serving/prefill_tbo.py)."""
    if s.prefill.two_batch_overlap and _dp_attention(s, "prefill"):
        split = split_halves(tokens, context, prompts)
        if split is not None:  # None: a forward of one token cannot split
            return _two_batch_prefill(s, split)
    # each query token i of a chunk attends to context + i + 1 keys: c (p + (c + 1) / 2)
    mean_keys = context + (tokens + 1) / 2
    return _one_batch(s, tokens * prompts, prompts, prompts * tokens * mean_keys, mean_keys)


def packed_forward(s: Scenario, chunks: Sequence[tuple[int, int]]) -> Forward:
    """One prefill forward of unequal chunks packed together (shared/serving/
    prefill_batch.py): each (tokens computed, context before them), each one sequence
    (the LM head's row). The matmuls run over all the tokens at the MFU of that many
    rows, each chunk's queries attend to its own prompt's keys (the attention kernel at
    the mean keys a query sees), the collectives carry all the tokens, and the forward
    pays its kernels once. Equal chunks: `prefill_forward(..., prompts=n)` exactly."""
    if len({(t, c) for t, c in chunks}) == 1:
        return prefill_forward(s, chunks[0][0], chunks[0][1], prompts=len(chunks))
    if s.prefill.two_batch_overlap and _dp_attention(s, "prefill"):
        split = split_chunks(chunks)
        if split is not None:
            return _two_batch_prefill(s, split)
    total = sum(t for t, _ in chunks)
    keys = sum(t * (c + (t + 1) / 2) for t, c in chunks)
    return _one_batch(s, total, len(chunks), keys, keys / total)


def packed_forward_s(s: Scenario, chunks: Sequence[tuple[int, int]]) -> float:
    """Seconds of a packed forward (`packed_forward`; `prefill.tokens_per_s` overrides
    it: the tokens over that rate). One chunk: `prefill_forward_s` exactly."""
    chunks = [(t, c) for t, c in chunks if t > 0]
    if len(chunks) == 1:
        return prefill_forward_s(s, *chunks[0])
    if not chunks:
        return 0.0
    if s.prefill.tokens_per_s is not None:
        return sum(t for t, _ in chunks) / s.prefill.tokens_per_s
    return packed_forward(s, chunks).total_s


def _one_batch(s: Scenario, total: int, sequences: int, keys: float, mean_keys: float) -> Forward:
    """A prefill forward as one batch: `total` tokens in `sequences` sequences whose
    queries attend to `keys` keys in all (`mean_keys` each)."""
    lin_flops, lin_s, mfu = _linear_s(s, "prefill", total, sequences)
    att_flops = attention_flops(s, total, keys, decode=False) / s.prefill.tp
    return Forward(
        linear_flops=lin_flops,
        attention_flops=att_flops,
        linear_s=lin_s,
        attention_s=attention_time_s(s, "prefill", att_flops, mean_keys),
        allreduce_s=allreduce_s(s, "prefill", total),
        alltoall_s=alltoall_s(s, "prefill", total),
        mfu=mfu,
        fixed_s=kernel_floor_s(s),
        elementwise_s=elementwise_s(s, "prefill", total),
    )


def _prefill_half(s: Scenario, pieces: tuple[Piece, ...]) -> tuple[Forward, float, float]:
    """One micro-batch of a two-batch forward (shared/serving/prefill_tbo.py): its parts,
    its matmuls on the SMs DeepEP leaves, and (dense matmuls' time, dispatch's)."""
    n = sum(p.total for p in pieces)
    keys = sum(p.keys for p in pieces)
    ends = sum(p.ends for p in pieces)
    flops, dense, experts, mfu = linear_parts(
        s, "prefill", n, ends, sm_share=sm_share(s.prefill.gpu)
    )
    att_flops = attention_flops(s, n, keys, decode=False) / s.prefill.tp
    dispatch, combine = alltoall_parts(s, "prefill", n)
    half = Forward(
        linear_flops=flops,
        attention_flops=att_flops,
        linear_s=dense + experts,
        attention_s=attention_time_s(s, "prefill", att_flops, keys / n),
        allreduce_s=allreduce_s(s, "prefill", n),
        alltoall_s=dispatch + combine,
        mfu=mfu,
        fixed_s=kernel_floor_s(s),
        elementwise_s=elementwise_s(s, "prefill", n),
    )
    return half, dense, dispatch


def _two_batch_prefill(s: Scenario, split: tuple[tuple[Piece, ...], ...]) -> Forward:
    """A prefill forward as two overlapped micro-batches (shared/serving/prefill_tbo.py):
    per layer each one's attention stage (attention, dense matmuls, the TP all-reduce,
    half its kernels) and expert stage (routed experts, the other half) on SGLang's
    schedule, the matmuls and the attention slower while DeepEP's kernels run beside
    them; the parts are the two micro-batches' sums alone, `overlap_s` what the overlap
    saved (the communication hidden, less the compute's slowdown beside it)."""
    layers = s.model.layers
    gemm, att = GEMM_CONTENTION.get(s.prefill.gpu, 1.0), attention_contention(s.prefill.gpu)
    halves = [_prefill_half(s, pieces) for pieces in split]
    attn, moe, dispatch, combine, attn_slow, moe_slow = [], [], [], [], [], []
    for f, dense, out in halves:
        # [A] the memory-bound kernels (`elementwise_s`) all with the attention stage and,
        # as the collectives, not slowed beside DeepEP (its slowdowns are the matmuls')
        rest = f.allreduce_s + f.elementwise_s + f.fixed_s / 2  # not slowed
        stage = f.attention_s + dense + rest
        attn.append(stage / layers)
        attn_slow.append((f.attention_s * att + dense * gemm + rest) / stage if stage else 1.0)
        experts, half_fixed = f.linear_s - dense, f.fixed_s / 2
        moe.append((experts + half_fixed) / layers)
        moe_slow.append((experts * gemm + half_fixed) / (experts + half_fixed) if experts else 1.0)
        dispatch.append(out / layers)
        combine.append((f.alltoall_s - out) / layers)
    took = schedule_s(attn, moe, dispatch, combine, layers, attn_slow, moe_slow)
    (fa, _, _), (fb, _, _) = halves
    parts = {
        name: getattr(fa, name) + getattr(fb, name)
        for name in ("linear_flops", "attention_flops", "linear_s", "attention_s",
                     "allreduce_s", "alltoall_s", "fixed_s", "elementwise_s")
    }  # fmt: skip
    summed = Forward(**parts, mfu=fa.mfu)
    return Forward(**parts, mfu=fa.mfu, overlap_s=summed.total_s - took)


def prefill_forward_s(s: Scenario, tokens: int, context: int = 0) -> float:
    """Seconds of one chunk's forward (`prefill.tokens_per_s` overrides it all)."""
    if s.prefill.tokens_per_s is not None:
        return tokens / s.prefill.tokens_per_s
    if tokens <= 0:
        return 0.0
    return prefill_forward(s, tokens, context).total_s


# --------------------------------------------------------------------------- decode


def chunk_forward_s(
    s: Scenario, tokens: int, cached_tokens: int, page_start: int, page_size: int
) -> float:
    """One chunk of a prompt (a `Forward` action): it computes `tokens - cached_tokens`
    tokens, attending to the prompt's KV before them (the earlier chunks, from page
    `page_start` on, and this chunk's cached part); 0 when all of it is cached. The
    simulator's group forward and hardware mode's `forward_delay` both take this."""
    computed = tokens - cached_tokens
    if computed <= 0:
        return 0.0
    return prefill_forward_s(s, computed, page_start * page_size + cached_tokens)


def weight_bytes(s: Scenario, side: str, tokens: float) -> tuple[float, float]:
    """(dense, expert) bytes of weights one GPU of `side` reads in a forward of `tokens`
    tokens: the dense part less the embedding (a lookup of a few rows), and the distinct
    experts the group's tokens pick of this GPU's share (every expert once per forward
    at most: a matmul streams its weights once, whatever its rows)."""
    m, cfg = s.model, _cfg(s, side)
    per = WEIGHT_BYTES[m.weight_dtype]
    dense, e = expert_split(s)
    embed, _, _ = vocab_params(s)
    experts = 0.0
    if m.experts and e:
        here = m.experts / max(cfg.tp, cfg.ep)  # experts (or expert slices) on this GPU
        group = tokens * max(1, cfg.ep // cfg.tp) if _dp_attention(s, side) else tokens
        touched = distinct_experts(m.experts, m.experts_per_token, group) / m.experts
        # the busiest EP rank's copies pick (1 - (1 - k/E)^(tokens x busiest)) of its experts
        touched = 1.0 - (1.0 - touched) ** busiest_rank(s, side, tokens)
        experts = here * touched * e * per
    return per_rank_params(s, dense - embed, cfg.tp) * per, experts


def _weights_read(s: Scenario, tokens: float) -> float:
    """Bytes of weights one decode GPU reads in a forward of `tokens` tokens."""
    return sum(weight_bytes(s, "decode", tokens))


def _draft_s(s: Scenario, batch: int, weights: float, hbm: float, plateau: float) -> float:
    """A speculative step's draft: `steps` forwards of a one-layer draft head (MTP, EAGLE)
    over the batch, each one layer's share of the weights the step reads plus the LM
    head, its FLOPs, its kernels and its all-reduces ([A] the draft layer is one of the
    target's layers; its own attention over the KV is left out, 1 / layers of the step's)."""
    spec, m, cfg, eff = s.decode.speculative, s.model, s.decode, efficiency(s)
    if spec is None or batch <= 0 or spec.method == "ngram":  # ngram drafts on the host
        return 0.0
    gpu = side_gpu(s, "decode")
    embed, head, table = vocab_params(s)
    per = WEIGHT_BYTES[m.weight_dtype]
    head_bytes = table * per / cfg.tp
    layer_bytes = max(0.0, weights - head_bytes) / m.layers + head_bytes
    body = per_rank_params(s, m.flops_params_b * 1e9 - embed - head, cfg.tp)
    flops = 2.0 * batch * (body / m.layers + table / cfg.tp)
    one = max(layer_bytes / hbm, flops / (gpu.peak_flops(m.weight_dtype) * plateau))
    one += (kernels_per_layer(s) + 2) * eff.kernel_launch_s  # + norm and head
    one += 2 * allreduce_latency_s(s, "decode", cfg.tp) + alltoall_s(s, "decode", batch) / m.layers
    return spec.draft_steps * one


def decode_step(s: Scenario, batch: int, kv_tokens: float) -> DecodeStep:
    """One decode step on one decode GPU: `batch` requests holding `kv_tokens` tokens of
    KV in all (this instance's). Each request adds one token, or with
    `decode.speculative` verifies `draft_tokens` (every query attending to its request's
    KV) after the draft head proposed them. With `decode.two_batch_overlap` (and an
    all-to-all to hide) the batch runs as two micro-batches (`_two_batch_step`)."""
    if s.decode.two_batch_overlap and batch >= 2 and _dp_attention(s, "decode"):
        return _two_batch_step(s, batch, kv_tokens)
    return _one_batch_step(s, batch, kv_tokens)


def _two_batch_step(s: Scenario, batch: int, kv_tokens: float) -> DecodeStep:
    """Two-batch overlap ([C] SGLang's --enable-two-batch-overlap): the batch split in
    two halves run on SGLang's decode schedule (shared/serving/decode_tbo.py), each
    half's dispatch in flight over its shared experts and the other's attention
    preparation, its combine over the other's attention core, the routed experts
    overlapping nothing. Each half reads the weights it touches again, each matmul kind
    the longer of its reads and its FLOPs, and pays its own kernels."""
    halves = (batch // 2, batch - batch // 2)
    q = s.decode.speculative.draft_tokens if s.decode.speculative else 1
    before, after, head = _dense_shares(s)
    layers = s.model.layers
    parts, stages = [], []
    for h in halves:
        p = _one_batch_step(s, h, kv_tokens * h / batch)
        dense, experts = _matmul_kinds(s, h * q)
        p = replace(p, linear_s=dense + experts)
        dispatch, combine = alltoall_parts(s, "decode", h * q)
        per = dense / layers  # a layer's dense matmuls
        kernels = p.fixed_s / 4 / layers  # a quarter of a layer's fixed cost a stage
        attention = (max(p.kv_memory_s, p.attention_s) + p.allreduce_s) / layers
        stages.append(
            HalfStages(
                prepare=per * before + kernels,
                core=attention + per * after + kernels,
                shared=per * (1 - before - after - head) + kernels,
                experts=experts / layers + kernels,
                dispatch=dispatch / layers,
                combine=combine / layers,
                tail=dense * head + p.draft_s,
            )
        )
        parts.append(p)
    took = decode_schedule_s(stages, layers)
    a, b = parts
    summed = ("weight_bytes", "kv_bytes", "flops", "memory_s", "compute_s", "allreduce_s",
              "alltoall_s", "linear_s", "kv_memory_s", "attention_s", "fixed_s", "draft_s")  # fmt: skip
    return DecodeStep(
        **{name: getattr(a, name) + getattr(b, name) for name in summed},
        overhead_s=a.overhead_s,
        mfu=a.mfu,
        host_overlapped=a.host_overlapped,
        overlap_s=a.gpu_s + b.gpu_s - took,
    )


def _matmul_kinds(s: Scenario, rows: float) -> tuple[float, float]:
    """(dense, expert) matmul seconds of a decode forward of `rows` rows at the decode
    plateau, each kind the longer of its weight reads and its FLOPs."""
    plateau = efficiency(s).gemm_plateau(side_gpu(s, "decode").name, gemm_dtype(s))
    _, dense, experts, _ = linear_parts(s, "decode", rows, flat=plateau, roofline=True)
    return dense, experts


def _dense_shares(s: Scenario) -> tuple[float, float, float]:
    """Shares of the dense matmuls' parameters (the embedding apart): the attention's
    projections before its kernel, those after it, and the LM head; the rest are the
    shared experts, dense MLPs and router. [A] Time in proportion to parameters, the
    parts sharded alike."""
    dense, _ = expert_split(s)
    embed, head, _ = vocab_params(s)
    before, after = (p * s.model.layers for p in _attention_projections(s))
    # a model whose stated parameters hold fewer than its shapes imply: the shapes' parts
    matmuls = max(1.0, dense - embed, before + after + head)
    return before / matmuls, after / matmuls, head / matmuls


def _one_batch_step(s: Scenario, batch: int, kv_tokens: float) -> DecodeStep:
    cfg, eff = s.decode, efficiency(s)
    gpu, host = side_gpu(s, "decode"), engine_step(s)
    q = cfg.speculative.draft_tokens if cfg.speculative else 1
    rows = batch * q
    weights = _weights_read(s, rows)
    kv = kv_tokens * side_memory(s, "decode").kv_bytes_per_token
    hbm = gpu.hbm_Bps * eff.decode_hbm
    plateau = eff.gemm_plateau(gpu.name, gemm_dtype(s))
    lin_s = att_s = flops = 0.0
    if batch > 0:
        flops, lin_s, _ = _linear_s(s, "decode", rows, flat=plateau)
        att = attention_flops(s, rows, kv_tokens * q, decode=True) / cfg.tp
        flops += att
        att_s = attention_time_s(s, "decode", att, kv_tokens / batch)
    return DecodeStep(
        weight_bytes=weights,
        kv_bytes=kv,
        flops=flops,
        memory_s=(weights + kv) / hbm,
        compute_s=lin_s + att_s,
        overhead_s=host.host_s,
        allreduce_s=allreduce_s(s, "decode", rows) if batch > 0 else 0.0,
        alltoall_s=alltoall_s(s, "decode", rows),
        mfu=plateau,
        linear_s=max(weights / hbm, lin_s) if batch > 0 else weights / hbm,
        kv_memory_s=kv / hbm,
        attention_s=att_s,
        fixed_s=kernel_floor_s(s),
        draft_s=_draft_s(s, batch, weights, hbm, plateau),
        host_overlapped=host.overlapped,
    )


def decode_step_s(s: Scenario, batch: int, kv_tokens: float) -> float:
    return decode_step(s, batch, kv_tokens).total_s


def efficiency_figures(s: Scenario) -> dict[str, object]:
    """The GPUs and the efficiencies a run's model used (summary.json `serving_model`)."""
    eff, chunk = efficiency(s), s.geometry().chunk_tokens
    p, d = s.prefill, s.decode
    out: dict[str, object] = {
        "prefill_gpu": p.gpu,
        "decode_gpu": d.gpu,
        "prefill_tp": p.tp,
        "prefill_ep": p.ep,
        "decode_tp": d.tp,
        "decode_ep": d.ep,
        "chunk_tokens": chunk,
        "prefill_mfu_at_chunk": (
            p.mfu if p.mfu is not None else eff.gemm_share(p.gpu, gemm_dtype(s), chunk)
        ),
        "attention_mfu": eff.attention_share(p.gpu, "bf16", chunk) or eff.attention_mfu,
        "decode_hbm_efficiency": eff.decode_hbm,
        "decode_mfu": eff.gemm_plateau(d.gpu, gemm_dtype(s)),
        "step_overhead_ms": engine_step(s).host_s * 1e3,
        "step_overhead_hidden": engine_step(s).overlapped,
        "decode_engine": engine_step(s).engine,
        "allreduce_efficiency": eff.allreduce,
    }
    if s.serving.kernels is not None:
        out["kernel_table"] = s.serving.kernels  # [serving] kernels: measured, over the defaults
    if p.tokens_per_s is not None:
        out["prefill_tokens_per_s"] = p.tokens_per_s  # overrides the FLOP model
    elif p.tflops is not None:
        out["prefill_tflops"] = p.tflops
    return out


def describe_efficiency(fig: dict) -> tuple[str, str]:
    """(prefill, decode) one line each for the run's table."""
    p = f"{fig['prefill_gpu']} TP{fig['prefill_tp']}" + (
        f" EP{fig['prefill_ep']}" if fig.get("prefill_ep", 1) > 1 else ""
    )
    if "prefill_tokens_per_s" in fig:
        p += f": {fig['prefill_tokens_per_s']:,.0f} tokens/s (prefill.tokens_per_s)"
    elif "prefill_tflops" in fig:
        p += f": {fig['prefill_tflops']:,.0f} TFLOP/s sustained (prefill.tflops)"
    else:
        p += (
            f": MFU {fig['prefill_mfu_at_chunk']:.0%} at {fig['chunk_tokens']:,}-token chunks, "
            f"attention {fig['attention_mfu']:.0%}"
        )
    d = f"{fig['decode_gpu']} TP{fig['decode_tp']}" + (
        f" EP{fig['decode_ep']}" if fig.get("decode_ep", 1) > 1 else ""
    )
    d += (
        f": {fig['decode_hbm_efficiency']:.0%} of HBM, MFU {fig['decode_mfu']:.0%}, "
        f"{fig['step_overhead_ms']:g} ms a step"
    )
    if fig.get("decode_engine"):
        hidden = ", under the GPU's" if fig.get("step_overhead_hidden") else ""
        d += f" ({fig['decode_engine']}'s host work{hidden})"
    return p, d
