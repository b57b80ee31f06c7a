"""`vllm bench serve --save-result [--save-detailed]` (its result JSON).

Field names from vLLM `vllm/benchmarks/serve.py` at commit 009e6d4a (read 2026-12-03):
`benchmark` returns `duration`, `completed`, `failed`, `total_input_tokens`,
`total_output_tokens`, `request_throughput`, `request_goodput` (null without
`--goodput`), `output_throughput`, `{mean,median,std}_{ttft,tpot,itl,e2el}_ms` and
`p{P}_{metric}_ms` per `--metric-percentiles` (for the metrics `--percentile-metrics`
names: ttft, tpot, itl by default, e2el only when named), and the per-request lists `input_lens`,
`output_lens`, `ttfts`, `itls` (gaps, s), `latencies`, `start_times` (perf_counter, s),
`errors` (older `benchmarks/benchmark_serving.py` results have no `start_times` or
`latencies`: arrivals 0, the last token at TTFT plus the gaps); `main` drops `input_lens`, `output_lens`, `start_times`, `ttfts`, `itls`,
`generated_texts` and `errors` unless `--save-detailed`. A request failed when its
`errors` entry is not empty. Arrivals: `start_times` less the first.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvstage.measured.fields import json_lines, listed_request, number, per_request_lists
from kvstage.measured.measurement import MeasuredError, MeasuredRequest, Measurement, ms_figures

FORMAT = "vllm-bench"
TOOL = "vllm bench serve @ 009e6d4a"
NAMES = {"ttft": "ttft_s", "tpot": "tpot_s", "itl": "itl_s", "e2el": "e2e_s"}
DETAILS = ("input_lens", "output_lens", "ttfts", "itls", "errors")
TIMES = ("start_times", "latencies")  # older benchmark_serving.py results lack them


def looks_like(record: Any) -> bool:
    """`request_goodput` is always in the result (null without --goodput); the E2E
    figures only when --percentile-metrics names e2el (the default is ttft,tpot,itl)."""
    keys = ("request_goodput", "request_goodput:", "mean_e2el_ms", "median_e2el_ms")
    return isinstance(record, dict) and any(k in record for k in keys)


def _load(path: Path) -> tuple[str, dict]:
    text = Path(path).read_text()
    try:
        obj = json.loads(text)
    except ValueError:
        n, obj = json_lines(path)[-1]  # --append-result: one object a line
        return str(n), obj
    if not isinstance(obj, dict):
        raise MeasuredError(path, "", "(file)", "not a JSON object")
    return "", obj


def _requests(path: Path, where: str, rec: dict) -> list[MeasuredRequest]:
    times = tuple(k for k in TIMES if k in rec)
    n = per_request_lists(path, where, rec, (*DETAILS, *times))
    starts = [s for s in rec.get("start_times", ()) if isinstance(s, int | float)]
    t0 = min(starts) if starts else 0.0
    out = []
    for i in range(n):
        for key in times:
            if not isinstance(rec[key][i], int | float):
                raise MeasuredError(path, where, f"{key}[{i}]", f"not a number: {rec[key][i]!r}")
        arrival = float(rec["start_times"][i]) - t0 if "start_times" in rec else 0.0
        e2e = float(rec["latencies"][i]) if "latencies" in rec else None  # else TTFT + gaps
        out.append(listed_request(path, where, rec, i, arrival_s=arrival, e2e_s=e2e))
    return out


def read(path: Path) -> Measurement:
    where, rec = _load(path)
    if not looks_like(rec):
        raise MeasuredError(path, where, "request_goodput", "missing: not vllm bench serve output")
    completed = number(path, where, rec, "completed", kind=int)
    failed = int(rec.get("failed") or 0)
    reported = {
        **ms_figures(rec, NAMES),
        "duration_s": number(path, where, rec, "duration"),
        "requests": completed + failed,
        "requests_done": completed,
        "requests_failed": failed,
        "requests_per_s": number(path, where, rec, "request_throughput"),
        "output_tokens_per_s": number(path, where, rec, "output_throughput"),
    }
    if rec.get("request_goodput") is not None:
        reported["goodput_rps"] = number(path, where, rec, "request_goodput")
    m = Measurement(Path(path), FORMAT, TOOL, reported=reported)
    if any(k in rec for k in ("ttfts", "itls", "start_times")):
        m.requests = _requests(path, where, rec)
    else:
        m.notes.append("no per-request figures (run vllm bench serve with --save-detailed)")
    return m
