"""Decode attention's rate of reading KV on a GPU, by batch and context length.

One decode step's attention: `batch` queries of one token, each attending to its own
`tokens` keys and values (GQA: 32 query heads over 8 KV heads of 128, Llama 3 8B's
layer; BF16), through PyTorch's scaled_dot_product_attention (its flash or
memory-efficient kernel), timed as benchmarks/profile_kernels.py times a kernel (10
calls in a CUDA graph, the median of `--reps` replays: no launch cost). Printed: the time, the KV bytes read over it (TB/s) and their share of
the GPU's HBM bandwidth (`--hbm-tbps`, the datasheet's; H200: 4.8).

It tests a reading of benchmarks/nim_concurrency_itl.py: that decode attention over a few
hundred tokens a request reads KV well below the 0.8 of HBM kvstage prices. PyTorch's
kernels are not TensorRT-LLM's XQA nor FlashInfer's, so a low share here says such a
kernel exists, not which one an engine ran.

    python3 benchmarks/profile_decode_attention.py --hbm-tbps 4.8
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
import torch.nn.functional as F
from profile_kernels import _median_s  # benchmarks/: a graph of 10 calls, replayed
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}


def rate(batch: int, tokens: int, reps: int, backend: str) -> tuple[float, float]:
    """(seconds, bytes of K and V read) of one decode attention on `backend`."""
    q = torch.randn(batch, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, 8, tokens, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    with sdpa_kernel(BACKENDS[backend]):
        step = partial(F.scaled_dot_product_attention, q, k, v, enable_gqa=True)
        return _median_s(step, reps, cuda=True), 2 * k.numel() * k.element_size()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hbm-tbps", type=float, default=4.8)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__)
    print(f"{'kernel':9} {'batch':>5} {'tokens':>6} {'time':>9} {'TB/s':>6} {'of HBM':>6}")
    for backend in BACKENDS:
        for batch in (1, 8, 50, 100, 250):
            for tokens in (256, 700, 1200, 4096, 7500):
                if batch * tokens * 8 * 128 * 4 > 40e9:  # K and V under 40 GB
                    continue
                try:
                    t, nbytes = rate(batch, tokens, args.reps, backend)
                except RuntimeError as exc:  # the backend refuses the shape
                    print(f"{backend:9} {batch:>5} {tokens:>6} refused: {str(exc)[:60]}")
                    continue
                tbps = nbytes / t / 1e12
                share = tbps / args.hbm_tbps
                print(
                    f"{backend:9} {batch:>5} {tokens:>6} {t * 1e6:>7.1f}us {tbps:>6.2f} {share:>6.2f}"
                )


if __name__ == "__main__":
    main()
