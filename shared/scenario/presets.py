"""Model presets: the published KV geometry `[model] preset = "..."` fills in."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PRESETS", "ModelPreset"]


@dataclass(frozen=True, slots=True)
class ModelPreset:
    """Published KV geometry of a model: what the transfer moves, and params for FLOPs."""

    layers: int
    kv_heads: int
    head_dim: int
    params_b: float
    note: str = ""


# Numbers from each model's published config.json (num_hidden_layers,
# num_key_value_heads, hidden_size / num_attention_heads) and its model card.
PRESETS: dict[str, ModelPreset] = {
    "llama-2-7b": ModelPreset(32, 32, 128, 6.7, "multi-head attention: 32 KV heads"),
    "llama-3-8b": ModelPreset(32, 8, 128, 8.0),
    "llama-3.1-8b": ModelPreset(32, 8, 128, 8.0),
    "llama-3-70b": ModelPreset(80, 8, 128, 70.6),
    "llama-3.1-70b": ModelPreset(80, 8, 128, 70.6),
    "llama-3.1-405b": ModelPreset(126, 8, 128, 405.0),
    "llama-3.2-1b": ModelPreset(16, 8, 64, 1.24),
    "llama-3.2-3b": ModelPreset(28, 8, 128, 3.2),
    "mistral-7b": ModelPreset(32, 8, 128, 7.3),
    "qwen2.5-0.5b": ModelPreset(24, 2, 64, 0.49, "2 KV heads: replication from TP 4"),
    "qwen2.5-7b": ModelPreset(28, 4, 128, 7.6),
    "qwen2.5-14b": ModelPreset(48, 8, 128, 14.7),
    "qwen2.5-32b": ModelPreset(64, 8, 128, 32.5),
    "qwen2.5-72b": ModelPreset(80, 8, 128, 72.7),
}
