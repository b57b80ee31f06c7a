"""`python -m sglang.bench_serving --output-file F.jsonl [--output-details]`.

Field names from SGLang `python/sglang/bench_serving.py` at commit 0033168f (read
2026-12-03): `benchmark` appends one JSON line per run to the output file: the run's
`duration`, `completed`, `total_input_tokens`, `total_output_tokens`,
`request_throughput`, `output_throughput` and `{mean,median,std,p99}_ttft_ms`,
`..._tpot_ms`, `{mean,median,std,p95,p99}_itl_ms`, `{mean,median,std,p99}_e2e_latency_ms`;
with `--output-details` also per request (in send order) `input_lens`, `output_lens`,
`ttfts` (s), `itls` (a list of gaps in s per request), `generated_texts`, `errors`
(empty for a success). The file has no send times: arrivals are 0 here (the latencies
are relative), and a request's last token is its TTFT plus its gaps (the tool's own
`latency` runs to the stream's end, a chunk later, and is not written).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvstage.measured.fields import json_lines, listed_request, number, per_request_lists
from kvstage.measured.measurement import MeasuredError, MeasuredRequest, Measurement, ms_figures

FORMAT = "sglang-bench"
TOOL = "sglang.bench_serving @ 0033168f"
NAMES = {"ttft": "ttft_s", "tpot": "tpot_s", "itl": "itl_s", "e2e_latency": "e2e_s"}
DETAILS = ("input_lens", "output_lens", "ttfts", "itls", "errors")


def looks_like(record: Any) -> bool:
    keys = ("mean_e2e_latency_ms", "median_e2e_latency_ms")  # vllm's are `..._e2el_ms`
    return isinstance(record, dict) and any(k in record for k in keys)


def _requests(path: Path, where: str, rec: dict) -> list[MeasuredRequest]:
    n = per_request_lists(path, where, rec, DETAILS)
    return [listed_request(path, where, rec, i, arrival_s=0.0, e2e_s=None) for i in range(n)]


def read(path: Path) -> Measurement:
    lines = json_lines(path)
    n, rec = lines[-1]
    where = str(n)
    if not looks_like(rec):
        raise MeasuredError(
            path, where, "median_e2e_latency_ms", "missing: not bench_serving output"
        )
    completed = number(path, where, rec, "completed", kind=int)
    reported = {
        **ms_figures(rec, NAMES),
        "duration_s": number(path, where, rec, "duration"),
        "requests_done": completed,
        "requests": completed,
        "requests_per_s": number(path, where, rec, "request_throughput"),
        "output_tokens_per_s": number(path, where, rec, "output_throughput"),
    }
    m = Measurement(Path(path), FORMAT, TOOL, reported=reported)
    if any(k in rec for k in DETAILS):
        m.requests = _requests(path, where, rec)
        reported["requests"] = len(m.requests)
    else:
        m.notes.append("no per-request figures (run bench_serving with --output-details)")
    if len(lines) > 1:
        m.notes.append(f"{len(lines)} runs in the file: line {n}, the last, read")
    return m
