"""Time a forward's memory-bound kernels between its matmuls on a GPU, as a share of HBM.

The serving model prices a prefill forward's norms and activations by their bytes at
`Efficiency.elementwise_hbm` of the GPU's HBM (shared/serving/compute.py
`elementwise_s`). This measures that share at Llama 3's prefill shapes: a fused
residual-add + RMSNorm (reads the hidden state and the residual, writes both), SiLU-and-
mul (reads gate and up, writes their product) and rotary on q and k with v copied
beside them (the KV write), each as one fused kernel (torch.compile, Inductor's Triton
kernels: the kind vLLM's compiled path runs), and a plain copy (the HBM ceiling a
streaming kernel reaches). Bytes are what each kernel must read and write once; time is
the median of replays of a CUDA graph of 10 calls (the host's launch cost off the GPU's
timeline: benchmarks/profile_kernels.py `_median_s`). Each shape is compiled on its own
(`dynamic=False`): with dynamic shapes, the shapes after the first ran Inductor's
generic kernels at 0.17-0.57 of HBM on the H200 (a first run, 2026-12-04).

    python3 benchmarks/profile_elementwise.py --hbm-gbs 4800        # on a GPU (H200)
    python3 benchmarks/profile_elementwise.py --device cpu --tokens 64 --eager   # dry run
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
from profile_kernels import _median_s  # benchmarks/: a graph of 10 calls, replayed

# [C] Llama 3 8B and 70B config.json: hidden, query heads x head_dim, KV heads x
# head_dim, intermediate
SHAPES = {"llama-3-8b": (4096, 4096, 1024, 14336), "llama-3-70b": (8192, 8192, 1024, 28672)}


def add_rms_norm(x, residual, weight):
    residual = x + residual
    var = residual.float().pow(2).mean(-1, keepdim=True)
    return (residual.float() * torch.rsqrt(var + 1e-5)).to(x.dtype) * weight, residual


def silu_and_mul(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rotary_and_kv(qkv, cos, sin, q_width, kv_width):
    q, k, v = qkv.split((q_width, kv_width, kv_width), dim=-1)

    def rot(t):
        t = t.unflatten(-1, (-1, 128))
        a, b = t.chunk(2, dim=-1)
        c, s = cos[:, None, :], sin[:, None, :]
        return torch.cat((a * c - b * s, b * c + a * s), dim=-1).flatten(-2)

    return rot(q), rot(k), v.clone()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", default="2048,7000")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--hbm-gbs", type=float, default=4800.0, help="the GPU's datasheet HBM")
    ap.add_argument("--eager", action="store_true", help="no torch.compile (dry runs)")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    dt = torch.float16
    name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"# {name}, torch {torch.__version__}, fp16, HBM {args.hbm_gbs:g} GB/s")
    compile_ = (lambda f: f) if args.eager else (lambda f: torch.compile(f, dynamic=False))
    fused_norm, fused_act, fused_rot = (compile_(f) for f in (add_rms_norm, silu_and_mul,
                                                              rotary_and_kv))  # fmt: skip
    print(f"{'model':<12} {'kernel':<16} {'tokens':>6} {'MB':>8} {'us':>9} {'TB/s':>6} share")
    for model, (h, q, kv, ffn) in SHAPES.items():
        for m in (int(t) for t in args.tokens.split(",")):
            dev = args.device
            x, res = (torch.randn(m, h, dtype=dt, device=dev) for _ in range(2))
            w = torch.randn(h, dtype=dt, device=dev)
            gate_up = torch.randn(m, 2 * ffn, dtype=dt, device=dev)
            qkv = torch.randn(m, q + 2 * kv, dtype=dt, device=dev)
            cos, sin = (torch.randn(m, 64, dtype=dt, device=dev) for _ in range(2))
            src, dst = (
                torch.randn(m, 2 * ffn, dtype=dt, device=dev),
                torch.empty(m, 2 * ffn, dtype=dt, device=dev),
            )
            cases = (
                ("add+rmsnorm", partial(fused_norm, x, res, w), 4 * m * h),
                ("silu_and_mul", partial(fused_act, gate_up), 3 * m * ffn),
                ("rotary+kv", partial(fused_rot, qkv, cos, sin, q, kv), 2 * m * (q + 2 * kv)),
                ("copy", partial(dst.copy_, src), 2 * 2 * m * ffn),
            )
            for kernel, fn, elements in cases:
                t = _median_s(fn, args.reps, cuda)
                nbytes = elements * 2
                tbs = nbytes / t / 1e12
                print(f"{model:<12} {kernel:<16} {m:>6} {nbytes / 1e6:8.1f} {t * 1e6:9.1f} "
                      f"{tbs:6.2f} {tbs * 1e3 / args.hbm_gbs:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
