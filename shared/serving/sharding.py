"""What a tensor-parallel group splits, and what every rank of it holds whole.

The engines split a layer's matmuls over the TP group (column- and row-parallel
linears: a rank holds, reads and multiplies 1 / tp of each), except a few they
replicate: every rank holds, reads and multiplies those in full, whatever tp is.

- **MLA's down projections.** The query's and the KV latent's low-rank projections,
  one matmul of hidden x (q_lora_rank + kv_lora_rank + qk_rope_head_dim) a layer
  (7168 x 2112 in DeepSeek-V3, 15.1 M parameters a layer, 0.92 B over 61 layers):
  [C] SGLang python/sglang/srt/models/deepseek_v2.py, `DeepseekV2AttentionMLA`:
  `fused_qkv_a_proj_with_mqa = ReplicatedLinear(hidden_size, q_lora_rank +
  kv_lora_rank + qk_rope_head_dim)`, where q_b_proj and kv_b_proj are
  ColumnParallelLinear and o_proj RowParallelLinear over the attention TP group;
  vLLM vllm/model_executor/models/deepseek_v2.py, `DeepseekV2MLAAttention`:
  `fused_qkv_a_proj = DeepSeekV2FusedQkvAProjLinear(...)`, a MergedColumnParallelLinear
  built with `disable_tp=True`; TensorRT-LLM tensorrt_llm/_torch/modules/attention.py,
  `MLA`: `kv_a_proj_with_mqa = Linear(hidden_size, q_lora_rank + kv_lora_rank +
  qk_rope_head_dim)` with no tensor_parallel_mode (q_b_proj, kv_b_proj COLUMN, o_proj
  ROW).
- **A MoE layer's router**, hidden x routed experts: [C] SGLang's `MoEGate` (a plain
  nn.Parameter of (n_routed_experts, hidden_size), deepseek_v2.py) and its
  qwen2_moe.py gate (`ReplicatedLinear(hidden_size, num_experts)`); vLLM's
  `GateLinear` (a ReplicatedLinear subclass, deepseek_v2.py's gate) and mixtral's
  `ReplicatedLinear` gate. [A] Every layer is counted a MoE layer (compute.py), and the
  router's weights at the model's weight dtype (the engines keep them in BF16: 0.1 GB a
  rank more for DeepSeek-V3 at FP8, left out).

The KV latent is whole on every rank too (shared/layout.py: one latent "head"), and the
absorbed attention splits its heads: its FLOPs divide by TP, its KV reads do not
(compute.py `attention_flops`, memory.py `kv_bytes_per_token`).

Left out: SGLang's shared experts with DeepEP (`tp_size=1`: replicated over an
attention TP group larger than one; kvstage's DP-attention runs have tp = 1, where
it makes no difference).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstage.shared.scenario import Scenario

__all__ = ["per_rank_params", "replicated_params"]

# [A] the query's low-rank width of DeepSeek-V2, V3 and Kimi-K2 (config.json
# q_lora_rank 1536 in all three), for an MLA model that names no preset
_Q_LORA_DEFAULT = 1536


def replicated_params(s: Scenario) -> float:
    """Parameters every rank of a TP group holds whole: MLA's fused q_a / kv_a
    projection and the MoE router, over all layers (0 for a dense GQA model)."""
    m = s.model
    per_layer = 0.0
    if m.attention == "mla":
        q_lora = m.mla_q_lora_rank or _Q_LORA_DEFAULT
        per_layer += m.hidden * (q_lora + m.head_dim)  # head_dim: kv_lora_rank + rope
    if m.experts:
        per_layer += m.hidden * m.experts
    return per_layer * m.layers


def per_rank_params(s: Scenario, params: float, tp: int) -> float:
    """Of `params` non-expert parameters, those one rank of a TP group of `tp` holds,
    reads and multiplies: the replicated ones whole, the rest split."""
    whole = min(replicated_params(s), params)
    return (params - whole) / tp + whole
