"""Profile a GPU's matmuls and attention at a dense model's serving shapes, and write
them as a kernel table kvstage reads (`[serving] kernels = "FILE.csv"`,
shared/serving/kernel_table.py): the measured per-op table a planner gives for their
own GPU instead of the published defaults.

For each tensor-parallel size of `--tp`, the four GEMMs of a layer as one rank runs
them (QKV: N = (heads + 2 kv_heads) x head_dim / tp, K = hidden; O: N = hidden, K =
heads x head_dim / tp; gate+up: N = 2 ffn / tp, K = hidden; down: N = hidden, K = ffn
/ tp) at M tokens of `--tokens`, in BF16 (torch.matmul, cuBLAS) and FP8 (E4M3 with
per-tensor scales, torch._scaled_mm, cuBLASLt, BF16 out); and causal prefill attention
of S tokens (the rank's query heads, K and V expanded to them; M = S, N = (S + 1) // 2
keys a query, K = heads x 2 head_dim) through torch's scaled_dot_product_attention,
each backend that runs (flash: FlashAttention-2; cudnn), the fastest kept in the table.
Each time is the median of `--reps` runs by CUDA events after three warm-ups, on
random data. The defaults are Llama-3-8B's config.json (hidden 4,096, 32 heads, 8 KV
heads, head_dim 128, intermediate 14,336); `--model llama-3-70b` takes 70B's.

    python benchmarks/profile_kernels.py --out kernels-h200.csv              # on a GPU
    python benchmarks/profile_kernels.py --model llama-3-70b --tp 4,8 --out k70.csv
    python benchmarks/profile_kernels.py --device cpu --tokens 64 --seq 64   # a dry run

The CSV's `source` names the device, torch and CUDA versions and the date; extra
columns (`shape`, `tflops`, `backend`) are for the reader (the table ignores them).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import statistics
import sys
import time

import torch

# [C] each model's config.json on Hugging Face: hidden_size, num_attention_heads,
# num_key_value_heads, head_dim (hidden / heads), intermediate_size
MODELS = {
    "llama-3-8b": dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336),
    "llama-3-70b": dict(hidden=8192, heads=64, kv_heads=8, head_dim=128, ffn=28672),
}


def _median_s(fn, reps: int, cuda: bool, per_graph: int = 10) -> float:
    """Seconds of one `fn` on the GPU: `per_graph` calls captured in one CUDA graph,
    replayed `reps` times between CUDA events, the median over calls. A graph keeps
    the host's launch cost (tens of microseconds a call through torch: the whole of a
    small kernel's time if each call is timed alone) off the GPU's timeline."""
    for _ in range(3):
        fn()
    if not cuda:
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t) / reps
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):
            fn()  # warm on the capture stream (workspace allocations)
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(per_graph):
                    fn()
        torch.cuda.synchronize()
    except RuntimeError as exc:  # not capturable: back-to-back calls, launch cost included
        print(f"(no CUDA graph: {str(exc).splitlines()[0]})", file=sys.stderr)
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps * per_graph):
            fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3 / (reps * per_graph)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / per_graph)
    return statistics.median(times)


def gemm_shapes(m: dict, tp: int) -> list[tuple[str, int, int]]:
    """(name, N, K) of one rank's four GEMMs of a layer."""
    hd, h, kv = m["head_dim"], m["heads"], m["kv_heads"]
    for what, n in (("heads", h), ("kv_heads", kv), ("ffn", m["ffn"])):
        if n % tp:
            raise SystemExit(f"--tp {tp}: {what} = {n} is not a multiple of it")
    return [
        ("qkv", (h + 2 * kv) * hd // tp, m["hidden"]),
        ("o", m["hidden"], h * hd // tp),
        ("gate_up", 2 * m["ffn"] // tp, m["hidden"]),
        ("down", m["hidden"], m["ffn"] // tp),
    ]


def _gemm(dtype: str, M: int, N: int, K: int, dev: str):
    """A callable running one M x K by K x N product in `dtype`, or None where it cannot
    run here (FP8 needs a GPU with FP8 tensor cores)."""
    a = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    b = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
    if dtype == "bf16":
        bt = b.t()
        return lambda: torch.matmul(a, bt)
    if not dev.startswith("cuda") or torch.cuda.get_device_capability() < (8, 9):
        return None  # FP8 tensor cores: Ada (8.9) and Hopper (9.0) on
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()  # b column-major
    one = torch.tensor(1.0, device=dev)
    return lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16)


def _attention(backend: str, heads: int, hd: int, S: int, dev: str, batch: int = 1):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (torch.randn(batch, heads, S, hd, device=dev, dtype=torch.bfloat16) for _ in range(3))
    which = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
    which["math"] = SDPBackend.MATH

    def run():
        with sdpa_kernel(which[backend]):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3-8b", choices=sorted(MODELS))
    p.add_argument("--tp", default="1,2,4,8", help="tensor-parallel sizes, comma-separated")
    p.add_argument("--tokens", default="512,1024,2048,4096,7000,8192,16384")
    p.add_argument("--seq", default="512,2000,4096,7000,16384", help="attention: prompt tokens")
    p.add_argument("--gpu", default="h200", help="the kvstage GPU name the rows are for")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", required=True, help="the CSV to write")
    args = p.parse_args()
    dev = args.device
    cuda = dev.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device visible to torch")
    m = MODELS[args.model]
    tps = [int(t) for t in args.tp.split(",")]
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    source = (
        f"benchmarks/profile_kernels.py, {name}, torch {torch.__version__} "
        f"(CUDA {torch.version.cuda}), {datetime.date.today().isoformat()}"
    )
    rows = []
    for tp in tps:
        for shape, N, K in gemm_shapes(m, tp):
            for M in (int(t) for t in args.tokens.split(",")):
                for dtype in ("bf16", "fp8"):
                    fn = _gemm(dtype, M, N, K, dev)
                    if fn is None:
                        continue
                    s = _median_s(fn, args.reps, cuda)
                    rows.append(("gemm", dtype, M, N, K, s, f"{args.model} tp{tp} {shape}", ""))
        heads = m["heads"] // tp
        for S in (int(t) for t in args.seq.split(",")):
            best = None
            for backend in ("flash", "cudnn") if cuda else ("math",):
                try:
                    s = _median_s(
                        _attention(backend, heads, m["head_dim"], S, dev), args.reps, cuda
                    )
                except RuntimeError as exc:  # a backend that does not run on this GPU
                    print(f"attention {backend} S={S}: {str(exc).splitlines()[0]}", file=sys.stderr)
                    continue
                flops = 2 * S * ((S + 1) / 2) * heads * 2 * m["head_dim"]
                print(f"attention tp{tp} S={S} {backend}: {flops / s / 1e12:.1f} TFLOP/s")
                if best is None or s < best[0]:
                    best = (s, backend)
            if best:
                keys = (S + 1) // 2  # the table takes whole keys
                rows.append(
                    ("attention", "bf16", S, keys, heads * 2 * m["head_dim"], best[0],
                     f"{args.model} tp{tp} causal", best[1])
                )  # fmt: skip
    if cuda:  # the published setting, as a check of the method: 16K tokens a call
        for S in (2048, 4096, 8192):
            b = 16384 // S
            for backend in ("flash", "cudnn"):
                try:
                    s = _median_s(_attention(backend, 16, 128, S, dev, b), args.reps, cuda)
                except RuntimeError as exc:
                    print(f"check {backend} S={S}: {str(exc).splitlines()[0]}", file=sys.stderr)
                    continue
                flops = b * 2 * S * ((S + 1) / 2) * 16 * 2 * 128
                print(
                    f"check: causal, head_dim 128, 16 heads, batch {b} x {S} tokens, "
                    f"{backend}: {flops / s / 1e12:.1f} TFLOP/s (FlashAttention-3's Fig. 5 "
                    "setting, 2407.08608)"
                )
    with open(args.out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            ["op", "gpu", "dtype", "M", "N", "K", "time_us", "source", "shape", "tflops", "backend"]
        )
        for op, dtype, M, N, K, s, shape, backend in rows:
            tflops = 2 * M * N * K / s / 1e12
            w.writerow(
                [
                    op,
                    args.gpu,
                    dtype,
                    M,
                    N,
                    K,
                    f"{s * 1e6:.2f}",
                    source,
                    shape,
                    f"{tflops:.1f}",
                    backend,
                ]
            )
            print(
                f"{op:9} {dtype:4} {shape:24} M={M:<6} N={N:<8} K={K:<6} {s * 1e6:10.1f} us {tflops:7.1f} TFLOP/s {backend}"
            )
    print(f"{len(rows)} rows -> {args.out} ({source})")


if __name__ == "__main__":
    main()
