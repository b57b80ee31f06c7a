"""genai-bench's per-run metrics JSON (`AggregatedMetricsCollector.save`).

Field names from sgl-project/genai-bench at commit 7fd04d8 (read 2026-12-03):
`genai_bench/metrics/aggregated_metrics_collector.py` `save` writes
`{"aggregated_metrics": ..., "individual_request_metrics": [...], "_time_unit": "s"|"ms"}`;
`genai_bench/metrics/metrics.py`: a request's `ttft`, `tpot` ((e2e - ttft) /
(output tokens - 1)), `e2e_latency`, `output_latency`, `num_input_tokens`,
`num_output_tokens`, `error_code`, `error_message`; the aggregate's `run_duration`,
`num_requests`, `num_completed_requests`, `num_error_requests`, `requests_per_second`,
`mean_output_throughput_tokens_per_s` and `stats.<field>.{min,max,mean,p50,p90,p99,...}`.
`genai_bench/time_units.py`: `ttft`, `tpot`, `e2e_latency`, `output_latency` are in
`_time_unit`. It keeps no send times and no per-token gaps: arrivals are 0, no ITL.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvstage.measured.fields import json_file, number
from kvstage.measured.measurement import MeasuredError, MeasuredRequest, Measurement

FORMAT = "genai-bench"
TOOL = "genai-bench @ 7fd04d8"
UNITS = {"s": 1.0, "ms": 1e-3}
STATS = {"ttft": "ttft_s", "tpot": "tpot_s", "e2e_latency": "e2e_s"}


def looks_like(obj: Any) -> bool:
    return isinstance(obj, dict) and "aggregated_metrics" in obj


def _request(path: Path, i: int, r: Any, scale: float) -> MeasuredRequest:
    where = f"individual_request_metrics[{i}]"
    if not isinstance(r, dict):
        raise MeasuredError(path, where, "(record)", "not an object")
    if r.get("error_code") is not None:
        return MeasuredRequest(0.0, error=f"{r['error_code']}: {r.get('error_message') or ''}")
    return MeasuredRequest(
        arrival_s=0.0,
        ttft_s=number(path, where, r, "ttft") * scale,
        e2e_s=number(path, where, r, "e2e_latency") * scale,
        output_tokens=number(path, where, r, "num_output_tokens", kind=int),
        prompt_tokens=number(path, where, r, "num_input_tokens", kind=int),
    )


def read(path: Path) -> Measurement:
    obj = json_file(path)
    if not looks_like(obj):
        raise MeasuredError(path, "", "aggregated_metrics", "missing: not genai-bench output")
    unit = obj.get("_time_unit", "s")
    if unit not in UNITS:
        raise MeasuredError(path, "", "_time_unit", f"{unit!r}, not one of s, ms")
    scale = UNITS[unit]
    agg = obj["aggregated_metrics"]
    if not isinstance(agg, dict):
        raise MeasuredError(path, "", "aggregated_metrics", "not an object")
    stats = agg.get("stats") or {}
    reported: dict[str, Any] = {
        key: {
            ("mean" if s == "mean" else s): float(v) * scale
            for s, v in (stats.get(name) or {}).items()
            if isinstance(v, int | float) and (s == "mean" or s.startswith("p") or s == "max")
        }
        for name, key in STATS.items()
    }
    where = "aggregated_metrics"
    reported |= {
        "duration_s": number(path, where, agg, "run_duration"),
        "requests": number(path, where, agg, "num_requests", kind=int),
        "requests_done": number(path, where, agg, "num_completed_requests", kind=int),
        "requests_failed": int(agg.get("num_error_requests") or 0),
        "requests_per_s": number(path, where, agg, "requests_per_second"),
    }
    m = Measurement(Path(path), FORMAT, TOOL, reported=reported)
    records = obj.get("individual_request_metrics")
    if records is not None and not isinstance(records, list):
        raise MeasuredError(path, "", "individual_request_metrics", "not a list")
    m.requests = [_request(path, i, r, scale) for i, r in enumerate(records or [])]
    m.notes.append("genai-bench keeps no per-token gaps: no ITL")
    return m
