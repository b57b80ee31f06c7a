"""Summary metrics of a run, computed from its trace records only.

Simulation and hardware runs go through the same function, so their summaries
are comparable field by field.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from kvstage.shared.trace import TraceRecord


def percentiles(values: Sequence[float]) -> dict[str, float]:
    """p50/p90/p99/mean/max by linear interpolation (numpy's default method)."""
    if not values:
        return {"p50": math.nan, "p90": math.nan, "p99": math.nan, "mean": math.nan, "max": math.nan, "count": 0}
    xs = sorted(values)

    def q(p: float) -> float:
        pos = (len(xs) - 1) * p
        lo = math.floor(pos)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    return {
        "p50": q(0.50),
        "p90": q(0.90),
        "p99": q(0.99),
        "mean": sum(xs) / len(xs),
        "max": xs[-1],
        "count": len(xs),
    }


def room_latencies(records: Iterable[TraceRecord]) -> dict[int, dict[str, float]]:
    """Per room: arrival, transfer start, done time (all decode ranks), failed flag."""
    rooms: dict[int, dict[str, float]] = {}
    decode_ranks: set[int] = set()
    done_count: dict[int, int] = {}
    for r in records:
        if r.room < 0:
            continue
        if r.role == "decode":
            decode_ranks.add(r.rank)
        info = rooms.setdefault(r.room, {})
        if r.phase == "room_open":
            key = "arrival" if r.role == "decode" else "transfer_start"
            info[key] = min(info.get(key, math.inf), r.start)
        elif r.phase == "room_done" and r.role == "decode":
            info["done"] = max(info.get("done", -math.inf), r.end)
            done_count[r.room] = done_count.get(r.room, 0) + 1
        elif r.phase == "room_failed":
            info["failed"] = 1.0
    for room, info in rooms.items():
        if done_count.get(room, 0) < len(decode_ranks):
            info.pop("done", None)
    return rooms


def summarize(records: Sequence[TraceRecord], *, mode: str, pool_bytes: int, requests: int) -> dict:
    rooms = room_latencies(records)
    transfer, ttft = [], []
    done = failed = 0
    for info in rooms.values():
        if info.get("failed"):
            failed += 1
            continue
        if "done" not in info:
            continue
        done += 1
        if "transfer_start" in info:
            transfer.append(info["done"] - info["transfer_start"])
        if "arrival" in info:
            ttft.append(info["done"] - info["arrival"])
    payload = 0
    req_total = 0
    first = math.inf
    last = -math.inf
    ring_peak = 0
    stalls: list[float] = []
    phase_time: dict[str, float] = {}
    for r in records:
        if r.phase in ("write", "slice_write"):
            payload += r.bytes
            req_total += r.requests
            first = min(first, r.start)
            last = max(last, r.end)
        elif r.phase == "wm_wait":
            stalls.append(r.end - r.start)
        if r.ring_used > ring_peak:
            ring_peak = r.ring_used
        if r.end > r.start:
            phase_time[r.phase] = phase_time.get(r.phase, 0.0) + (r.end - r.start)
    busy = last - first if last > first else 0.0
    return {
        "mode": mode,
        "requests": requests,
        "requests_done": done,
        "requests_failed": failed,
        "transfer_latency_s": percentiles(transfer),
        "ttft_s": percentiles(ttft),
        "payload_bytes": payload,
        "throughput_gbps": (payload * 8 / 1e9 / busy) if busy else 0.0,
        "ring_peak_bytes": ring_peak,
        "ring_peak_fraction": (ring_peak / pool_bytes) if pool_bytes else 0.0,
        "watermark_stall_s": {"total": float(sum(stalls)), "p99": percentiles(stalls)["p99"] if stalls else 0.0, "chunks": len(stalls)},
        "transfer_requests": {"total": req_total, "per_request": (req_total / done) if done else 0.0},
        "phase_busy_s": dict(sorted(phase_time.items())),
    }
