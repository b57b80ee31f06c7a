"""How much slower a GEMM runs beside a DeepEP kernel, read from DeepSeek's own trace.

Source: https://github.com/deepseek-ai/profile-data (commit 4496024), `train.json`: a
PyTorch-profiler trace of DeepSeek-V3's training on H800 (EP64, TP1, 4K sequences, one
forward and one backward chunk of 4 MoE layers overlapped, routing "absolutely
balanced" by their README), DeepEP's internode kernels on 20 SMs and the FP8 GEMMs
launched on the other 112 whether or not a DeepEP kernel runs. Fetch it with
`git clone https://github.com/deepseek-ai/profile-data` (3.1 MB), then:

    .venv/bin/python benchmarks/overlap_contention.py PATH/train.json

Each compute-stream kernel is placed by the profiler's annotation its launch falls in
(`attn(F)`, `mlp(F)`, `attn(B)`, ...: each stage runs once a layer, four times in the
trace) and by its order among the kernels of the same name and grid in that stage, so
one place is one shape, met four times. A place's kernels are compared where one ran
alone on the GPU (no kernel of any other stream beside it for 98% of its time) and
where another ran under a DeepEP `internode::dispatch` or `internode::combine` for 98%
of its time with no other compute stream beside it. shared/serving/prefill_tbo.py
`GEMM_CONTENTION` takes the GEMM total.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections import defaultdict

DEEPEP = re.compile(r"internode::(dispatch|combine)<")
COMM_STREAM_KERNEL = re.compile(r"dpsk::ep::")
GEMM = re.compile(r"GemmKernel|xmma_gemm")  # DeepSeek's FP8 GEMMs, cuBLAS's


def _share(a: float, b: float, spans: list[tuple[float, float]]) -> float:
    """The share of [a, b) that `spans` (not overlapping each other) cover."""
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in spans) / (b - a)


def main(path: str) -> None:
    events = json.load(open(path))["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    stages = sorted(
        (e for e in events if e.get("cat") == "user_annotation" and "(" in e["name"]),
        key=lambda e: e["ts"],
    )
    launches = {
        e["args"]["correlation"]: e["ts"]
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    seen: dict[str, int] = defaultdict(int)
    nth = []  # each stage's occurrence (the layer)
    for st in stages:
        nth.append(seen[st["name"]])
        seen[st["name"]] += 1
    span = {id(k): (k["ts"], k["ts"] + k["dur"]) for k in kernels}
    comm_streams = {k["tid"] for k in kernels if COMM_STREAM_KERNEL.search(k["name"])}
    deepep = [span[id(k)] for k in kernels if DEEPEP.search(k["name"])]
    by_stream: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for k in kernels:
        by_stream[k["tid"]].append(span[id(k)])

    places: dict[tuple, dict[int, tuple[float, str]]] = defaultdict(dict)
    order: dict[tuple, int] = defaultdict(int)
    for k in kernels:
        a, b = span[id(k)]
        if k["tid"] in comm_streams or b <= a or k["args"]["correlation"] not in launches:
            continue
        t = launches[k["args"]["correlation"]]
        at = next((i for i, st in enumerate(stages) if st["ts"] <= t <= st["ts"] + st["dur"]), None)
        if at is None:
            continue
        name = k["name"].split("(")[0]
        key = (stages[at]["name"], name, tuple(k["args"]["grid"]))
        n = order[(at, *key)]
        order[(at, *key)] += 1
        others = [s for tid, ss in by_stream.items() if tid != k["tid"] for s in ss]
        compute_others = [
            s for tid, ss in by_stream.items() if tid not in (k["tid"], *comm_streams) for s in ss
        ]
        if _share(a, b, others) < 0.02:
            state = "alone"
        elif _share(a, b, deepep) > 0.98 and _share(a, b, compute_others) < 0.02:
            state = "under"
        else:
            continue
        places[(*key, n)][nth[at]] = (k["dur"], state)

    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for (stage, name, grid, n), runs in sorted(places.items()):
        alone = [d for d, st in runs.values() if st == "alone"]
        under = [d for d, st in runs.values() if st == "under"]
        if not alone or not under:
            continue
        kind = "gemm" if GEMM.search(name) else "other"
        a, u = statistics.mean(alone), statistics.mean(under)
        t = totals[kind]
        t[0], t[1], t[2] = t[0] + a, t[1] + u, t[2] + 1
        if kind == "gemm":
            short = re.sub(r"^.*?(\w+)::GemmKernel>?$", r"\1", name)[:28]
            print(f"{stage:8s} {short:28s} grid {grid!s:13s} #{n}  alone {alone} us"
                  f"  under DeepEP {under} us  x{u / a:.3f}")  # fmt: skip
    for kind, (a, u, n) in totals.items():
        print(f"{kind}: {n} places, {a:,.0f} us alone, {u:,.0f} us under DeepEP, x{u / a:.3f}")


if __name__ == "__main__":
    main(sys.argv[1])
