"""A Prometheus text scrape of an SGLang server's `/metrics` (`--enable-metrics`).

Names from SGLang `python/sglang/srt/metrics/collector.py` (`TokenizerMetricsCollector`,
read 2026-12-03): histograms `sglang:time_to_first_token_seconds`,
`sglang:inter_token_latency_seconds`, `sglang:e2e_request_latency_seconds` (and
`sglang:time_per_output_token_seconds` in older releases), counters
`sglang:num_requests_total`, `sglang:prompt_tokens_total`,
`sglang:generation_tokens_total`. A histogram is `<name>_bucket{le="..."}` (cumulative),
`<name>_sum` and `<name>_count`, summed here over label sets (ranks, models).
Quantiles interpolate linearly inside the bucket that holds them, as PromQL's
`histogram_quantile` does. These are the server's own timings (from when its tokenizer
got the request), not the client's; in PD, scrape the decode server.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from kvstage.measured.measurement import MeasuredError, Measurement

FORMAT = "prometheus"
TOOL = "SGLang /metrics (metrics/collector.py)"
HISTOGRAMS = {
    "sglang:time_to_first_token_seconds": "ttft_s",
    "sglang:inter_token_latency_seconds": "itl_s",
    "sglang:time_per_output_token_seconds": "tpot_s",
    "sglang:e2e_request_latency_seconds": "e2e_s",
}
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)(\s+\S+)?$")
_LE = re.compile(r'le="([^"]+)"')


def looks_like(text: str) -> bool:
    return "sglang:" in text and ("# TYPE" in text or "_bucket{" in text)


def quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """histogram_quantile(q) of cumulative (upper bound, count) buckets."""
    total = buckets[-1][1]
    if total <= 0:
        return math.nan
    rank = q * total
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if math.isinf(upper):
                return lower
            span = count - below
            return lower + (upper - lower) * ((rank - below) / span if span else 1.0)
        lower, below = upper, count
    return lower


def _samples(path: Path) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            raise MeasuredError(path, str(n), "(sample)", "not `name{labels} value`")
        name, labels, raw = m.group(1), m.group(2) or "", m.group(3)
        try:
            value = float(raw)
        except ValueError:
            raise MeasuredError(path, str(n), name, f"value {raw!r} is not a number") from None
        if name.endswith("_bucket"):
            le = _LE.search(labels)
            if le is None:
                raise MeasuredError(path, str(n), name, "a bucket without le=")
            b = out.setdefault(name[: -len("_bucket")], {}).setdefault("buckets", {})
            bound = float(le.group(1))
            b[bound] = b.get(bound, 0.0) + value
        else:
            for suffix in ("_sum", "_count"):
                if name.endswith(suffix):
                    h = out.setdefault(name[: -len(suffix)], {})
                    h[suffix] = h.get(suffix, 0.0) + value
                    break
            else:
                out.setdefault(name, {})["value"] = out.get(name, {}).get("value", 0.0) + value
    return out


def read(path: Path) -> Measurement:
    samples = _samples(path)
    reported: dict = {}
    for name, key in HISTOGRAMS.items():
        h = samples.get(name)
        if not h or "buckets" not in h:
            continue
        buckets = sorted(h["buckets"].items())
        count = h.get("_count", buckets[-1][1])
        dist = {f"p{round(q * 100)}": quantile(buckets, q) for q in (0.5, 0.9, 0.99)}
        dist["count"] = count
        if count:
            dist["mean"] = h.get("_sum", math.nan) / count
        reported[key] = dist
    if not reported:
        raise MeasuredError(
            path, "", "sglang:time_to_first_token_seconds", "no SGLang latency histogram"
        )
    for name, key in (
        ("sglang:num_requests_total", "requests_done"),
        ("sglang:prompt_tokens_total", "prompt_tokens"),
        ("sglang:generation_tokens_total", "output_tokens"),
    ):
        if name in samples:
            reported[key] = samples[name]["value"]
    reported["requests"] = reported.get("requests_done", 0)
    return Measurement(Path(path), FORMAT, TOOL, reported=reported)
