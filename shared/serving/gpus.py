"""The GPU catalogue `prefill.gpu` / `decode.gpu` name, and the achieved efficiencies.

Two kinds of numbers, kept apart on purpose:

- `GPUS`: what a GPU *is*, from its datasheet: memory, HBM bandwidth, dense bf16 and
  fp8 FLOP/s (no sparsity), and the scale-up link (NVLink, Infinity Fabric, or PCIe
  where a card has none) per direction. Every entry names its source. No simulated
  GPU ever goes faster than these (tests/test_physics.py holds each bound).
- `Efficiency`: how much of it serving achieves: prefill MFU by the forward's size,
  the share of HBM bandwidth a decode step reaches, a per-step CPU overhead, the
  share of the scale-up link an all-reduce reaches, and the share of HBM a copy
  kernel (gather, scatter) reaches. These are defaults with their sources; a scenario
  overrides them (`prefill.mfu`, `decode.hbm_efficiency`, `decode.step_overhead_ms`).

Memory is in GiB because HBM comes in binary stacks: an "80 GB" H100 shows 81,559
MiB in nvidia-smi (79.6 GiB), so the datasheet figure is GiB to within 1%.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvstage.shared.scenario import Scenario

__all__ = [
    "DEFAULT_EFFICIENCY",
    "DEFAULT_GPU",
    "GPUS",
    "WEIGHT_BYTES",
    "Efficiency",
    "Gpu",
    "efficiency",
    "gpu_names",
    "side_gpu",
]


@dataclass(frozen=True, slots=True)
class Gpu:
    """One GPU's datasheet numbers, in the units datasheets quote them in."""

    name: str
    memory_gib: float
    hbm_gbs: float  # GB/s of HBM (GDDR for the A10)
    bf16_tflops: float  # dense
    fp8_tflops: float | None  # dense; None: no fp8 tensor cores (fp8 runs at the bf16 rate)
    scaleup_gbs: float  # per direction per GPU: NVLink / Infinity Fabric, or PCIe
    scaleup: str  # what that link is
    source: str
    # one all-reduce's latency over 2 GPUs (a user's own GPU may give it); None: the
    # link's (shared/serving/kernels.py, by whether `scaleup` is PCIe)
    allreduce_latency_s: float | None = None
    fp4_tflops: float | None = None  # dense; None: no native FP4 tensor cores
    # runs CUDA kernels (the FP4 Marlin fallback needs them; False: AMD's ROCm)
    cuda: bool = True

    @property
    def hbm_Bps(self) -> float:
        return self.hbm_gbs * 1e9

    def peak_flops(self, dtype: str) -> float:
        """Dense FLOP/s of a matmul whose weights are `dtype` (fp8: the fp8 rate where
        there is one; fp32 at the bf16 rate would overstate it, so half of it).

        int4 (GPTQ / AWQ, W4A16): dequantized to BF16 inside the GEMM, at the BF16 rate;
        the dequantization costs no time of its own: [P] Marlin runs the INT4 x FP16
        matmul at "close to ideal (4x)" speed-up over FP16 up to batch 16-32 (the reads
        bound it) and dequantizes under the tensor-core work above that
        (https://github.com/IST-DASLab/marlin, README).
        fp4 (NVFP4): the native FP4 rate where the GPU has FP4 tensor cores (B200,
        GB200); elsewhere emulated as weight-only W4A16, dequantized to BF16 in the FP4
        Marlin kernel, at the BF16 rate ([C] vLLM marlin_utils_fp4.py and SGLang's
        `is_fp4_marlin_supported`: CUDA SM >= 7.5, not ROCm; a GPU without CUDA is
        refused, shared/scenario/schema.py)."""
        if dtype == "fp4" and self.fp4_tflops is not None:
            return self.fp4_tflops * 1e12
        if dtype == "fp8" and self.fp8_tflops is not None:
            return self.fp8_tflops * 1e12
        if dtype == "fp32":
            return self.bf16_tflops * 1e12 / 2
        return self.bf16_tflops * 1e12

    @property
    def scaleup_Bps(self) -> float:
        return self.scaleup_gbs * 1e9


_H100 = "https://www.nvidia.com/en-us/data-center/h100/ (H100 SXM column)"
GPUS: dict[str, Gpu] = {
    # [D] NVIDIA A10 datasheet: 24 GB GDDR6, 600 GB/s, BF16 125 TFLOPS dense (250 with
    # sparsity), no FP8; PCIe Gen4 x16 64 GB/s = 32 GB/s per direction, no NVLink
    # (https://www.nvidia.com/en-us/data-center/products/a10-gpu/).
    "a10": Gpu("a10", 24, 600, 125, None, 32, "PCIe Gen4 x16", "NVIDIA A10 datasheet"),
    # [D] NVIDIA A100 80GB SXM datasheet: 2,039 GB/s, BF16 312 TFLOPS dense, no FP8,
    # NVLink 3 600 GB/s total = 300 per direction
    # (https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf).
    "a100-80g": Gpu("a100-80g", 80, 2039, 312, None, 300, "NVLink 3", "NVIDIA A100 datasheet"),
    # [D] H100 SXM: 80 GB HBM3, 3.35 TB/s, BF16 989 / FP8 1,979 TFLOPS dense (the
    # datasheet's 1,979 / 3,958 are with sparsity), NVLink 4 900 GB/s total (_H100).
    "h100-sxm": Gpu("h100-sxm", 80, 3350, 989, 1979, 450, "NVLink 4", _H100),
    # [D] H200 SXM: 141 GB HBM3e, 4.8 TB/s, the H100's compute and NVLink
    # (https://www.nvidia.com/en-us/data-center/h200/).
    "h200": Gpu("h200", 141, 4800, 989, 1979, 450, "NVLink 4", "NVIDIA H200 datasheet"),
    # [D] HGX B200: 180 GB HBM3e and 8 TB/s per GPU, BF16 2.25 / FP8 4.5 PFLOPS dense
    # per GPU (18 / 36 for 8 GPUs, half the sparse figures), NVLink 5 1.8 TB/s total
    # (https://www.nvidia.com/en-us/data-center/hgx/).
    # FP4 9 PFLOPS dense per GPU (72 for 8 with sparsity, halved)
    "b200": Gpu(
        "b200", 180, 8000, 2250, 4500, 900, "NVLink 5", "NVIDIA HGX B200 datasheet", None, 9000
    ),
    # [D] NVIDIA L40S datasheet: 48 GB GDDR6, 864 GB/s, BF16 362 / FP8 733 TFLOPS dense
    # (733 / 1,466 with sparsity), PCIe Gen4 x16, no NVLink
    # (https://www.nvidia.com/en-us/data-center/l40s/).
    "l40s": Gpu("l40s", 48, 864, 362, 733, 32, "PCIe Gen4 x16", "NVIDIA L40S datasheet"),
    # [P] H20 (export part, no public NVIDIA datasheet): 96 GB HBM3, 4.0 TB/s, BF16 148 /
    # FP8 296 TFLOPS dense, NVLink 900 GB/s total, as reported from NVIDIA's partner
    # spec sheet (https://www.tomshardware.com/news/nvidia-readies-h20-ai-gpu-for-china).
    "h20": Gpu("h20", 96, 4000, 148, 296, 450, "NVLink 4", "H20 partner spec sheet (reported)"),
    # [D] AMD Instinct MI300X: 192 GB HBM3, 5.3 TB/s, BF16 1,307.4 / FP8 2,614.9 TFLOPS
    # dense, 7 Infinity Fabric links of 128 GB/s (bidirectional) = 448 GB/s per direction
    # (https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html).
    "mi300x": Gpu(
        "mi300x",
        192,
        5300,
        1307.4,
        2614.9,
        448,
        "Infinity Fabric",
        "AMD MI300X datasheet",
        cuda=False,
    ),
}
_GB200 = "https://www.nvidia.com/en-us/data-center/gb200-nvl72/ (the NVL72 rack's figures / 72)"
_ANT = "https://lmsys.org/blog/2025-09-26-sglang-ant-group/ (the post's H20 / H800 table)"
GPUS |= {
    # [P] H800 SXM (the H100's compute, NVLink cut to 400 GB/s): 80 GB, 3,352 GB/s,
    # BF16 989 / FP8 1,979 TFLOPS, NVLink 400 GB/s total = 200 per direction (_ANT).
    "h800": Gpu("h800", 80, 3352, 989, 1979, 200, "NVLink 4 (400 GB/s)", _ANT),
    # [P] H20 with 141 GB of HBM3e (the H20's compute and NVLink; no public NVIDIA
    # datasheet): 141 GB as sold (https://www.apetops-us.com/help/ai-293-h20-different-
    # memory-versions-a-deep-analysis-of-performance-differences-and-large-model-
    # adaptability); [A] the H200's HBM3e bandwidth, 4.8 TB/s (the same 141 GB stacks).
    "h20-141g": Gpu(
        "h20-141g", 141, 4800, 148, 296, 450, "NVLink 4", "H20 141 GB (reported); HBM [A] H200's"
    ),
    # [D] NVIDIA L40 datasheet: 48 GB GDDR6, 864 GB/s, BF16 181 / FP8 362 TFLOPS dense
    # (362 / 724 with sparsity), PCIe Gen4 x16, no NVLink
    # (https://www.nvidia.com/en-us/data-center/l40/).
    "l40": Gpu("l40", 48, 864, 181, 362, 32, "PCIe Gen4 x16", "NVIDIA L40 datasheet"),
    # [D] GB200 NVL72, per Blackwell GPU: 13.4 TB of HBM3e and 576 TB/s over 72 GPUs =
    # 186 GB and 8 TB/s; FP8 720 / BF16 360 PFLOPS with sparsity over 72 = 5 / 2.5 dense;
    # NVLink 5 130 TB/s over 72 = 1.8 TB/s = 900 GB/s per direction; FP4 1,440 PFLOPS
    # with sparsity over 72 = 10 dense (_GB200).
    "gb200": Gpu("gb200", 186, 8000, 2500, 5000, 900, "NVLink 5", _GB200, None, 10000),
}
DEFAULT_GPU = "h100-sxm"

# Bytes per weight by `model.weight_dtype`, the quantization scales included:
# - int4 (GPTQ / AWQ): 4 bits plus an FP16 scale and a 4-bit zero point per group of 128
#   weights ([C] AutoAWQ and GPTQ's default group size, q_group_size = 128):
#   (4 + 20 / 128) / 8 bytes;
# - fp4 (NVFP4): 4 bits plus one FP8 (E4M3) scale per block of 16 ([P] NVIDIA,
#   https://developer.nvidia.com/blog/introducing-nvfp4-for-efficient-and-accurate-low-precision-inference/):
#   (4 + 8 / 16) / 8 bytes.
WEIGHT_BYTES: dict[str, float] = {
    "fp32": 4.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0,
    "int4": (4 + 20 / 128) / 8,
    "fp4": (4 + 8 / 16) / 8,
}


def gpu_names() -> str:
    return ", ".join(GPUS)


# [P] DeepGEMM on H800 (see Efficiency.gemm_tables): 272, 489, 1,054 of 1,979 TFLOP/s;
# block-scaled FP8 (128 x 128 weight blocks), DeepSeek-V3's shapes
_HOPPER_FP8 = ((64, 272 / 1979), (128, 489 / 1979), (4096, 1054 / 1979))
# [K] per-tensor FP8 (cuBLASLt through torch._scaled_mm) on an H200, the mean share at
# each M over the per-rank GEMMs of Llama-3 8B (TP1-8) and 70B (TP2-8):
# benchmarks/data/kernels/kernels-h200-llama3-{8b,70b}.csv, read by
# shared/serving/kernel_table.py's rule (docs/results/2026-12-04-kernel-table-h200.md);
# the H100 SXM has the H200's SMs, clocks and FP8 peak
_HOPPER_FP8_TENSOR = (
    (512, 0.470),
    (1024, 0.543),
    (2048, 0.583),
    (4096, 0.606),
    (7000, 0.626),
    (8192, 0.610),
    (16384, 0.619),
)
# [P] torch BF16 matmul (cuBLAS) on H100 80GB HBM3, DeepSeek-V3's N = 2,112, K = 7,168:
# 50.5, 559.0, 711.4, 714.8 TFLOP/s at M = 16, 512, 4,096, 16,384 of 989
# (https://github.com/vllm-project/vllm/pull/23939, the benchmark's torch-bf16 column)
_HOPPER_BF16 = ((16, 50.48 / 989), (512, 558.99 / 989), (4096, 711.45 / 989), (16384, 714.78 / 989))
# [P] Maximum Achievable Matmul FLOPS, BF16, the best shape a brute-force search found
# (https://github.com/stas00/ml-engineering, compute/accelerator/README.md, "Maximum
# Achievable Matmul FLOPS comparison table"): A100 SXM 267.9 of 312 TFLOP/s (CUDA 12.1),
# MI300X 781.9 (ROCm 6.2) of our 1,307.4; the plateau only, so [A] the default curve's
# shape below it (`Efficiency.prefill_mfu`: 0.25 and 0.475 of the plateau at 64 and 128)
# [P] FlashMLA's BF16 decode on H20, 123 of 148 TFLOP/s (`Efficiency.attention_tables`)
_H20_ATTENTION_BF16 = ((4096, 123 / 148),)
_A100_BF16 = ((64, 0.25 * 267.9 / 312), (128, 0.475 * 267.9 / 312), (4096, 267.9 / 312))
# [P] FP8 GEMMs on Ada (FP8 inputs, FP32 accumulation, as every sm89 FP8 GEMM runs:
# `Efficiency.dense_gemm_tables`), TFLOP/s of the dtype's dense peak by rows M.
# L40S: torch._scaled_mm (cuBLASLt), the best of fast accumulation on and off, at Llama 2
# 7B's four TP1 shapes, 64 to 512 rows; the mean over the shapes (at 512 the two the
# thread lists) of 204.5 / 252.8 / 301.3 / 373.4 TFLOP/s of 733
# (https://github.com/vllm-project/vllm/pull/6677, the pytorch column)
_L40S_FP8 = ((64, 204.5 / 733), (128, 252.8 / 733), (256, 301.3 / 733), (512, 373.4 / 733))
# L40: SGLang's CUTLASS sm89 FP8 kernel (float accumulator), N = 6,144, K = 4,096
# (Llama 3.1 8B's QKV projection), 64 to 2,048 rows: 53.7 / 96.1 / 146.8 / 169.3 / 258.8 /
# 281.0 TFLOP/s of 362 (https://github.com/sgl-project/sglang/pull/3047, "GPU: sm89-L40",
# the sglang-fp8-bf16 column; its benchmark prints 2 M N K x 4 B (the float32 input's
# element size) / s, so a quarter of the figure is FLOP/s)
_L40_FP8 = (
    (64, 53.7 / 362),
    (128, 96.1 / 362),
    (256, 146.8 / 362),
    (512, 169.3 / 362),
    (1024, 258.8 / 362),
    (2048, 281.0 / 362),
)
_MI300X_BF16 = ((64, 0.25 * 781.9 / 1307.4), (128, 0.475 * 781.9 / 1307.4), (4096, 781.9 / 1307.4))


@dataclass(frozen=True, slots=True)
class Efficiency:
    """What serving achieves of a GPU's datasheet, with the source of each default.

    prefill_mfu: the share of peak matmul FLOP/s a matmul of M tokens reaches (M: the
    forward's tokens for the dense layers, the tokens each expert receives for a MoE
    layer), interpolated in log2(M) between the points and flat beyond them. The shape
    of the curve is [P] DeepGEMM's published GEMM rates on H800 (the H100's dense FP8
    peak, 1,979 TFLOP/s) over the six DeepSeek-V3 shapes it lists
    (https://github.com/deepseek-ai/DeepGEMM, README "Normal GEMMs for dense models",
    2025-02): mean 272 TFLOP/s at M = 64, 489 at M = 128, 1,054 at M = 4,096, i.e.
    0.26 and 0.46 of the M = 4,096 rate. The level is [P] the end-to-end MFU Meta
    reports for Llama 3 on 16K H100s in BF16, 38-43% (The Llama 3 Herd of Models,
    https://arxiv.org/abs/2407.21783, Table 4): 0.40 at 4,096 tokens and beyond (a
    large forward loses to norms, activations and launches what a training step
    does), so 0.40 x 0.26 = 0.10 at 64 and 0.40 x 0.46 = 0.19 at 128. [A] The same
    table for FP8 weights, against the FP8 peak, where `gemm_tables` has no table of
    the GPU's own. Not fitted to any serving row that
    benchmarks/published_serving.py checks.
    attention_mfu: the share of peak BF16 FLOP/s the attention kernels reach (QK^T and
    AV, on the activations' BF16). [P] FlashAttention-3 forward on H100 SXM, head dim
    128: about 500-740 TFLOP/s from 1K to 16K tokens (https://arxiv.org/abs/2407.08608,
    Fig. 5), and FlashMLA's decode 580 TFLOP/s on H800
    (https://github.com/deepseek-ai/FlashMLA): 0.5 of the 989.
    gemm_tables: per (GPU, weight dtype), where a kernel benchmark of that GPU and
    dtype was published, the share of the dtype's peak a GEMM of M rows reaches; it
    replaces `prefill_mfu` there, in prefill and in a compute-bound decode step alike.
    [P] h100-sxm / h200 at block-scaled FP8 ("fp8-block", `model.fp8_scaling`: a scale
    per 128 x 128 weight block, DeepSeek-V3's checkpoint): DeepGEMM's own rates on H800
    (the H100's SMs and FP8 peak) over the six DeepSeek-V3 shapes, mean 272 / 489 /
    1,054 TFLOP/s at M = 64 / 128 / 4,096 (the table `prefill_mfu` takes its shape
    from): 0.137, 0.247, 0.533 of 1,979. [K] h100-sxm / h200 at per-tensor FP8 (the
    usual FP8 checkpoint; `dense_gemm_tables`): cuBLASLt through torch._scaled_mm on an
    H200 at Llama-3 8B and 70B's per-rank shapes (benchmarks/profile_kernels.py,
    benchmarks/data/kernels/), 0.47 / 0.58 / 0.61 / 0.62 at M = 512 / 2,048 / 4,096 /
    16,384: a per-tensor GEMM scales once per output tile, where DeepGEMM promotes its
    block-scaled partial sums on the CUDA cores every 128 of K (its README); dense GEMMs
    only. [P] h20 at FP8: DeepGEMM's masked grouped GEMM on H20, 32 groups of 64 rows,
    N = 4,096, K = 7,168: 248 TFLOP/s, 0.84 of its 296
    (https://github.com/deepseek-ai/DeepGEMM/issues/114): a compute-poor GPU's GEMMs
    reach most of its peak already at 64 rows. [P] h100-sxm / h200 at BF16 (and FP16,
    the same tensor-core rate): torch's BF16 matmul (cuBLAS) on H100 80GB HBM3 at
    DeepSeek-V3's N = 2,112, K = 7,168, 50.5 / 559 / 711 / 715 TFLOP/s at M = 16 / 512 /
    4,096 / 16,384 (https://github.com/vllm-project/vllm/pull/23939): 0.051, 0.565,
    0.719, 0.723 of 989 (the H200 has the H100's SMs); measured on a dense GEMM, so
    `dense_gemm_tables`: a MoE layer's grouped GEMMs keep `prefill_mfu` (no grouped BF16
    rate found). [P] a100-80g and mi300x at BF16: the Maximum Achievable Matmul FLOPS
    of stas00/ml-engineering (the best shape of a brute-force search: 267.9 of 312, 781.9
    of 1,307.4), a plateau under which [A] `prefill_mfu`'s shape; a best shape's rate, so
    ~10% above a serving shape's where both are known (H100: 80% against vLLM's 72%);
    dense GEMMs only. [P] l40s and l40 at FP8 (Ada, sm89): every FP8 GEMM there
    accumulates in FP32 (cuBLASLt's FP8 matmul refuses CUBLAS_COMPUTE_16F,
    https://forums.developer.nvidia.com/t/fp8-fp16-accumulation-on-ada-rtx-4090/294400,
    which cites the Ada whitepaper's half-rate FP32 accumulation on GeForce; [C] SGLang's
    and vLLM's CUTLASS sm89 kernels take a float accumulator), the rate the datasheets'
    dense FP8 figures give: L40S 733 (full rate), L40 362 (half the L40S's on the same
    142 SMs). Measured at serving shapes: L40S, cuBLASLt at Llama 2 7B's shapes, 0.28 /
    0.34 / 0.41 / 0.51 of 733 at M = 64 / 128 / 256 / 512 (`_L40S_FP8`; SGLang's CUTLASS
    kernel on an L40S reaches 362 TFLOP/s, 0.49, at M = 2,048, N = 6,144, K = 4,096,
    https://github.com/sgl-project/sglang/pull/6756, the same plateau at 4x the rows);
    L40, SGLang's CUTLASS kernel, 0.15 / 0.27 / 0.41 / 0.47 / 0.71 / 0.78 of 362 at M =
    64 to 2,048 (`_L40_FP8`). Small-M points of both ran with the weights in the 96 MB
    L2 (above the GDDR6's 864 GB/s); the weights-read roofline prices that. Dense GEMMs
    only. The other GPUs and dtypes keep `prefill_mfu` (no per-GPU GEMM table found).
    decode_mfu: the share of peak FLOP/s a decode step's matmuls reach when the step
    is compute bound, on a GPU and dtype without a table of its own: the plateau of
    `prefill_mfu`, 0.40 ([P] as there). Not the small-M points: DeepGEMM's M = 64 and
    128 rows run at 1.5-2.7 TB/s, memory bound, and the decode step's bytes-read term
    already charges that.
    attention_tables: per (GPU, KV dtype), where an attention kernel benchmark of that
    GPU was published, the share of the BF16 peak attention reaches by keys per query;
    it replaces `attention_mfu` there. [P] h20 at BF16: FlashMLA's decode kernel on H20
    (deepseek-ai/FlashMLA tests/test_flash_mla.py, which counts FLOPs as kvstage does,
    2 (d_qk + d_v) heads x keys a query) at the shape of DeepSeek decode with DP
    attention and one MTP draft token: b = 128, s_q = 2, mean_sk = 4,096, h_q = 128,
    d = 576, dv = 512: 123 TFLOP/s, 0.83 of 148
    (https://github.com/deepseek-ai/FlashMLA/issues/30; s_q = 3: 127, h_q = 64, s_q =
    3, mean_sk = 8,192: 129). Corroborated by FlashAttention-3's forward on H20, head
    dim 128, 2,048 tokens: 126 TFLOP/s, 0.85
    (https://github.com/Dao-AILab/flash-attention/issues/1310): a compute-poor GPU's
    attention kernels, as its GEMMs (DeepGEMM's 0.84 below), reach most of its peak.
    attention_fp8_gain: how much faster attention runs on FP8 Q/K/V (an FP8 KV cache on
    a GPU with FP8 tensor cores) than on BF16. [P] FlashAttention-3 on H100: up to 740
    TFLOP/s in FP16, close to 1.2 PFLOP/s in FP8 (https://arxiv.org/abs/2407.08608,
    abstract): 1,200 / 740 = 1.62.
    decode_hbm: the share of HBM bandwidth a decode step's reads reach. [P] decode
    attention kernels reach 80-90% of peak bandwidth
    (https://flashinfer.ai/2024/02/02/introduce-flashinfer.html); [A] the GEMVs of the
    weights about as much: 0.8.
    step_overhead_s: CPU time per decode step the GPU does not hide (scheduling,
    sampling, launches under CUDA graphs) where no engine is named (`decode.engine`,
    or the `[engine]` preset; shared/serving/engine_step.py has each engine's). [A] 1 ms: SGLang's overlap scheduler hides
    most of it (https://lmsys.org/blog/2024-12-04-sglang-v0-4/, "zero-overhead batch
    scheduler"); what remains is the order of a millisecond. It replaces the 5 us x
    layers of kernel launches kvstage charged before.
    allreduce: the share of the scale-up link per direction a TP all-reduce (and an
    expert-parallel all-to-all inside a node) reaches. [A] 0.8: NCCL's ring
    all-reduce moves 2 (n-1)/n of the data per GPU and reaches most of NVLink's
    bandwidth for MB-sized messages (https://github.com/NVIDIA/nccl-tests,
    doc/PERFORMANCE.md defines the bus bandwidth this is a share of).
    The latency of one all-reduce is the interconnect's, by group size
    (shared/serving/kernels.py `allreduce_latency_s`).
    copy_hbm: the share of HBM bandwidth a gather or scatter copy kernel reaches. [A]
    80-90% (the figure kvstage's profiles carried): 0.85.
    kernel_launch_s: the fixed cost of one kernel (a copy kernel; each kernel of a
    forward, shared/serving/kernels.py). [A] 5 us, CUDA launch plus a small kernel's
    ramp (the figure kvstage's profiles carried).
    elementwise_hbm: the share of HBM bandwidth a forward's memory-bound kernels
    between its matmuls reach (fused residual-add + RMSNorm, rotary and the KV write,
    SiLU-and-mul; shared/serving/compute.py `elementwise_s`). [P] vLLM's
    fused_add_rms_norm at Llama prefill shapes, 2,048 tokens x 4,096 (Llama 3 8B) and x
    8,192 (70B) in FP16: 17.95 and 34.82 us for 67.1 and 134.2 MB read and written,
    3.74 and 3.85 TB/s (https://github.com/tile-ai/TileOPs/pull/2097, its comparison
    table; [A] on the H200 the series' PRs name, e.g. #2110's environment table: 0.78
    and 0.80 of its 4.8 TB/s). Measured on a lent H200 (2026-12-04,
    benchmarks/profile_elementwise.py, torch 2.11 Inductor kernels, Llama 3 8B and 70B
    at 2,048 and 7,000 tokens, docs/results/2026-12-04-published-serving-ttft.md):
    add + RMSNorm 0.75-0.83, SiLU-and-mul 0.87-0.91, rotary + KV copy 0.54-0.69, a
    plain copy 0.85-0.87; 0.79-0.81 over Llama 3 8B's bytes of a layer. 0.8.
    """

    prefill_mfu: tuple[tuple[int, float], ...] = ((64, 0.10), (128, 0.19), (4096, 0.40))
    gemm_tables: tuple[tuple[str, str, tuple[tuple[int, float], ...]], ...] = (
        ("h100-sxm", "fp8-block", _HOPPER_FP8),
        ("h200", "fp8-block", _HOPPER_FP8),
        ("h20", "fp8-block", ((64, 0.84),)),
    )
    # tables measured on dense GEMMs only: the grouped (MoE) GEMMs keep `gemm_tables` or
    # the default curve, a grouped kernel's rate not being a dense one's
    dense_gemm_tables: tuple[tuple[str, str, tuple[tuple[int, float], ...]], ...] = (
        ("h100-sxm", "fp8", _HOPPER_FP8_TENSOR),
        ("h200", "fp8", _HOPPER_FP8_TENSOR),
        ("h100-sxm", "bf16", _HOPPER_BF16),
        ("h200", "bf16", _HOPPER_BF16),
        ("a100-80g", "bf16", _A100_BF16),
        ("mi300x", "bf16", _MI300X_BF16),
        ("l40s", "fp8", _L40S_FP8),
        ("l40", "fp8", _L40_FP8),
    )
    # per (GPU, KV dtype): the share of the BF16 peak attention reaches by keys per
    # query; a user's kernel table (shared/serving/kernel_table.py) comes first
    attention_tables: tuple[tuple[str, str, tuple[tuple[int, float], ...]], ...] = (
        ("h20", "bf16", _H20_ATTENTION_BF16),
    )
    attention_mfu: float = 0.5
    attention_fp8_gain: float = 1200 / 740
    decode_mfu: float = 0.40
    decode_hbm: float = 0.8
    step_overhead_s: float = 1e-3
    allreduce: float = 0.8
    copy_hbm: float = 0.85
    kernel_launch_s: float = 5e-6
    elementwise_hbm: float = 0.8

    def mfu(self, tokens: int) -> float:
        """MFU of a matmul of `tokens` rows by the default table (`prefill_mfu`)."""
        return _interpolate(self.prefill_mfu, tokens)

    def gemm_table(
        self, gpu: str, dtype: str, grouped: bool = False
    ) -> tuple[tuple[int, float], ...] | None:
        """The GPU's own table for `dtype` (compute.py `gemm_dtype`: the weight dtype,
        or "fp8-block" for FP8 scaled per 128 x 128 block), or None. FP16 takes BF16's
        where it has none of its own (the same tensor-core rate), and an FP8 GEMM of one
        scaling the other's; a grouped (MoE) GEMM skips the tables measured on dense
        GEMMs only."""
        tables = self.gemm_tables if grouped else self.gemm_tables + self.dense_gemm_tables
        for want in _GEMM_FALLBACK.get(dtype, (dtype,)):
            for name, dt, pts in tables:
                if name == gpu and dt == want:
                    return pts
        return None

    def gemm_share(self, gpu: str, dtype: str, rows: int, grouped: bool = False) -> float:
        """The share of `dtype`'s peak on `gpu` a matmul of `rows` rows reaches: the
        GPU's own table where there is one, else the default."""
        pts = self.gemm_table(gpu, dtype, grouped)
        return self.mfu(rows) if pts is None else _interpolate(pts, rows)

    def gemm_plateau(self, gpu: str, dtype: str) -> float:
        """The share a large matmul reaches (a compute-bound decode step's matmuls):
        the GPU's own table's, else `decode_mfu`."""
        pts = self.gemm_table(gpu, dtype)
        return self.decode_mfu if pts is None else pts[-1][1]

    def attention_share(self, gpu: str, dtype: str, keys: int) -> float | None:
        """The share of the BF16 peak the first `attention_tables` curve of (`gpu`,
        `dtype`) gives at `keys` keys a query, or None where there is none."""
        for name, dt, pts in self.attention_tables:
            if name == gpu and dt == dtype:
                return _interpolate(pts, keys)
        return None

    def attention_rate(self, gpu: Gpu, kv_dtype: str, keys: float) -> float:
        """FLOP/s of attention on `gpu` with a `kv_dtype` KV cache, each query attending
        to `keys` keys: the kernel table's where it has (GPU, dtype), else the BF16 peak
        x `attention_mfu` (x `attention_fp8_gain` for an FP8 KV on a GPU with FP8
        tensor cores: FP8 attention). FP8 without a table of its own takes the BF16
        table's rate x `attention_fp8_gain` where the GPU has one."""
        fp8 = kv_dtype == "fp8" and gpu.fp8_tflops is not None
        peak, n = gpu.peak_flops("bf16"), max(1, round(keys))
        if fp8 and (own := self.attention_share(gpu.name, "fp8", n)) is not None:
            return peak * own
        base = self.attention_share(gpu.name, "bf16", n)
        rate = peak * (self.attention_mfu if base is None else base)
        return rate * self.attention_fp8_gain if fp8 else rate


# the tables a GEMM kind takes, in order, where the GPU has none of its own kind: FP16
# BF16's (the same tensor-core rate); an FP8 GEMM of one scaling the other's (the one
# measurement of the GPU's FP8 there is)
_GEMM_FALLBACK = {
    "fp16": ("fp16", "bf16"),
    "fp8": ("fp8", "fp8-block"),
    "fp8-block": ("fp8-block", "fp8"),
}


def _interpolate(pts: tuple[tuple[int, float], ...], tokens: int) -> float:
    """log2-interpolated between the points, flat beyond them."""
    xs = [t for t, _ in pts]
    if tokens <= xs[0]:
        return pts[0][1]
    if tokens >= xs[-1]:
        return pts[-1][1]
    i = bisect.bisect_right(xs, tokens)
    (t0, m0), (t1, m1) = pts[i - 1], pts[i]
    f = (math.log2(tokens) - math.log2(t0)) / (math.log2(t1) - math.log2(t0))
    return m0 + f * (m1 - m0)


DEFAULT_EFFICIENCY = Efficiency()


def side_gpu(s: Scenario, side: str) -> Gpu:
    """The GPU of `side` ("prefill" or "decode") of scenario `s`: the catalogue's, or
    the scenario's own [gpus.NAME] table."""
    name = s.prefill.gpu if side == "prefill" else s.decode.gpu
    own = s.gpus.get(name)
    return own.gpu(name) if own is not None else GPUS[name]


def efficiency(s: Scenario) -> Efficiency:
    """The achieved-efficiency defaults with scenario `s`'s overrides on top."""
    changes: dict[str, Any] = {}
    if s.prefill.mfu is not None:
        changes["prefill_mfu"] = ((1, s.prefill.mfu),)
    if s.decode.hbm_efficiency is not None:
        changes["decode_hbm"] = s.decode.hbm_efficiency
    if s.decode.step_overhead_ms is not None:
        changes["step_overhead_s"] = s.decode.step_overhead_ms / 1e3
    if s.serving.kernels is not None:
        # the table the loader read (shared/scenario/loading.py, kernel_table.py)
        table = s.serving.table
        if table is None:
            raise ValueError(
                f"serving.kernels = {s.serving.kernels!r} was not read: a scenario with a "
                "kernel table comes from load_scenario or scenario_from_dict"
            )
        # a user's FP8 rows are their GPU's FP8 GEMMs, whatever the model's scaling
        fp8 = tuple((g, "fp8-block", pts) for g, d, pts in table.gemm if d == "fp8")
        changes["gemm_tables"] = table.gemm + fp8 + DEFAULT_EFFICIENCY.gemm_tables
        changes["attention_tables"] = table.attention + DEFAULT_EFFICIENCY.attention_tables
    return replace(DEFAULT_EFFICIENCY, **changes) if changes else DEFAULT_EFFICIENCY
