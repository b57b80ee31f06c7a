"""Per-step samples of a run's trace: how long each step of a chunk's path took.

Samples are keyed by what they belong to (room, chunk, ranks), so two runs (hardware
and simulated, or two hardware runs) compare instance by instance. Steps (`PHASES`):
forward (prefill compute span), control (STAGING_REQ, STAGING_RSP and CHUNK_READY
delays: message sent -> handled), gather, write, scatter, watermark wait (per room:
the union of its wm_wait spans) and the room_done lag after the last scatter. Used by
benchmarks/fidelity.py and by the in-run calibration (kvstage/calibrate/inrun.py).
"""

from __future__ import annotations

import math
import statistics

from kvstage.metrics.rooms import room_latencies
from kvstage.shared.trace import TraceRecord

PHASES: tuple[str, ...] = (
    "forward",
    "ctrl STAGING_REQ",
    "ctrl STAGING_RSP",
    "ctrl CHUNK_READY",
    "gather",
    "write",
    "scatter",
    "watermark wait",
    "room_done lag",
)

Samples = dict[tuple, float]


def _spans(records: list[TraceRecord], phase: str, role: str) -> Samples:
    return {
        (r.rank, r.room, r.chunk, r.peer): r.end - r.start
        for r in records
        if r.phase == phase and r.role == role
    }


def _last_end(records: list[TraceRecord], role: str, phase: str, key) -> dict[tuple, float]:
    out: dict[tuple, float] = {}
    for r in records:
        if r.role == role and r.phase == phase:
            k = key(r)
            out[k] = max(out.get(k, -math.inf), r.end)
    return out


def phase_samples(records: list[TraceRecord]) -> dict[str, Samples]:
    """phase -> (its instance key) -> seconds (see the module docstring)."""
    req_p = {
        (r.room, r.chunk, r.rank, r.peer): r.start
        for r in records
        if r.role == "prefill" and r.phase == "req"
    }
    req_d = {
        (r.room, r.chunk, r.peer, r.rank): r.start
        for r in records
        if r.role == "decode" and r.phase == "req"
    }
    rsp_p = {
        (r.room, r.chunk, r.rank, r.peer): r.start
        for r in records
        if r.role == "prefill" and r.phase == "rsp"
    }
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
        "ctrl CHUNK_READY": {
            (r.room, r.chunk, r.rank): r.end - last_write[(r.room, r.chunk, r.rank)]
            for r in records
            if r.role == "decode"
            and r.phase == "chunk_ready"
            and (r.room, r.chunk, r.rank) in last_write
        },
        "gather": _spans(records, "gather", "prefill"),
        "write": _spans(records, "write", "prefill"),
        "scatter": _spans(records, "scatter", "decode"),
        "watermark wait": {
            (room,): info.get("staging_wait", 0.0)
            for room, info in rooms.items()
            if "done" in info and not info.get("failed")
        },
        "room_done lag": {
            (r.room, r.rank): r.end - last_scatter[(r.room, r.rank)]
            for r in records
            if r.role == "decode" and r.phase == "room_done" and (r.room, r.rank) in last_scatter
        },
    }


def step_mean(samples: dict[str, Samples], *phases: str) -> float:
    """Mean of every sample of `phases` pooled (nan when none)."""
    xs = [v for p in phases for v in samples.get(p, {}).values()]
    return statistics.fmean(xs) if xs else math.nan
