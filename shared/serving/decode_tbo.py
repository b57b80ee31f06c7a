"""Two-batch overlap in decode (`decode.two_batch_overlap`): a step run as two
micro-batches on SGLang's decode schedule, each one's DeepEP low-latency all-to-all in
flight while the other computes.

What the engine does, and what kvstage takes from it:

- **The stages** ([C] SGLang python/sglang/srt/batch_overlap/operations_strategy.py
  `_compute_moe_deepseek_blog_decode`, `tbo_delta_stages = 2`): each MoE layer of each
  micro-batch runs as five stages, cut at its `YieldOperation`s:

  1. the attention's preparation (`self_attn.op_prepare`: for MLA the fused q_a and
     kv_a projection, the two latent norms, q_b, the absorbed key projection w_kc and
     rotary; [C] deepseek_v2.py `forward_absorb_prepare`), after the previous layer's
     output;
  2. the attention's core (`op_core`: the attention kernel, the absorbed value
     projection w_vc and o_proj, [C] `forward_absorb_core`), then the router (gate,
     top-k);
  3. the dispatch's send (`op_dispatch_a`), then the shared experts;
  4. the dispatch's receive (`op_dispatch_b`), the routed experts, the combine's send
     (`op_combine_a`);
  5. the combine's receive (`op_combine_b`).

  Qwen3's MoE layers run the same five ([C] `_compute_moe_qwen3_decode`, no shared
  experts: stage 3 is the send alone); a model without shared experts has little in
  stage 3 here too.

- **How the two interleave** ([C] operations.py `execute_overlapped_operations`): the
  first micro-batch runs `delta` stages alone, then the two alternate stage by stage
  (A, B, A, B, ...) on one compute stream, and the second finishes its last `delta`
  alone. With a delta of 2, A's dispatch is in flight over A's shared experts and B's
  attention preparation, A's combine over B's attention core, B's dispatch over B's
  shared experts and A's next preparation, B's combine over A's next attention core.
  The routed experts overlap no communication: a receive that finds its data still in
  flight holds the stream until it lands.
- **Communication beside compute.** DeepEP's low-latency kernels leave the SMs once
  their messages are issued ([P] https://github.com/deepseek-ai/profile-data, README,
  "Decoding": "after RDMA messages are issued, all GPU SMs are freed"), and SGLang's
  receive is a hook run at its stage, so the compute beside a transfer is not slowed.
  [A] A transfer's time is the whole kernel's (compute.py `alltoall_parts`: DeepEP's
  README latencies, which include the kernels' own SM time), in flight from its send;
  the two micro-batches' transfers queue one after the other on the network (in this
  schedule they do not meet).
- **What each stage costs.** A micro-batch's matmuls are priced as a step of its rows
  (compute.py), each kind (dense, experts) the longer of its weight reads and its
  FLOPs, the dense time shared among the attention's two stages, the shared experts and
  the LM head by their parameters; the attention kernel in the core stage with the TP
  all-reduce; the kernels' fixed costs a quarter in each compute stage. [A] Every layer
  alike, as in prefill (shared/serving/prefill_tbo.py). The LM head and a speculative
  step's draft run after the layers, overlapping nothing.

Checked against the published ablation ([P] LMSYS,
https://lmsys.org/blog/2025-05-05-large-scale-ep/, "Ablation Study: Two-batch Overlap",
DeepSeek-V3 on H100, EP72): TBO gains 25.5% at 256 tokens a device and loses 27% at
32, with the threshold between 64 and 128 (tests/test_decode_engine.py reads the model
against these, not fitted to them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

__all__ = ["DELTA_STAGES", "HalfStages", "schedule_s"]

DELTA_STAGES = 2  # [C] `_compute_moe_deepseek_blog_decode` tbo_delta_stages


@dataclass(frozen=True, slots=True)
class HalfStages:
    """One micro-batch's costs per layer, seconds: its four compute stages, its two
    transfers, and what runs once after the layers."""

    prepare: float
    core: float
    shared: float
    experts: float
    dispatch: float
    combine: float
    tail: float = 0.0


# the five stages of a layer, each its ops in order: (kind, part), kind COMPUTE, SEND or
# RECV, part an index into HalfStages' first six fields (prepare, core, shared, experts,
# dispatch, combine)
COMPUTE, SEND, RECV = 0, 1, 2
_PREPARE, _CORE, _SHARED, _EXPERTS, _DISPATCH, _COMBINE = range(6)
_STAGES: tuple[tuple[tuple[int, int], ...], ...] = (
    ((COMPUTE, _PREPARE),),
    ((COMPUTE, _CORE),),
    ((SEND, _DISPATCH), (COMPUTE, _SHARED)),
    ((RECV, _DISPATCH), (COMPUTE, _EXPERTS), (SEND, _COMBINE)),
    ((RECV, _COMBINE),),
)


@cache
def _order(layers: int) -> tuple[tuple[int, int, int], ...]:
    """Every op of the step in SGLang's order, as (micro-batch, kind, part): the first
    micro-batch's first DELTA_STAGES stages alone, then the two alternating stage by
    stage, then the second's last DELTA_STAGES."""
    flat = [stage for _ in range(layers) for stage in _STAGES]
    n, ops = len(flat), []
    for i in range(n + DELTA_STAGES):
        if i < n:
            ops.extend((0, kind, part) for kind, part in flat[i])
        if i >= DELTA_STAGES:
            ops.extend((1, kind, part) for kind, part in flat[i - DELTA_STAGES])
    return tuple(ops)


def schedule_s(halves: Sequence[HalfStages], layers: int) -> float:
    """The step's time as SGLang runs the two micro-batches' stages (see above): one
    compute stream in the interleaved order, each transfer in flight from its send,
    each receive waiting for its transfer to land."""
    costs = [(h.prepare, h.core, h.shared, h.experts, h.dispatch, h.combine) for h in halves]
    stream = network = 0.0  # when the compute stream and the network are next free
    lands = [[0.0] * 6, [0.0] * 6]  # when each micro-batch's last transfer of a kind lands
    for who, kind, part in _order(layers):
        if kind == COMPUTE:
            stream += costs[who][part]
        elif kind == SEND:
            network = max(network, stream) + costs[who][part]
            lands[who][part] = network
        elif lands[who][part] > stream:
            stream = lands[who][part]
    return stream + sum(h.tail for h in halves)
