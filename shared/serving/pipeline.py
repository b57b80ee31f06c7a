"""Pipeline parallelism on the prefill side: stages of layers, chunks in flight.

`prefill.pp` = N splits one prefill instance into N stages, each a TP group of
`prefill.tp` GPUs holding its share of the layers ([C] SGLang's `--pp-size`; the
instance's GPUs are tp x pp). What the serving model takes from it:

- **Layers per stage.** L layers over N stages as SGLang splits them: L // N each,
  the last L % N stages one more ([C] sgl-project/sglang python/sglang/srt/distributed/
  utils.py `get_pp_indices`: "the last N partitions will have one extra layer, where
  N = remainder", unless SGLANG_PP_LAYER_PARTITION overrides it). The first stage holds
  the embedding, the last the LM head (SGLang's PPMissingLayer elsewhere), each split
  over the stage's TP group (`stage_weight_bytes`). A stage's KV is its layers' only.
- **A stage's forward** is the whole forward's time x the slowest stage's share of the
  layers (`stage_share`): every part of a forward but the LM head scales with the
  layers (the linear FLOPs and weight reads, attention, the TP all-reduces, the
  all-to-all, the kernels' fixed costs). [A] The LM head, on the last stage alone,
  multiplies one token a prompt (2 x vocab x hidden FLOPs: 2.1 GFLOP for Llama-3-70B
  against 1.1 PFLOP for an 8K chunk), counted with the layers' share.
- **The hand-off between stages**: a stage sends the next its hidden states and
  residual, 2 x tokens x hidden x 2 B (BF16), each TP rank 1 / tp of them, and the
  receiving group all-gathers them ([C] SGLang's scheduler_pp_mixin.py sends its
  PPProxyTensors with `send_tensor_dict(..., all_gather_group=attn_tp_group)`;
  parallel_state.py `send_tensor_dict` sends each rank's 1 / tp slice). The send crosses
  the NIC when the two stages sit on different nodes (stages placed in order on
  consecutive GPUs, `cluster.gpus_per_node` a node: [C] SGLang's global rank is
  pp_rank x tp_size + tp_rank), at one GPU's share of the links profile's inter-node
  link (shared/serving/deepep.py `nic_Bps`, the profile names its source), else the
  GPU's scale-up link (shared/serving/gpus.py, the datasheet's). [A] The send is not
  overlapped with the stage's compute (SGLang's async send can hide it under the next
  micro-batch's): a stage-step is the slowest stage's forward plus one send.
- **Chunks in flight.** A prompt's chunks pipeline through the stages: chunk c + 1
  enters stage 0 when stage 0 is done with chunk c (it needs only that stage's KV of
  the earlier chunks), so a prompt of n chunks takes n + N - 1 stage-steps when they
  are equal, sum(steps) + (N - 1) x max(step) in general (a flow shop of identical
  stages; `pipeline_latency_s`) ([C] SGLang's chunked pipeline parallelism: issue
  #11857 "chunked pipeline parallelism with prefill on a long context", the PP event
  loop runs pp_size (+ pp_async_batch_depth) micro-batches at once,
  scheduler_pp_mixin.py `init_pp_loop_state`). With other prompts' chunks filling the
  pipeline an instance completes a chunk every stage-step: its throughput is one
  chunk per step (`capacity.prompt_forward_s` sums the steps).

The decode side takes no PP (scenario schema: `decode.pp` is refused). The KV transfer
from N stages is laid out in the protocol core (shared/layout.py: each stage's TP ranks
write their layers' block to the decode ranks) and run by the simulator, whose GPU
model takes its stage-steps from here (sim/forward.py `PipelineForward`); hardware
mode refuses it (shared/cluster.py `pipeline_problem`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from kvstage.shared.layout import stage_layer_ranges
from kvstage.shared.serving.deepep import nic_Bps
from kvstage.shared.serving.gpus import side_gpu

if TYPE_CHECKING:
    from kvstage.shared.scenario import Scenario

__all__ = [
    "PROXY_TENSORS",
    "handoff_s",
    "pipeline_latency_s",
    "stage_layers",
    "stage_share",
    "stage_step_s",
    "stage_weight_bytes",
    "stages_cross_nodes",
]

PROXY_TENSORS = 2  # [C] hidden_states and residual (SGLang's PPProxyTensors)
ACT_BYTES = 2  # [A] activations in BF16, as compute.py's


def stage_layers(layers: int, pp: int) -> list[int]:
    """Layers of each stage, first to last: layers // pp, the last layers % pp one more
    ([C] SGLang `get_pp_indices`; shared/layout.py `stage_layer_ranges`, the ranges
    the transfer's blocks carry)."""
    return [len(r) for r in stage_layer_ranges(layers, pp)]


def stage_share(s: Scenario) -> float:
    """The slowest prefill stage's share of the layers (1.0 without PP)."""
    pp, layers = s.prefill.pp, s.model.layers
    if pp == 1:
        return 1.0
    return max(stage_layers(layers, pp)) / layers


def stages_cross_nodes(s: Scenario) -> bool:
    """True when some hand-off between consecutive stages leaves a node (stages on
    consecutive GPUs, `cluster.gpus_per_node` to a node)."""
    tp, pp, gpn = s.prefill.tp, s.prefill.pp, s.cluster.gpus_per_node
    return any((b * tp - 1) // gpn != (b * tp) // gpn for b in range(1, pp))


def handoff_s(s: Scenario, tokens: float) -> float:
    """Seconds of one stage's hand-off of `tokens` tokens to the next: each TP rank's
    1 / tp of the hidden states and residual over the link between the stages, then
    the receiving group's all-gather over its scale-up link (0 without PP)."""
    tp = s.prefill.tp
    if s.prefill.pp == 1 or tokens <= 0:
        return 0.0
    total = PROXY_TENSORS * tokens * s.model.hidden * ACT_BYTES
    scaleup = side_gpu(s, "prefill").scaleup_Bps
    link = nic_Bps(s) if stages_cross_nodes(s) else scaleup
    gather = total * (tp - 1) / tp / scaleup if tp > 1 else 0.0
    return total / tp / link + gather


def stage_step_s(s: Scenario, forward_s: float, tokens: float) -> float:
    """One stage-step of a chunk whose whole forward (all layers on one TP group) takes
    `forward_s`: the slowest stage's share of it and its hand-off (`forward_s` itself
    without PP)."""
    if s.prefill.pp == 1:
        return forward_s
    if forward_s <= 0:
        return 0.0
    return forward_s * stage_share(s) + handoff_s(s, tokens)


def pipeline_latency_s(steps: list[float], pp: int) -> float:
    """Seconds from a prompt's first chunk entering stage 0 to its last leaving the last
    stage, the chunks' stage-steps `steps` in order: sum + (pp - 1) x max (n + pp - 1
    steps when they are equal; a flow shop whose stages take a chunk alike)."""
    if not steps:
        return 0.0
    return math.fsum(steps) + (pp - 1) * max(steps)


def stage_weight_bytes(s: Scenario, layer_bytes: float, embed: float, head: float) -> float:
    """Weight bytes on one GPU of the fullest prefill stage: `layer_bytes` (one GPU's
    share of every layer's weights) times the stage's share of the layers, plus the
    embedding on the first stage and the LM head on the last (`embed`, `head`: one
    GPU's share of them; a tied head is the embedding again on the last stage)."""
    pp, layers = s.prefill.pp, s.model.layers
    counts = stage_layers(layers, pp)
    per = [layer_bytes * n / layers for n in counts]
    per[0] += embed
    per[-1] += head if head else embed
    return max(per)
