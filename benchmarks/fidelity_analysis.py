"""What benchmarks/fidelity.py compares: one run (hardware or simulated) reduced to
per-room latencies and per-step samples, and the errors between two such runs.

Two per-room metrics (kvstage.metrics.room_latencies terms):
- "room": prefill room_open -> last decode room_done (the forward included);
- "exposed": the last chunk's forward end -> last decode room_done, the transfer
  latency a request actually waits for (summary.json's kv_transfer_latency_s).

Per step ("phase"), samples keyed by what they belong to (room, chunk, ranks), so two
runs are compared instance by instance: forward (prefill compute span), control
(STAGING_REQ, STAGING_RSP and CHUNK_READY delays: message sent -> handled), gather,
write, scatter, watermark wait (per room: the union of its wm_wait spans) and the
room_done lag after the last scatter.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from kvstage.metrics import room_latencies
from kvstage.shared.trace import TraceRecord

METRICS: dict[str, tuple[str, str]] = {
    "room": ("transfer_start", "done"),
    "exposed": ("forward_end", "done"),
}
METRIC_TITLES = {
    "room": "room latency (prefill room_open -> decode room_done)",
    "exposed": "exposed transfer latency (last forward end -> decode room_done)",
}
PHASES: tuple[str, ...] = (
    "forward", "ctrl STAGING_REQ", "ctrl STAGING_RSP", "ctrl CHUNK_READY", "gather", "write",
    "scatter", "watermark wait", "room_done lag",
)

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


def _spans(records: list[TraceRecord], phase: str, role: str) -> Samples:
    return {(r.rank, r.room, r.chunk, r.peer): r.end - r.start
            for r in records if r.phase == phase and r.role == role}


def _last_end(records: list[TraceRecord], role: str, phase: str, key) -> dict[tuple, float]:
    out: dict[tuple, float] = {}
    for r in records:
        if r.role == role and r.phase == phase:
            k = key(r)
            out[k] = max(out.get(k, -math.inf), r.end)
    return out


def phase_samples(records: list[TraceRecord]) -> dict[str, Samples]:
    """phase -> (its instance key) -> seconds (see the module docstring)."""
    req_p = {(r.room, r.chunk, r.rank, r.peer): r.start for r in records if r.role == "prefill" and r.phase == "req"}
    req_d = {(r.room, r.chunk, r.peer, r.rank): r.start for r in records if r.role == "decode" and r.phase == "req"}
    rsp_p = {(r.room, r.chunk, r.rank, r.peer): r.start for r in records if r.role == "prefill" and r.phase == "rsp"}
    # CHUNK_READY: the last writer's write end -> the decode seeing all writers
    last_write = _last_end(records, "prefill", "write", lambda r: (r.room, r.chunk, r.peer))
    last_scatter = _last_end(records, "decode", "scatter", lambda r: (r.room, r.rank))
    waits: dict[int, list[tuple[float, float]]] = {}
    for r in records:
        if r.phase == "wm_wait":
            waits.setdefault(r.room, []).append((r.start, r.end))
    rooms = room_latencies(records)
    return {
        "forward": _spans(records, "compute", "prefill"),
        "ctrl STAGING_REQ": {k: req_d[k] - t for k, t in req_p.items() if k in req_d},
        "ctrl STAGING_RSP": {k: t - req_d[k] for k, t in rsp_p.items() if k in req_d},
        "ctrl CHUNK_READY": {(r.room, r.chunk, r.rank): r.end - last_write[(r.room, r.chunk, r.rank)]
                             for r in records if r.role == "decode" and r.phase == "chunk_ready"
                             and (r.room, r.chunk, r.rank) in last_write},
        "gather": _spans(records, "gather", "prefill"),
        "write": _spans(records, "write", "prefill"),
        "scatter": _spans(records, "scatter", "decode"),
        "watermark wait": {(room,): info.get("staging_wait", 0.0) for room, info in rooms.items()
                           if "done" in info and not info.get("failed")},
        "room_done lag": {(r.room, r.rank): r.end - last_scatter[(r.room, r.rank)] for r in records
                          if r.role == "decode" and r.phase == "room_done" and (r.room, r.rank) in last_scatter},
    }


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
