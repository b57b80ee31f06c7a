"""What benchmarks/fidelity.py compares: one run (hardware or simulated) reduced to
per-room latencies and per-step samples, and the errors between two such runs.

Two per-room metrics (kvstage.metrics.rooms.room_latencies terms):
- "room": prefill room_open -> last decode room_done (the forward included);
- "exposed": the last chunk's forward end -> last decode room_done, the transfer
  latency a request actually waits for (summary.json's kv_transfer_latency_s).

Per step ("phase"): kvstage/metrics/steps.py's samples, keyed by what they belong to, so two
runs compare instance by instance.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from kvstage.metrics.rooms import room_latencies
from kvstage.metrics.steps import PHASES, phase_samples
from kvstage.shared.trace import TraceRecord

__all__ = ["METRICS", "METRIC_TITLES", "PHASES", "RunData", "phase_samples", "room_spans"]

METRICS: dict[str, tuple[str, str]] = {
    "room": ("transfer_start", "done"),
    "exposed": ("forward_end", "done"),
}
METRIC_TITLES = {
    "room": "room latency (prefill room_open -> decode room_done)",
    "exposed": "exposed transfer latency (last forward end -> decode room_done)",
}
Samples = dict[tuple, float]


@dataclass
class RunData:
    """One run reduced to what is compared."""

    label: str
    spans: dict[str, dict[int, float]]  # metric -> room -> seconds
    phases: dict[str, Samples]  # phase -> key -> seconds
    conditions: dict[str, Any] | None = None
    ok: bool = True
    error: str = ""
    wall_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def phase_mean(self, phase: str) -> float:
        xs = list(self.phases.get(phase, {}).values())
        return statistics.fmean(xs) if xs else math.nan


def room_spans(records: list[TraceRecord]) -> dict[str, dict[int, float]]:
    """metric -> room -> seconds, completed rooms only."""
    out: dict[str, dict[int, float]] = {m: {} for m in METRICS}
    for room, info in room_latencies(records).items():
        if info.get("failed") or "done" not in info:
            continue
        for metric, (a, b) in METRICS.items():
            if a in info:
                out[metric][room] = info[b] - info[a]
    return out


def rel_errors(ref: dict, other: dict, signed: bool = False) -> list[float]:
    """(other - ref) / ref per key both have, ref > 0; absolute unless `signed`."""
    out = []
    for k, v in ref.items():
        if k in other and v > 0:
            e = (other[k] - v) / v
            out.append(e if signed else abs(e))
    return out


def mape(ref: dict, other: dict) -> float:
    e = rel_errors(ref, other)
    return statistics.fmean(e) if e else math.nan


def pooled_mape(pairs: list[tuple[dict, dict]]) -> float:
    """MAPE over every matched key of several (ref, other) pairs (e.g. every room of
    every scenario)."""
    e = [x for ref, other in pairs for x in rel_errors(ref, other)]
    return statistics.fmean(e) if e else math.nan


def mean_error(ref: dict, other: dict) -> float:
    """|mean(other) - mean(ref)| / mean(ref) over the keys both have (for phases whose
    instances are mostly zero, such as the watermark wait)."""
    keys = [k for k in ref if k in other]
    if not keys:
        return math.nan
    a = statistics.fmean(ref[k] for k in keys)
    b = statistics.fmean(other[k] for k in keys)
    return abs(b - a) / a if a > 0 else (0.0 if b == 0 else math.inf)


def phase_error(phase: str, ref: Samples, other: Samples) -> float:
    """How far `other` is from `ref` on one step: the error of the step's mean over the
    instances both runs have. (An instance MAPE is dominated by the many sub-millisecond
    control delays, and undefined for the watermark wait, zero for most rooms.)"""
    return mean_error(ref, other)


def ratio(x: float, floor: float) -> float:
    if x != x or floor != floor:
        return math.nan
    return x / floor if floor > 0 else math.inf
