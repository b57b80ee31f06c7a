"""Model presets: the published KV geometry `[model] preset = "..."` fills in."""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["PRESETS", "ModelPreset"]


@dataclass(frozen=True, slots=True)
class ModelPreset:
    """Published KV geometry of a model: what the transfer moves, and params for FLOPs.

    An MLA model (`attention="mla"`) caches one latent vector per token per layer:
    `kv_heads` is 1 and `head_dim` the latent width (kv_lora_rank + qk_rope_head_dim),
    held once (no separate V) and replicated on every TP rank.
    """

    layers: int
    kv_heads: int
    head_dim: int
    params_b: float  # all parameters (every expert of a MoE model)
    note: str = ""
    active_params_b: float | None = None  # a MoE model's parameters per token
    source: str = ""  # the Hugging Face repository whose config.json gives the numbers
    attention: str = "mha"  # "mha" (MHA/GQA/MQA: K and V heads) or "mla" (one latent)
    # config.json: hidden_size, num_attention_heads; for a MoE model the routed experts
    # (n_routed_experts / num_local_experts / num_experts) and how many a token picks
    # (num_experts_per_tok); 0: dense
    hidden_size: int = 0
    attention_heads: int = 0
    experts: int = 0
    experts_per_token: int = 0
    # MLA only (config.json): qk_nope_head_dim and qk_rope_head_dim (their sum is the
    # query/key width of the prefill's MHA form), v_head_dim, and kv_lora_rank (the
    # latent the decode's absorbed form attends over); 0 for MHA models
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    kv_lora_rank: int = 0
    # MLA only (config.json q_lora_rank): the query's low-rank width; its down
    # projection is replicated on every TP rank (shared/serving/sharding.py)
    q_lora_rank: int = 0
    # config.json max_position_embeddings: the longest sequence (prompt + output) the
    # engines serve by default (SGLang's context_len, vLLM's max_model_len); 0: unknown
    context_tokens: int = 0
    # config.json: vocab_size, and tie_word_embeddings (the LM head is the embedding
    # matrix, counted once in params_b); 0: unknown (every parameter is a matmul's)
    vocab_size: int = 0
    tied_embeddings: bool = False
    # how the published FP8 checkpoint scales its weights: "tensor" (one scale a tensor,
    # the usual FP8 release) or "block" (a scale per 128 x 128 block, config.json
    # quantization_config.weight_block_size): the engines run different FP8 GEMMs for
    # them (shared/serving/gpus.py `Efficiency.gemm_table`)
    fp8_scaling: str = "tensor"

    @property
    def latent_dim(self) -> int | None:
        """The MLA latent width per token per layer; None for MHA."""
        return self.head_dim if self.attention == "mla" else None

    @property
    def kv_elems_per_token(self) -> int:
        """KV elements one token caches over all layers: K and V heads, or the latent once."""
        planes = 1 if self.attention == "mla" else 2
        return planes * self.layers * self.kv_heads * self.head_dim


# Numbers from each model's published config.json on Hugging Face (`source`:
# num_hidden_layers, num_key_value_heads, head_dim or hidden_size /
# num_attention_heads) and its model card (parameters; a MoE model's card gives total
# and activated parameters). MLA presets: latent = kv_lora_rank + qk_rope_head_dim
# (512 + 64 = 576 in all three).
_MIXTRAL = "sparse MoE: 8 experts, 2 per token"
_MLA = "MLA: one 576-wide latent (512 + 64 rope) per token per layer, on every TP rank"
PRESETS: dict[str, ModelPreset] = {
    "llama-2-7b": ModelPreset(
        32, 32, 128, 6.7, "multi-head attention: 32 KV heads", source="meta-llama/Llama-2-7b-hf"
    ),
    "llama-3-8b": ModelPreset(32, 8, 128, 8.0, source="meta-llama/Meta-Llama-3-8B"),
    "llama-3.1-8b": ModelPreset(32, 8, 128, 8.0, source="meta-llama/Llama-3.1-8B"),
    "llama-3-70b": ModelPreset(80, 8, 128, 70.6, source="meta-llama/Meta-Llama-3-70B"),
    "llama-3.1-70b": ModelPreset(80, 8, 128, 70.6, source="meta-llama/Llama-3.1-70B"),
    "llama-3-405b": ModelPreset(
        126, 8, 128, 405.0, "released as Llama-3.1-405B", source="meta-llama/Llama-3.1-405B"
    ),
    "llama-3.1-405b": ModelPreset(126, 8, 128, 405.0, source="meta-llama/Llama-3.1-405B"),
    "llama-3.2-1b": ModelPreset(16, 8, 64, 1.24, source="meta-llama/Llama-3.2-1B"),
    "llama-3.2-3b": ModelPreset(28, 8, 128, 3.2, source="meta-llama/Llama-3.2-3B"),
    "mistral-7b": ModelPreset(32, 8, 128, 7.3, source="mistralai/Mistral-7B-v0.1"),
    "mixtral-8x7b": ModelPreset(
        32, 8, 128, 46.7, _MIXTRAL, active_params_b=12.9, source="mistralai/Mixtral-8x7B-v0.1"
    ),
    "mixtral-8x22b": ModelPreset(
        56, 8, 128, 141.0, _MIXTRAL, active_params_b=39.0, source="mistralai/Mixtral-8x22B-v0.1"
    ),
    "qwen2.5-0.5b": ModelPreset(
        24, 2, 64, 0.49, "2 KV heads: replication from TP 4", source="Qwen/Qwen2.5-0.5B"
    ),
    "qwen2.5-7b": ModelPreset(
        28, 4, 128, 7.6, "4 KV heads: replication from TP 8", source="Qwen/Qwen2.5-7B"
    ),
    "qwen2.5-14b": ModelPreset(48, 8, 128, 14.7, source="Qwen/Qwen2.5-14B"),
    "qwen2.5-32b": ModelPreset(64, 8, 128, 32.5, source="Qwen/Qwen2.5-32B"),
    "qwen2.5-72b": ModelPreset(80, 8, 128, 72.7, source="Qwen/Qwen2.5-72B"),
    "qwen3-30b-a3b": ModelPreset(
        48,
        4,
        128,
        30.5,
        "MoE: 128 experts, 8 per token; 4 KV heads",
        active_params_b=3.3,
        source="Qwen/Qwen3-30B-A3B",
    ),
    "qwen3-235b-a22b": ModelPreset(
        94,
        4,
        128,
        235.0,
        "MoE: 128 experts, 8 per token; 4 KV heads",
        active_params_b=22.0,
        source="Qwen/Qwen3-235B-A22B",
    ),
    "deepseek-v2": ModelPreset(
        60,
        1,
        576,
        236.0,
        f"{_MLA}; MoE: 160 experts, 6 per token",
        active_params_b=21.0,
        source="deepseek-ai/DeepSeek-V2",
        attention="mla",
    ),
    "deepseek-v3": ModelPreset(
        61,
        1,
        576,
        671.0,
        f"{_MLA}; MoE: 256 experts, 8 per token",
        active_params_b=37.0,
        source="deepseek-ai/DeepSeek-V3",
        attention="mla",
        # config.json quantization_config: fmt e4m3, weight_block_size [128, 128],
        # activation_scheme dynamic; the DeepSeek-V3 technical report, section 3.3
        # (https://arxiv.org/abs/2412.19437): 128 x 128 weight blocks, 1 x 128 tiles of
        # activations; DeepGEMM runs them
        fp8_scaling="block",
    ),
    # DistServe's model (arXiv 2401.09670): facebook/opt-13b config.json,
    # num_hidden_layers 40, num_attention_heads 40, hidden_size 5120 (head_dim 128,
    # MHA: 40 KV heads); 12.85B parameters (the model card's "13B")
    "opt-13b": ModelPreset(
        40, 40, 128, 12.85, "multi-head attention: 40 KV heads", source="facebook/opt-13b"
    ),
    "kimi-k2": ModelPreset(
        61,
        1,
        576,
        1000.0,
        f"{_MLA}; MoE: 384 experts, 8 per token",
        active_params_b=32.0,
        source="moonshotai/Kimi-K2-Instruct",
        attention="mla",
    ),
}


# hidden_size, num_attention_heads, routed experts, experts per token, from the same
# config.json files (`source`).
_SHAPES: dict[str, tuple[int, int, int, int]] = {
    "llama-2-7b": (4096, 32, 0, 0),
    "llama-3-8b": (4096, 32, 0, 0),
    "llama-3.1-8b": (4096, 32, 0, 0),
    "llama-3-70b": (8192, 64, 0, 0),
    "llama-3.1-70b": (8192, 64, 0, 0),
    "llama-3-405b": (16384, 128, 0, 0),
    "llama-3.1-405b": (16384, 128, 0, 0),
    "llama-3.2-1b": (2048, 32, 0, 0),
    "llama-3.2-3b": (3072, 24, 0, 0),
    "mistral-7b": (4096, 32, 0, 0),
    "mixtral-8x7b": (4096, 32, 8, 2),
    "mixtral-8x22b": (6144, 48, 8, 2),
    "qwen2.5-0.5b": (896, 14, 0, 0),
    "qwen2.5-7b": (3584, 28, 0, 0),
    "qwen2.5-14b": (5120, 40, 0, 0),
    "qwen2.5-32b": (5120, 40, 0, 0),
    "qwen2.5-72b": (8192, 64, 0, 0),
    "qwen3-30b-a3b": (2048, 32, 128, 8),
    "qwen3-235b-a22b": (4096, 64, 128, 8),
    "deepseek-v2": (5120, 128, 160, 6),
    "deepseek-v3": (7168, 128, 256, 8),
    "kimi-k2": (7168, 64, 384, 8),
    "opt-13b": (5120, 40, 0, 0),
}
for _name, (_h, _a, _e, _k) in _SHAPES.items():
    PRESETS[_name] = replace(
        PRESETS[_name], hidden_size=_h, attention_heads=_a, experts=_e, experts_per_token=_k
    )

# MLA dimensions from the same config.json files: qk_nope_head_dim 128 +
# qk_rope_head_dim 64, v_head_dim 128, kv_lora_rank 512, q_lora_rank 1536 in all three.
for _name in ("deepseek-v2", "deepseek-v3", "kimi-k2"):
    PRESETS[_name] = replace(
        PRESETS[_name],
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        kv_lora_rank=512,
        q_lora_rank=1536,
    )

# max_position_embeddings from the same config.json files (https:// + the URL beside
# each). Llama 3 has an 8k context, Llama 3.1 and 3.2 128k; SGLang and vLLM take this as
# the context length unless --context-length / --max-model-len says otherwise
# ([model] context_tokens).
_CONTEXT: dict[str, int] = {
    "llama-2-7b": 4096,  # huggingface.co/meta-llama/Llama-2-7b-hf/blob/main/config.json
    "llama-3-8b": 8192,  # huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json
    "llama-3.1-8b": 131072,  # huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json
    "llama-3-70b": 8192,  # huggingface.co/meta-llama/Meta-Llama-3-70B/blob/main/config.json
    "llama-3.1-70b": 131072,  # huggingface.co/meta-llama/Llama-3.1-70B/blob/main/config.json
    "llama-3-405b": 131072,  # huggingface.co/meta-llama/Llama-3.1-405B/blob/main/config.json
    "llama-3.1-405b": 131072,  # huggingface.co/meta-llama/Llama-3.1-405B/blob/main/config.json
    "llama-3.2-1b": 131072,  # huggingface.co/meta-llama/Llama-3.2-1B/blob/main/config.json
    "llama-3.2-3b": 131072,  # huggingface.co/meta-llama/Llama-3.2-3B/blob/main/config.json
    "mistral-7b": 32768,  # huggingface.co/mistralai/Mistral-7B-v0.1/blob/main/config.json
    "mixtral-8x7b": 32768,  # huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json
    "mixtral-8x22b": 65536,  # huggingface.co/mistralai/Mixtral-8x22B-v0.1/blob/main/config.json
    "qwen2.5-0.5b": 32768,  # huggingface.co/Qwen/Qwen2.5-0.5B/blob/main/config.json
    "qwen2.5-7b": 131072,  # huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json
    "qwen2.5-14b": 131072,  # huggingface.co/Qwen/Qwen2.5-14B/blob/main/config.json
    "qwen2.5-32b": 131072,  # huggingface.co/Qwen/Qwen2.5-32B/blob/main/config.json
    "qwen2.5-72b": 131072,  # huggingface.co/Qwen/Qwen2.5-72B/blob/main/config.json
    "qwen3-30b-a3b": 40960,  # huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json
    "qwen3-235b-a22b": 40960,  # huggingface.co/Qwen/Qwen3-235B-A22B/blob/main/config.json
    "deepseek-v2": 163840,  # huggingface.co/deepseek-ai/DeepSeek-V2/blob/main/config.json
    "deepseek-v3": 163840,  # huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json
    "opt-13b": 2048,  # huggingface.co/facebook/opt-13b/blob/main/config.json
    "kimi-k2": 131072,  # huggingface.co/moonshotai/Kimi-K2-Instruct/blob/main/config.json
}
for _name, _ctx in _CONTEXT.items():
    PRESETS[_name] = replace(PRESETS[_name], context_tokens=_ctx)
# vocab_size and tie_word_embeddings from the same config.json files (`source`); the
# embedding is a lookup and the LM head a matmul of the last token of each sequence in
# a prefill (shared/serving/compute.py), so their parameters leave the per-token FLOPs.
_VOCAB: dict[str, tuple[int, bool]] = {
    "llama-2-7b": (32000, False),
    "llama-3-8b": (128256, False),
    "llama-3.1-8b": (128256, False),
    "llama-3-70b": (128256, False),
    "llama-3.1-70b": (128256, False),
    "llama-3-405b": (128256, False),
    "llama-3.1-405b": (128256, False),
    "llama-3.2-1b": (128256, True),
    "llama-3.2-3b": (128256, True),
    "mistral-7b": (32000, False),
    "mixtral-8x7b": (32000, False),
    "mixtral-8x22b": (32000, False),
    "qwen2.5-0.5b": (151936, True),
    "qwen2.5-7b": (152064, False),
    "qwen2.5-14b": (152064, False),
    "qwen2.5-32b": (152064, False),
    "qwen2.5-72b": (152064, False),
    "qwen3-30b-a3b": (151936, False),
    "qwen3-235b-a22b": (151936, False),
    "deepseek-v2": (102400, False),
    "deepseek-v3": (129280, False),
    "kimi-k2": (163840, False),
    "opt-13b": (50272, True),
}
for _name, (_v, _tied) in _VOCAB.items():
    PRESETS[_name] = replace(PRESETS[_name], vocab_size=_v, tied_embeddings=_tied)
