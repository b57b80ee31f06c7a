"""A forward that packs prompt chunks, alone or mixed into a decode step: the step of a
colocated instance (sim/colocated.py), where chunked prefill shares one forward with
the running decodes, as SGLang (`--enable-mixed-chunk`) and vLLM v1 schedule it.

A step's time (`mixed_step_s`): with no prompt in it, the decode step of
`DecodeModel.step_time_s` (shared/serving/compute.py `decode_step`); with no decode, the
prefill forward of its chunks (shared/serving/compute.py `packed_forward`: linear FLOPs over all the chunks'
tokens at the MFU of that many rows, attention per chunk over its context, TP
all-reduces, expert all-to-all, the kernels' fixed costs), as a prefill instance
computes them; mixed, one forward that reads the weights once: its weight matmuls
max(the decode's weight reads over HBM, the decode's matmul FLOP time plus the
chunks'), then the decode's attention (the longer of its KV reads and its FLOPs) and
the chunks' attention, plus one forward's kernels, the decode's draft (speculative
decoding), its step overhead and both parts' all-reduces and all-to-all. A chunk mixed
into a compute-bound step makes it longer by exactly the chunk's compute and
communication; into a memory-bound one by less (the chunk's matmuls hide the weight
read).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstage.shared.serving.compute import packed_forward

if TYPE_CHECKING:
    from kvstage.shared.scenario import Scenario
    from kvstage.shared.serving.decode_model import DecodeModel

__all__ = ["mixed_step_s", "prefill_step_s"]


def _pieces(s: Scenario, pieces: list[tuple[int, int]]) -> tuple[float, float, float, float]:
    """(matmul s, attention and memory-bound kernels' s, communication s, kernels' fixed
    s) of a forward of prompt chunks `pieces` (tokens computed, context before them), as
    a prefill forward packs them: shared/serving/compute.py `packed_forward` (one piece
    alone: `prefill_forward` exactly; its `elementwise_s`, the norms' and activations'
    bytes, with the attention: neither hides under the decode's weight reads). With
    two-batch overlap (`prefill.two_batch_overlap`) the communication is what the
    overlap leaves exposed (`Forward.overlap_s` is never more than it)."""
    f = packed_forward(s, [(t, c) for t, c in pieces if t > 0])
    comm = f.allreduce_s + f.alltoall_s - f.overlap_s
    return f.linear_s, f.attention_s + f.elementwise_s, comm, f.fixed_s


def prefill_step_s(s: Scenario, pieces: list[tuple[int, int]]) -> tuple[float, float]:
    """(compute seconds, fixed seconds) of a forward of prompt chunks `pieces` alone: the
    matmuls and attention (compute); the communication and the kernels' fixed costs
    (fixed). `prefill.tokens_per_s` overrides the whole forward."""
    total = sum(t for t, _ in pieces)
    if total <= 0:
        return 0.0, 0.0
    if s.prefill.tokens_per_s is not None:
        return total / s.prefill.tokens_per_s, 0.0
    linear, attention, comm, kernels = _pieces(s, pieces)
    return linear + attention, comm + kernels


def mixed_step_s(
    s: Scenario, model: DecodeModel, batch: int, kv_tokens: float, pieces: list[tuple[int, int]]
) -> float:
    """One forward of an instance: `batch` decoding requests holding `kv_tokens` of KV
    and prompt chunks `pieces` (see the module docstring)."""
    if not pieces:
        return model.step_time_s(kv_tokens, batch) if batch else 0.0
    compute, fixed = prefill_step_s(s, pieces)
    if not batch:
        return compute + fixed
    d = model.step(kv_tokens, batch)
    if s.prefill.tokens_per_s is not None:
        linear, attention, comm = compute, 0.0, 0.0
    else:
        linear, attention, comm, _ = _pieces(s, pieces)
    reads, matmuls = d.memory_s - d.kv_memory_s, d.compute_s - d.attention_s
    return d.with_host(  # the engine's host work, under the GPU's or after it
        max(reads, matmuls + linear)  # the weight matmuls read the weights once
        + max(d.kv_memory_s, d.attention_s)
        + attention
        + d.fixed_s  # one forward's kernels
        + d.draft_s
        + d.allreduce_s
        + d.alltoall_s
        - d.overlap_s
        + comm
    )
