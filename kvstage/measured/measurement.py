"""What a measured file holds, whatever tool wrote it, and the one error a reader raises.

A reader turns its file into a `Measurement`: requests as the client saw them (arrival,
first and last token, the times of the tokens between when the file has them, tokens
in and out, an error), or only the distributions the tool reported, plus the server's
own points (decode steps, prefill batches) where the file is a server log. All times
are seconds; arrivals count from the run's first request (0 where the file has no
arrival times: the latencies, which are relative, stay exact).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "DecodeStep",
    "MeasuredError",
    "MeasuredRequest",
    "Measurement",
    "PrefillBatch",
    "dist_from_quantiles",
]


class MeasuredError(ValueError):
    """A file that is not what its format promises: one line naming the file, the line
    (or record) and the field."""

    def __init__(self, path: Path | str, where: str, field_name: str, what: str) -> None:
        self.path, self.where, self.field, self.what = Path(path), where, field_name, what
        loc = f"{path}:{where}" if where else str(path)
        super().__init__(f"{loc}: field {field_name!r}: {what}")


@dataclass
class MeasuredRequest:
    """One request as the client measured it (seconds)."""

    arrival_s: float
    ttft_s: float | None = None  # None: failed, or the tool did not stream
    e2e_s: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    itls_s: list[float] | None = None  # every gap after the first token, when the file has them
    error: str = ""


@dataclass(frozen=True)
class DecodeStep:
    """A server's decode log point: `running` requests in the batch, `gen_tokens_per_s`
    over the log interval, `tokens` of KV in use, `queue` waiting; `time_s` from the log."""

    time_s: float
    running: int
    gen_tokens_per_s: float
    tokens: int = 0
    queue: int = 0


@dataclass(frozen=True)
class PrefillBatch:
    """A server's prefill log point: `new_tokens` computed (`cached_tokens` reused),
    `input_tokens_per_s` since the previous prefill line, `queue` waiting after it."""

    time_s: float
    new_tokens: int
    cached_tokens: int
    input_tokens_per_s: float
    queue: int = 0
    running: int = 0


@dataclass
class Measurement:
    """A measured file, read. `reported`: the tool's own aggregate figures, under
    kvstage's names (`ttft_s`, `tpot_s`, `itl_s`, `e2e_s`: {p50, p90, p99, mean, ...};
    `duration_s`, `requests_per_s`, `output_tokens_per_s`, ...)."""

    path: Path
    format: str
    tool: str  # e.g. "sglang.bench_serving @ 0033168f"
    requests: list[MeasuredRequest] = field(default_factory=list)
    reported: dict[str, Any] = field(default_factory=dict)
    decode_steps: list[DecodeStep] = field(default_factory=list)
    prefill_batches: list[PrefillBatch] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def dist_from_quantiles(values: dict[str, float | None], scale: float) -> dict[str, float]:
    """A distribution in summary.json's shape from a tool's named figures (already keyed
    p50/p90/p99/mean/max/count), times `scale` (ms -> s: 1e-3); absent figures absent."""
    out: dict[str, float] = {}
    for key, value in values.items():
        if value is None or (isinstance(value, float) and math.isnan(value)):
            continue
        out[key] = float(value) if key == "count" else float(value) * scale
    return out


_STAT = {"mean": "mean", "median": "p50", "std": "std", "max": "max"}


def ms_figures(record: dict[str, Any], names: dict[str, str]) -> dict[str, dict[str, float]]:
    """The `<stat>_<metric>_ms` figures of sglang.bench_serving and vllm bench serve
    (`mean_ttft_ms`, `median_itl_ms`, `p99_e2el_ms`, ...) as distributions in seconds,
    keyed by kvstage's names (`names`: the tool's metric -> `ttft_s`, ...)."""
    out: dict[str, dict[str, float]] = {}
    for key, value in record.items():
        if not key.endswith("_ms") or not isinstance(value, int | float):
            continue
        stat, _, metric = key[: -len("_ms")].partition("_")
        if metric not in names:
            continue
        if stat in _STAT:
            stat = _STAT[stat]
        elif not (stat.startswith("p") and stat[1:].replace(".", "", 1).isdigit()):
            continue
        out.setdefault(names[metric], {})[stat] = float(value) * 1e-3
    return out
