"""AIPerf's exports: `profile_export.jsonl` (one record a request) and
`profile_export_aiperf.json` (the run's statistics).

Field names from ai-dynamo/aiperf at commit db4f6397 (read 2026-12-03; the record
export exists since 5e0b1e17, 2025-10-09, with these metadata fields):
`aiperf/common/models/record_models.py` `MetricRecordInfo`: a record line is
`{"metadata": {"request_start_ns", "request_end_ns", "benchmark_phase" ("warmup" |
"profiling"), "session_num", "x_request_id", ...}, "metrics": {tag: {"value", "unit"}},
"error": null | {...}}`, values in display units (`MetricValue`);
`aiperf/metrics/types/`: `time_to_first_token` (first response - request start),
`request_latency` (last response - request start), `inter_chunk_latency` (a list: the
gaps between responses), `inter_token_latency` ((request latency - TTFT) /
(output sequence length - 1): TPOT), `output_sequence_length`,
`input_sequence_length`. `aiperf/common/models/export_models.py` `JsonExportData`: the
summary has one object per tag, `{"unit", "avg", "p50", "p90", "p99", "min", "max",
"std", ...}`, among them `request_throughput`, `output_token_throughput`,
`request_count`, `benchmark_duration`, `goodput`. Warmup records are skipped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvstage.measured.fields import json_file, json_lines, number
from kvstage.measured.measurement import MeasuredError, MeasuredRequest, Measurement

RECORDS, SUMMARY = "aiperf-records", "aiperf-summary"
TOOL = "aiperf @ db4f6397"
TIME_UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "sec": 1.0}
FIGURES = {
    "time_to_first_token": "ttft_s",
    "inter_token_latency": "tpot_s",
    "inter_chunk_latency": "itl_s",
    "request_latency": "e2e_s",
}


def looks_like_record(obj: Any) -> bool:
    return isinstance(obj, dict) and "metadata" in obj and "metrics" in obj


def looks_like_summary(obj: Any) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get("time_to_first_token"), dict)


def _seconds(path: Path, where: str, metrics: dict, tag: str) -> Any:
    entry = metrics.get(tag)
    if not isinstance(entry, dict) or "value" not in entry:
        hint = (
            " (a streamed run has it: aiperf profile --streaming)"
            if tag == "time_to_first_token"
            else ""
        )
        raise MeasuredError(path, where, f"metrics.{tag}", "missing" + hint)
    scale = TIME_UNITS.get(str(entry.get("unit")))
    if scale is None:
        raise MeasuredError(path, where, f"metrics.{tag}.unit", f"{entry.get('unit')!r}: no time")
    value = entry["value"]
    if isinstance(value, list):
        return [float(v) * scale for v in value]
    if not isinstance(value, int | float):
        raise MeasuredError(path, where, f"metrics.{tag}.value", f"not a number: {value!r}")
    return float(value) * scale


def _count(metrics: dict, tag: str) -> int:
    entry = metrics.get(tag)
    return int(entry["value"]) if isinstance(entry, dict) and "value" in entry else 0


def read_records(path: Path) -> Measurement:
    m = Measurement(Path(path), RECORDS, TOOL)
    rows = []
    for n, rec in json_lines(path):
        where = str(n)
        if not looks_like_record(rec):
            raise MeasuredError(path, where, "metadata", "missing: not an AIPerf record")
        meta, metrics = rec["metadata"], rec["metrics"]
        if meta.get("benchmark_phase") == "warmup":
            continue
        start = number(path, where, meta, "request_start_ns", kind=int)
        if rec.get("error"):
            err = rec["error"]
            text = err.get("message") or err.get("type") if isinstance(err, dict) else str(err)
            rows.append((start, MeasuredRequest(0.0, error=str(text or "error"))))
            continue
        gaps = (
            _seconds(path, where, metrics, "inter_chunk_latency")
            if "inter_chunk_latency" in metrics
            else None
        )
        req = MeasuredRequest(
            arrival_s=0.0,
            ttft_s=_seconds(path, where, metrics, "time_to_first_token"),
            e2e_s=_seconds(path, where, metrics, "request_latency"),
            output_tokens=_count(metrics, "output_sequence_length"),
            prompt_tokens=_count(metrics, "input_sequence_length"),
            itls_s=gaps,
        )
        rows.append((start, req))
    if not rows:
        raise MeasuredError(path, "", "benchmark_phase", "no profiling record in the file")
    t0 = min(s for s, _ in rows)
    for start, req in rows:
        req.arrival_s = (start - t0) * 1e-9
    m.requests = [r for _, r in rows]
    m.reported = {"requests": len(rows)}
    return m


def read_summary(path: Path) -> Measurement:
    obj = json_file(path)
    if not looks_like_summary(obj):
        raise MeasuredError(path, "", "time_to_first_token", "missing: not an AIPerf summary")
    reported: dict[str, Any] = {}
    for tag, key in FIGURES.items():
        entry = obj.get(tag)
        if not isinstance(entry, dict):
            continue
        scale = TIME_UNITS.get(str(entry.get("unit")))
        if scale is None:
            raise MeasuredError(path, "", f"{tag}.unit", f"{entry.get('unit')!r}: no time unit")
        reported[key] = {
            ("mean" if s == "avg" else s): float(v) * scale
            for s, v in entry.items()
            if isinstance(v, int | float) and (s == "avg" or s.startswith("p") or s == "max")
        }
    for tag, key in (
        ("request_throughput", "requests_per_s"),
        ("output_token_throughput", "output_tokens_per_s"),
        ("goodput", "goodput_rps"),
    ):
        if isinstance(obj.get(tag), dict) and obj[tag].get("avg") is not None:
            reported[key] = float(obj[tag]["avg"])
    if isinstance(obj.get("request_count"), dict):
        reported["requests"] = reported["requests_done"] = int(obj["request_count"].get("avg", 0))
    if isinstance(obj.get("error_request_count"), dict):
        reported["requests_failed"] = int(obj["error_request_count"].get("avg", 0))
    if isinstance(obj.get("benchmark_duration"), dict):
        entry = obj["benchmark_duration"]
        reported["duration_s"] = float(entry["avg"]) * TIME_UNITS.get(str(entry.get("unit")), 1.0)
    return Measurement(Path(path), SUMMARY, TOOL, reported=reported)
