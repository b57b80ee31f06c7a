"""One TP all-reduce's time, by message size and world size.

Engines run a TP all-reduce two ways, by its size:

- up to `CUSTOM_ALLREDUCE_MAX_BYTES` (8 MiB) their own one-shot / two-shot kernel over
  NVLink peer memory: [C] vLLM `CustomAllreduce(max_size=8192 * 1024)`
  (vllm/distributed/device_communicators/custom_all_reduce.py), which SGLang's
  srt/distributed/device_communicators/custom_all_reduce.py carries over; a larger
  tensor falls back to NCCL. [A] TensorRT-LLM's AUTO strategy alike. These, a decode
  step's, cost the ring's bytes at `Efficiency.allreduce` of the link plus the
  latency of the group (shared/serving/kernels.py `allreduce_latency_s`), as before;
- above it NCCL, whose bus bandwidth falls well short of the link for the 10-100 MB
  messages of a prefill (tokens x hidden x 2 B): where a GPU has a published
  nccl-tests curve (`NCCL_BUSBW`), its bus bandwidth at that size, so one all-reduce
  takes 2 (n-1)/n x bytes / busbw (nccl-tests' own definition of busbw, doc/
  PERFORMANCE.md; the curve's time includes NCCL's latency, so none is added).

The curves were measured on 8 GPUs. A ring of n GPUs moves the message in 2 (n-1)
steps of bytes / n each; [A] a step of the same size reaches the same share of the
link whatever n, so n GPUs at `bytes` read the 8-GPU curve at bytes x 8 / n. The curve
is capped at the ring's plateau, the link x `Efficiency.allreduce`: the H200 curve's
top (to ~480 GB/s) is NVLink SHARP's, which the engines switch off ([C] SGLang's
`_set_envs_and_config` sets NCCL_NVLS_ENABLE=0 and NCCL_CUMEM_ENABLE=0, srt/
entrypoints/engine.py; vLLM NCCL_CUMEM_ENABLE=0, without which NCCL has no NVLS), and
[P] NCCL_ALGO=RING on 8 x H100 reaches 365-370 GB/s from 2 to 8 GPUs
(https://github.com/NVIDIA/nccl/issues/1455), the 0.8 of 450 GB/s `allreduce` is.
[A] Below the plateau the NVLS curve stands for the ring's (no ring curve by size was
found for H100 / H200; A100 has no NVLink SHARP, its curve is a ring's or tree's).

Whether prefill hides the all-reduce under compute: it does not by default. [C] vLLM's
`PassConfig.enable_async_tp` and `enable_sequence_parallelism` (the GEMM +
collective fusion) default to False (vllm/config/compilation.py); SGLang's two-batch
overlap (`--enable-two-batch-overlap`) splits an expert-parallel (DeepEP) batch, not
a TP all-reduce. kvstage charges it in series with the forward's kernels.

A GPU without a curve keeps the bandwidth-and-latency model at every size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstage.shared.serving.gpus import _interpolate, efficiency, side_gpu
from kvstage.shared.serving.kernels import allreduce_latency_s

if TYPE_CHECKING:
    from kvstage.shared.scenario import Scenario

__all__ = ["CUSTOM_ALLREDUCE_MAX_BYTES", "NCCL_BUSBW", "allreduce_one_s", "nccl_busbw_Bps"]

CUSTOM_ALLREDUCE_MAX_BYTES = 8192 * 1024

_MEASURED_ON = 8  # GPUs of the curves below

# [P] Azure ND H200 v5 (8 x H200, NVLink 4 / NVSwitch, NCCL 2.20.5), nccl-tests
# all_reduce_perf in place, NVLS, busbw GB/s by message bytes
# (https://github.com/Azure/AI-benchmarking-guide/blob/7f20e5f/Azure_Results/ND_H200_v5_results.md).
# [A] h100-sxm alike: the same NVLink 4 (18 links, 450 GB/s a direction) and NVSwitch.
_NVLINK4 = (
    (1 << 20, 52.96),
    (2 << 20, 88.78),
    (4 << 20, 138.44),
    (8 << 20, 181.94),
    (16 << 20, 240.41),
    (32 << 20, 300.91),
    (64 << 20, 368.11),
    (128 << 20, 412.45),
    (256 << 20, 432.24),
    (512 << 20, 442.72),
    (1 << 30, 467.58),
)
# [P] Azure ND A100 v4 (8 x A100 SXM4 80GB, NVLink 3, NCCL 2.18.5), same test
# (https://github.com/Azure/AI-benchmarking-guide/blob/3bb66ca/Azure_Results/ND_A100_v4_results.md).
_NVLINK3 = (
    (1 << 20, 36.22),
    (2 << 20, 53.54),
    (4 << 20, 71.43),
    (8 << 20, 89.99),
    (16 << 20, 109.22),
    (32 << 20, 132.77),
    (64 << 20, 166.63),
    (128 << 20, 174.18),
    (256 << 20, 213.87),
    (512 << 20, 221.58),
    (1 << 30, 228.10),
)
NCCL_BUSBW: dict[str, tuple[tuple[int, float], ...]] = {
    "h100-sxm": _NVLINK4,
    "h200": _NVLINK4,
    "a100-80g": _NVLINK3,
}


def nccl_busbw_Bps(s: Scenario, side: str, nbytes: float, n: int) -> float | None:
    """NCCL's all-reduce bus bandwidth (B/s) for `nbytes` over `n` GPUs of `side`, or
    None where the GPU has no published curve."""
    gpu = side_gpu(s, side)
    pts = NCCL_BUSBW.get(gpu.name)
    if pts is None:
        return None
    busbw = _interpolate(pts, round(nbytes * _MEASURED_ON / n)) * 1e9
    return min(busbw, gpu.scaleup_Bps * efficiency(s).allreduce)


def allreduce_one_s(s: Scenario, side: str, nbytes: float, n: int) -> float:
    """One all-reduce of `nbytes` (the whole tensor) over `n` GPUs of `side`."""
    if n <= 1:
        return 0.0
    ring = nbytes * 2 * (n - 1) / n
    busbw = nccl_busbw_Bps(s, side, nbytes, n) if nbytes > CUSTOM_ALLREDUCE_MAX_BYTES else None
    if busbw is not None:
        return ring / busbw
    link = side_gpu(s, side).scaleup_Bps * efficiency(s).allreduce
    return ring / link + allreduce_latency_s(s, side, n)
