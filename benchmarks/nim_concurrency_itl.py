"""Decode under concurrency: kvstage's decode step beside NIM's measured inter-token
latency from 1 to 250 concurrent requests (issue 35's "large-batch decode").

Source: benchmarks/data/nim_dli_itl.csv, the NVIDIA DLI NIM set's 200-token-prompt rows
(NIM with TensorRT-LLM engines, GenAI-Perf means; Llama 3 8B and 70B on A100 and H100,
FP16/BF16/FP8, TP1-8; 200, 1,000 or 2,000 output tokens; concurrency 1-250). The same
set's concurrency-1 TTFT rows are in benchmarks/published_serving.py (source 7).

What is compared: a closed-loop client keeps `c` requests in flight, so the engine
decodes a batch of about `c` requests whose KV grows from 200 to 200 + output tokens
([A] the mean: 200 + output / 2), and every output / c steps or so one request ends and
a new 200-token prompt joins: [A] its prefill forward adds to the step it joins, c /
output of a forward a step on average. Simulated ITL = kvstage's decode step at batch c
(`decode.engine = "trtllm"`, the dtype and TP of the row) + that share of a 200-token
prefill forward. Published ITL = the row's mean inter-token latency (duplicated runs
averaged).

Printed: per row, both and their ratio; per concurrency, the median ratio; and per
model, GPU, TP and dtype, what the measured ITL adds per extra request in flight beyond
what kvstage's step adds (the excess slope, us per request per step, from concurrency 1
to 250 at 200 + 1,000 tokens). No timing is taken here: nothing depends on the host's
load.

    .venv/bin/python benchmarks/nim_concurrency_itl.py
"""

from __future__ import annotations

import csv
import statistics
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from published_serving import _load  # noqa: E402

from kvstage.shared.serving.compute import decode_step, prefill_forward  # noqa: E402

DATA = ROOT / "benchmarks" / "data" / "nim_dli_itl.csv"
GPU = {"A100-SXM4-80GB": "a100-80g", "H100_80GB_HBM3": "h100-sxm"}
MODEL = {"meta-llama3-8b-instruct": "llama-3-8b", "meta-llama3-70b-instruct": "llama-3-70b"}
PROMPT = 200


def rows() -> dict[tuple, float]:
    """(model, gpu, tp, dtype, output tokens, concurrency) -> mean ITL (ms)."""
    runs: dict[tuple, list[float]] = defaultdict(list)
    with DATA.open() as f:
        for r in csv.DictReader(line for line in f if not line.startswith("#")):
            key = (
                MODEL[r["model"]],
                GPU[r["gpu"]],
                int(r["tp"]),
                r["precision"],
                int(r["output_tokens"]),
                int(r["concurrency"]),
            )
            runs[key].append(float(r["itl_ms"]))
    return {k: statistics.fmean(v) for k, v in runs.items()}


def simulated_ms(model: str, gpu: str, tp: int, dtype: str, output: int, c: int) -> float:
    s = _load(
        f"model.preset={model}",
        f"model.weight_dtype={dtype}",
        f"prefill.tp={tp}",
        f"decode.tp={tp}",
        f"prefill.gpu={gpu}",
        f"decode.gpu={gpu}",
        'decode.engine="trtllm"',
        "decode.gpu_memory_gib=80",
        f"decode.max_running_requests={c}",
    )
    step = decode_step(s, c, c * (PROMPT + output / 2)).total_s
    joins = prefill_forward(s, PROMPT).total_s * c / output
    return (step + joins) * 1e3


def main() -> None:
    measured = rows()
    by_c: dict[int, list[float]] = defaultdict(list)
    sims: dict[tuple, float] = {}
    print(f"{'model':12} {'gpu':9} {'TP':>3} {'dtype':5} {'out':>5} {'c':>4}"
          f" {'published':>10} {'kvstage':>8} {'sim/pub':>8}")  # fmt: skip
    for key in sorted(measured):
        sim = simulated_ms(*key)
        sims[key] = sim
        pub = measured[key]
        by_c[key[-1]].append(sim / pub)
        m, g, tp, dt, out, c = key
        print(f"{m:12} {g:9} {tp:>3} {dt:5} {out:>5} {c:>4} {pub:>8.2f}ms {sim:>6.2f}ms"
              f" {sim / pub:>8.2f}")  # fmt: skip
    print("\nmedian kvstage / published ITL by concurrency (all rows):")
    for c in sorted(by_c):
        print(f"  c={c:>3}: {statistics.median(by_c[c]):.2f} (n={len(by_c[c])})")
    print("\nwhat each extra request in flight adds, concurrency 1 -> 250, 1,000 output tokens:")
    configs = sorted({k[:4] for k in measured})
    for cfg in configs:
        lo, hi = (*cfg, 1000, 1), (*cfg, 1000, 250)
        if lo not in measured or hi not in measured:
            continue
        pub = (measured[hi] - measured[lo]) / 249 * 1e3
        sim = (sims[hi] - sims[lo]) / 249 * 1e3
        m, g, tp, dt = cfg
        print(f"  {m:12} {g:9} TP{tp} {dt:5}: published {pub:5.1f} us, kvstage {sim:5.1f} us,"
              f" unpriced {pub - sim:5.1f} us a request a step")  # fmt: skip


if __name__ == "__main__":
    main()
