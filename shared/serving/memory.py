"""Memory per GPU on both sides: weights, activations, KV; what does not fit, in words.

One GPU of a side (prefill or decode) holds, out of its `memory_utilization` share of
memory (the engine's static share, like SGLang's mem_fraction_static; the rest is the
allocator's slack, CUDA graphs, NCCL buffers):

- weights: every parameter (all experts of a MoE model) at `model.weight_dtype`:
  the dense part divided over the TP group but for what the engines replicate on every
  rank (MLA's q_a / kv_a projection, the MoE router: shared/serving/sharding.py), the
  experts over max(tp, ep) GPUs (`prefill.ep` / `decode.ep`; `weights_per_gpu_bytes`);
- activations and workspace: the largest forward's tokens (a prefill chunk, a decode
  batch of `decode.max_running_requests`) x hidden size x ACTIVATION_TENSORS tensors
  at 2 bytes, held whole on every rank of the group (an upper bound: some are
  sharded over TP);
- KV: what is left. It must hold at least one full chunk of the rank's KV, on the
  prefill (the chunk being computed) and the decode (the chunk landing); the decode's
  KV capacity in tokens is this remainder over the KV bytes of a token.

`memory_problem` says in one line why a side does not fit ("131.5 GiB of weights per
GPU > 72 GiB usable on h100-sxm at TP1"); it never prints a negative capacity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstage.shared.serving.gpus import WEIGHT_BYTES, Gpu, side_gpu
from kvstage.shared.serving.pipeline import stage_layers, stage_weight_bytes
from kvstage.shared.serving.prefix_cache import BLOCK_TOKENS
from kvstage.shared.serving.sharding import per_rank_params

if TYPE_CHECKING:
    from kvstage.shared.scenario.schema import Scenario

__all__ = [
    "ACTIVATION_TENSORS",
    "GIB",
    "SideMemory",
    "cache_blocks",
    "expert_split",
    "memory_problem",
    "side_memory",
    "weights_per_gpu_bytes",
]

GIB = 1 << 30
# [A] live activation tensors of hidden width during one layer's forward (residual,
# normed input, QKV, attention output, the MLP's gate, up and down partials, plus
# the allocator's rounding): 8 x tokens x hidden x 2 B. For an 8192-token chunk of
# Llama-3-70B that is 1 GiB, about what vLLM's profile run reserves for it.
ACTIVATION_TENSORS = 8


@dataclass(frozen=True, slots=True)
class SideMemory:
    """One GPU of one side: its budget and what takes it, in bytes."""

    side: str  # "prefill" | "decode"
    gpu: Gpu
    tp: int
    memory_bytes: float  # the GPU's memory (or decode.gpu_memory_gib)
    utilization: float
    weight_bytes: float
    activation_bytes: float
    kv_bytes_per_token: int  # on this rank
    min_kv_tokens: int  # one full chunk
    pp: int = 1  # pipeline stages (prefill.pp): the numbers are the fullest stage's

    @property
    def usable_bytes(self) -> float:
        return self.memory_bytes * self.utilization

    @property
    def kv_bytes(self) -> float:
        """Bytes left for KV; may be negative (then `problem` says why, in words)."""
        return self.usable_bytes - self.weight_bytes - self.activation_bytes

    @property
    def kv_tokens(self) -> int:
        return max(0, int(self.kv_bytes // self.kv_bytes_per_token))

    def problem(self) -> str | None:
        """One plain line when this side does not fit, else None."""
        where = f"on {self.gpu.name} at TP{self.tp}" + (f" PP{self.pp}" if self.pp > 1 else "")
        usable = f"{_gib(self.usable_bytes)} GiB usable {where}"
        if self.weight_bytes > self.usable_bytes:
            return f"{_gib(self.weight_bytes)} GiB of weights per GPU > {usable}"
        need = self.min_kv_tokens * self.kv_bytes_per_token
        if self.kv_bytes < need:
            left = max(0.0, self.kv_bytes)
            return (
                f"{_gib(self.weight_bytes)} GiB of weights + {_gib(self.activation_bytes)} GiB "
                f"of activations leave {_gib(left)} GiB of the {usable} for KV, less than one "
                f"{self.min_kv_tokens}-token chunk ({_gib(need)} GiB)"
            )
        return None


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f}".removesuffix(".0") if nbytes >= GIB else f"{nbytes / GIB:.2f}"


def expert_split(s: Scenario) -> tuple[float, float]:
    """(dense parameters D, one expert's parameters e), in parameters.

    P = D + E e and A = D + k e; a dense model (no experts, or no active_params_b) is
    all D."""
    m = s.model
    total = m.params_b * 1e9
    active = m.flops_params_b * 1e9
    E, k = m.experts, m.experts_per_token
    if not E or not k or E == k or active >= total:
        return total, 0.0
    e = (total - active) / (E - k)
    return max(0.0, active - k * e), e


def weights_per_gpu_bytes(s: Scenario, side: str) -> float:
    """Bytes of weights one GPU of `side` holds: the dense part over TP (less what every
    rank holds whole, shared/serving/sharding.py), the experts over max(tp, ep) GPUs
    (ep > tp: the expert group spans several instances)."""
    cfg = s.prefill if side == "prefill" else s.decode
    dense, e = expert_split(s)
    per = WEIGHT_BYTES[s.model.weight_dtype]
    experts = s.model.experts * e
    if side == "prefill" and s.prefill.pp > 1:  # the fullest stage (shared/serving/pipeline.py)
        embed, head = (x * 1e9 for x in s.model.vocab_params_b)
        layer = per_rank_params(s, dense - embed - head, cfg.tp) + experts / max(cfg.tp, cfg.ep)
        return stage_weight_bytes(s, layer * per, embed / cfg.tp * per, head / cfg.tp * per)
    return (per_rank_params(s, dense, cfg.tp) + experts / max(cfg.tp, cfg.ep)) * per


def side_memory(s: Scenario, side: str) -> SideMemory:
    """The memory budget of one GPU of `side` ("prefill" or "decode") of scenario `s`."""
    g, m = s.geometry(), s.model
    cfg = s.prefill if side == "prefill" else s.decode
    gpu = side_gpu(s, side)
    heads = g.prefill_heads if side == "prefill" else g.decode_heads
    memory = gpu.memory_gib * GIB
    if side == "decode" and s.decode.gpu_memory_gib is not None:
        memory = s.decode.gpu_memory_gib * GIB
    chunk = g.chunk_tokens
    tokens = chunk if side == "prefill" else s.decode.max_running_requests
    return SideMemory(
        side=side,
        gpu=gpu,
        tp=cfg.tp,
        memory_bytes=memory,
        utilization=cfg.memory_utilization,
        weight_bytes=weights_per_gpu_bytes(s, side),
        activation_bytes=tokens * m.hidden * 2 * ACTIVATION_TENSORS,
        kv_bytes_per_token=_kv_bytes_per_token(s, side, heads),
        min_kv_tokens=chunk,
        pp=s.prefill.pp if side == "prefill" else 1,
    )


def _kv_bytes_per_token(s: Scenario, side: str, heads: int) -> int:
    """A token's KV on one GPU of `side`: its heads in every layer, or with prefill
    pipeline stages in the fullest stage's layers (shared/serving/pipeline.py)."""
    g = s.geometry()
    if side == "prefill" and s.prefill.pp > 1:
        return g.kv_factor * max(stage_layers(g.layers, s.prefill.pp)) * g.head_token_bytes(heads)
    return g.block_bytes(1, heads)


def memory_problem(s: Scenario) -> tuple[str, str] | None:
    """(the field to blame, one line) for the first side that does not fit, else None."""
    for side in ("prefill", "decode"):
        problem = side_memory(s, side).problem()
        if problem:
            return side, problem
    return None


def cache_blocks(scenario: Scenario) -> int:
    """The prefix cache's capacity in blocks on one prefill GPU of `scenario`
    (shared/serving/prefix_cache.py): its KV memory over one block's KV on a rank."""
    mem = side_memory(scenario, "prefill")
    return max(0, int(mem.kv_bytes // (mem.kv_bytes_per_token * BLOCK_TOKENS)))
