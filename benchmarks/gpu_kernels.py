"""Gather and scatter bandwidth on a GPU, as a share of a plain device-to-device copy of
the same bytes measured in the same run (run by hand on a GPU machine; prints a table).
With --device cpu the same table for host memory, the memory hardware mode uses here,
plus the hw forward's pattern fill and the decode's full verification of the block
(hw/rank/kvpool.py), each against the same copy (run it with OMP_NUM_THREADS=1: a rank
process runs one intra-op thread).

A writer block of a full chunk (Llama-3-70B-like: 80 layers scaled to `--layers`, 8 KV
heads per prefill rank, head_dim 128, bf16, 8192 tokens by default) is gathered from a
paged pool into a contiguous buffer, and scattered back into another pool, each timed
with CUDA events over several repetitions after a warm-up; the baseline is
`dst.copy_(src)` of the same number of bytes. Goal (issue 12): at least 0.8 of the copy.
On a GPU with Triton, also the moves that carry the write tag's hash in their own pass
(hw/rank/kernels.py `gather_hashed`, `scatter_hashed`; the scatter of one writer block):
what the default `transfer.verify_writes = "mac"` runs on GPU pools.

    python benchmarks/gpu_kernels.py [--layers 8] [--tokens 8192] [--heads 8] [--reps 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from checksum_cost import RDMA_400G_BPS, best_wall  # benchmarks/, beside this script

from kvstage.hw.rank.kernels import (
    block_bytes,
    fused_tag_possible,
    gather,
    gather_hashed,
    scatter,
    scatter_hashed,
)
from kvstage.hw.rank.kvpool import KVPool, fill_pattern, verify
from kvstage.hw.rank.writemac import digest_tag
from kvstage.shared.layout import Geometry


def timed(fn, reps: int, cuda: bool = True) -> float:
    """Median seconds of `fn` over `reps` runs, by CUDA events, after two warm-ups."""
    for _ in range(2):
        fn()
    if not cuda:  # a dry run on the CPU checks the script, not the figures
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t) / reps
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument(
        "--heads", type=int, default=8, help="KV heads per prefill rank (decode: 2x, fan-in of 2)"
    )
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument(
        "--device", default="cuda", help="cuda, or cpu (host memory; adds fill and verify)"
    )
    args = p.parse_args()
    dev = args.device
    cuda = dev.startswith("cuda")
    assert not cuda or torch.cuda.is_available(), "no CUDA device visible"
    page = 16
    pages = args.tokens // page
    src = KVPool(args.layers, pages + 8, page, args.heads, args.head_dim, "bf16", device=dev)
    nbytes = block_bytes(src, pages, args.heads)
    block = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    # the decode rank holds 2 writers' heads: this writer's block lands at head offset 0
    g = Geometry(
        2, 1, 2 * args.heads, args.layers, args.head_dim, 2, page, chunked_prefill_size=args.tokens
    )
    layout = g.staging_layout(0, pages)
    dst = KVPool(args.layers, pages + 8, page, 2 * args.heads, args.head_dim, "bf16", device=dev)
    region = torch.zeros(layout.region_bytes, dtype=torch.uint8, device=dev)
    region[:nbytes].copy_(block)
    a, b = (
        torch.empty(nbytes, dtype=torch.uint8, device=dev),
        torch.empty(nbytes, dtype=torch.uint8, device=dev),
    )

    copy_s = timed(lambda: b.copy_(a), args.reps, cuda)
    gather_s = timed(lambda: gather(src, 4, pages, 0, args.heads, block), args.reps, cuda)
    scatter_s = timed(lambda: scatter(dst, 4, pages, region, layout), args.reps, cuda)
    scatter_bytes = layout.region_bytes
    bar: list[tuple[str, float, int]] = []
    rows = [
        ("copy", copy_s, nbytes),
        ("gather", gather_s, nbytes),
        ("scatter", scatter_s, scatter_bytes),
    ]
    if fused_tag_possible(
        src, block
    ):  # (on the CPU: a dry run under Triton's interpreter)  # the write tag's hash inside the move
        key = bytes(range(32))
        first = layout.blocks[0]
        heads = (first.heads.dst_head_start, first.heads.num_heads)
        blk = region[first.offset : first.offset + first.nbytes]
        gather_tag_s = timed(
            lambda: gather_hashed(src, 4, pages, 0, args.heads, key, block), args.reps, cuda
        )

        def scatter_all() -> None:  # the decode without the tiled copy: block by block
            for b in layout.blocks:
                region_b = region[b.offset : b.offset + b.nbytes]
                scatter_hashed(
                    dst, 4, pages, region_b, b.heads.dst_head_start, b.heads.num_heads, key
                )

        scatter_tag_s = timed(scatter_all, args.reps, cuda)
        rows += [
            ("gather+tag", gather_tag_s, nbytes),
            (
                "scatter+tag",
                timed(lambda: scatter_hashed(dst, 4, pages, blk, *heads, key), args.reps, cuda),
                first.nbytes,
            ),
            ("scatter+tag, all blocks", scatter_tag_s, scatter_bytes),
        ]
        digest = gather_hashed(src, 4, pages, 0, args.heads, key)
        if cuda:
            torch.cuda.synchronize()
        finish_s = best_wall(lambda: digest_tag(key, 1, 2, 3, digest, nbytes), args.reps)
        bar = [
            ("writer", gather_tag_s - gather_s + finish_s, nbytes),
            ("decode", scatter_tag_s - scatter_s + len(layout.blocks) * finish_s, scatter_bytes),
        ]
    if not cuda:  # the CPU-side work of a hw run: the prefill's forward and the decode's check
        heads = list(range(args.heads))
        rows.append(
            (
                "fill",
                timed(lambda: fill_pattern(src, 4, pages, 7, 0, heads), args.reps, cuda),
                nbytes,
            )
        )
        fill_pattern(src, 4, pages, 7, 0, heads)
        checked, wrong = verify(src, 4, pages, 7, 0, heads)
        assert checked == nbytes and wrong == 0, (checked, wrong)
        rows.append(
            ("verify", timed(lambda: verify(src, 4, pages, 7, 0, heads), args.reps, cuda), nbytes)
        )
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    print(
        f"{name}: block {nbytes / 2**20:.1f} MiB "
        f"({args.layers} layers x {args.tokens} tokens x {args.heads} heads x {args.head_dim})"
    )
    print(f"{'kernel':<24} {'time':>10} {'GB/s (read+write)':>18} {'share of copy':>14}")
    copy_bw = 2 * nbytes / copy_s / 1e9
    for name, s, n in rows:
        bw = 2 * n / s / 1e9
        print(f"{name:<24} {s * 1e3:8.3f} ms {bw:18.1f} {bw / copy_bw:14.2f}")
    if bar:
        print(
            f"the write tag on a block's path (digest to the host and its finish: "
            f"{finish_s * 1e3:.3f} ms a block), against the bytes' time on the wire at "
            f"{RDMA_400G_BPS * 8 / 1e9:.0f} Gb/s (rdma-400g) (bar: <= 5%):"
        )
        for side, extra, n in bar:
            wire = n / RDMA_400G_BPS
            print(
                f"  {side}: +{extra * 1e3:.3f} ms over {n / 2**20:.0f} MiB's "
                f"{wire * 1e3:.2f} ms = {extra / wire:.1%}"
            )


if __name__ == "__main__":
    main()
