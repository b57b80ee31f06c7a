"""The measured formats kvstage reads, and which one a file is (docs/workflow.md).

| format | file | per request | what it can calibrate |
|---|---|---|---|
| `sglang-bench` | sglang.bench_serving JSONL | with `--output-details` | TTFT vs load, TPOT |
| `vllm-bench` | vllm bench serve JSON | with `--save-detailed` | TTFT vs load, TPOT |
| `genai-bench` | genai-bench run JSON | yes (no gaps) | TTFT vs load, TPOT |
| `aiperf-records` | AIPerf profile_export.jsonl | yes | TTFT vs load, TPOT |
| `aiperf-summary` | AIPerf profile_export_aiperf.json | no | compare only |
| `sglang-log` | SGLang server log | no | decode step vs batch, prefill throughput |
| `prometheus` | SGLang /metrics scrape | no | compare only |
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from kvstage.measured import aiperf, genai_bench, prometheus, sglang_bench, sglang_log, vllm_bench
from kvstage.measured.measurement import MeasuredError, Measurement

READERS: dict[str, Callable[[Path], Measurement]] = {
    sglang_bench.FORMAT: sglang_bench.read,
    vllm_bench.FORMAT: vllm_bench.read,
    genai_bench.FORMAT: genai_bench.read,
    aiperf.RECORDS: aiperf.read_records,
    aiperf.SUMMARY: aiperf.read_summary,
    sglang_log.FORMAT: sglang_log.read,
    prometheus.FORMAT: prometheus.read,
}
FORMATS = tuple(READERS)


def _first_json(path: Path, text: str) -> object:
    """The file as JSON, or its first line (JSONL); None when it is not JSON at all; one
    error naming the line when it starts as JSON and breaks (a truncated file)."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                return json.loads(line)
            except ValueError as exc:
                if line.lstrip().startswith("{"):
                    raise MeasuredError(path, str(n), "(line)", f"not JSON ({exc.msg})") from None
                return None
    return None


def detect(path: Path) -> str:
    """The format of `path`, from its content; MeasuredError when no reader claims it."""
    text = Path(path).read_text(errors="replace")
    obj = _first_json(path, text)
    if obj is not None:
        for name, test in (
            (genai_bench.FORMAT, genai_bench.looks_like),
            (aiperf.RECORDS, aiperf.looks_like_record),
            (aiperf.SUMMARY, aiperf.looks_like_summary),
            (vllm_bench.FORMAT, vllm_bench.looks_like),
            (sglang_bench.FORMAT, sglang_bench.looks_like),
        ):
            if test(obj):
                return name
    elif prometheus.looks_like(text):
        return prometheus.FORMAT
    elif sglang_log.looks_like(text):
        return sglang_log.FORMAT
    raise MeasuredError(
        path,
        "",
        "(format)",
        f"not a format kvstage reads; name one with --format: {', '.join(FORMATS)}",
    )


def read_measured(path: Path, fmt: str | None = None) -> Measurement:
    """Read `path` as `fmt` (detected when None)."""
    path = Path(path)
    if not path.is_file():
        raise MeasuredError(path, "", "(file)", "no such file")
    fmt = fmt or detect(path)
    if fmt not in READERS:
        raise MeasuredError(path, "", "--format", f"{fmt!r}: allowed {', '.join(FORMATS)}")
    return READERS[fmt](path)
