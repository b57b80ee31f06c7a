"""Fixed costs of a forward's kernels: how many a layer launches, and the collective's latency.

A decode step at small batch is not its bytes over HBM: every kernel of every layer
pays a fixed cost (its launch in the CUDA graph, its ramp and tail, the small kernels
that move almost nothing), and every TP all-reduce a latency that grows with the group
and is larger over PCIe than over NVLink. This module counts both; shared/serving/
compute.py adds them to the bytes and FLOPs of the forward and the step.

Kernels per layer, [C] read from the engines' decoder layers (vLLM
model_executor/models/llama.py, mixtral.py and fused_moe; SGLang srt/models/
deepseek_v2.py, the absorbed MLA path): a dense GQA layer launches 10 (fused add +
RMSNorm, QKV projection, rotary, KV-cache write, attention, O projection, fused add +
RMSNorm, gate-up projection, SiLU-and-mul, down projection); a routed-expert MLP
replaces its 3 MLP kernels with 7 (router GEMM, top-k softmax, expert alignment, the
two grouped GEMMs, the activation, the weighted sum); MLA replaces the 5 attention
kernels with 10 (the fused q_a / kv_a projection, two latent norms, the q_b
projection, the two absorption BMMs, rotary, the latent-cache write, attention, O
projection); shared experts add 3; FP8 weights add one activation-quantization
kernel per dense GEMM (per-token-group FP8 quantization before each block-scaled GEMM).
The TP all-reduces are counted apart (`allreduce_latency_s`).

Each kernel's fixed cost is `Efficiency.kernel_launch_s` ([A] 5 us: a CUDA launch plus
a small kernel's ramp, the figure kvstage's copy-kernel model already carried; not
fitted to benchmarks/published_serving.py).

All-reduce latency of n GPUs, a + b (n - 2):

- NVLink / NVSwitch (and Infinity Fabric, [A] alike): a = 6 us, [P] an 8 x H100 HGX
  node, NCCL 2.20 with CUDA graphs, 2 GPUs (https://github.com/NVIDIA/nccl/issues/1259);
  b = 3.95 us per further GPU, [P] the slope of NCCL's ring latency on a DGX-A100,
  10 us at 2 GPUs to 33.7 us at 8 (https://github.com/NVIDIA/nccl-tests/issues/123).
- PCIe (no NVLink): 48 us at 8 GPUs, [P] the mean of two 8-GPU PCIe nodes' 8-byte
  all-reduce, 42.1 us (https://github.com/NVIDIA/nccl/issues/1530) and 54.2 us
  (https://github.com/NVIDIA/nccl/issues/1439); [A] the NVLink intercept, so
  b = (48 - 6) / 6 = 7 us per further GPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstage.shared.serving.gpus import efficiency, side_gpu

if TYPE_CHECKING:
    from kvstage.shared.scenario import Scenario

__all__ = ["allreduce_latency_s", "kernel_floor_s", "kernels_per_layer"]

_DENSE_LAYER = 10  # [C] vLLM LlamaDecoderLayer, the TP all-reduces apart
_MOE_EXTRA = 7 - 3  # routed experts' 7 kernels for the dense MLP's 3
_MLA_EXTRA = 10 - 5  # absorbed MLA's 10 attention kernels for GQA's 5
_SHARED_EXPERT = 3  # gate-up, activation, down
_DENSE_GEMMS = 4  # QKV, O, gate-up, down: an FP8 quantization kernel before each
_MLA_GEMMS = 5 - 2  # MLA's q_a/kv_a, q_b and O for GQA's QKV and O

# (a, b) of a + b (n - 2), seconds, by the kind of scale-up link
_AR_NVLINK = (6e-6, 3.95e-6)
_AR_PCIE = (6e-6, 7e-6)


def kernels_per_layer(s: Scenario) -> int:
    """Kernels one decoder layer launches (the TP all-reduces apart)."""
    m = s.model
    n = _DENSE_LAYER
    gemms = _DENSE_GEMMS
    if m.experts:
        n += _MOE_EXTRA
        if m.attention == "mla":  # [C] DeepSeek-V2/V3 and Kimi-K2 keep shared experts
            n += _SHARED_EXPERT
            gemms += 2
    if m.attention == "mla":
        n += _MLA_EXTRA
        gemms += _MLA_GEMMS
    if m.weight_dtype == "fp8":
        n += gemms
    return n


def kernel_floor_s(s: Scenario) -> float:
    """The fixed cost of one forward's kernels on one GPU: layers x kernels a layer x
    the per-kernel cost."""
    return s.model.layers * kernels_per_layer(s) * efficiency(s).kernel_launch_s


def allreduce_latency_s(s: Scenario, side: str, n: int) -> float:
    """Latency of one all-reduce over `n` GPUs of `side`'s scale-up link (0 for one GPU)."""
    if n <= 1:
        return 0.0
    gpu = side_gpu(s, side)
    a, b = _AR_PCIE if gpu.scaleup.startswith("PCIe") else _AR_NVLINK
    if gpu.allreduce_latency_s is not None:  # a user's own GPU: its measured latency
        a = gpu.allreduce_latency_s
    return a + b * (n - 2)
