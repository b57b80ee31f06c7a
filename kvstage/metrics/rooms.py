"""Summary metrics of a run, computed from its trace records only.

Simulation and hardware runs go through the same function, so their summaries
are comparable field by field.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvstage.fmt import quantile
from kvstage.shared.trace import TraceRecord


def percentiles(values: Sequence[float]) -> dict[str, float]:
    """p50/p90/p99/mean/max by linear interpolation (numpy's default method)."""
    if not values:
        return {
            "p50": math.nan,
            "p90": math.nan,
            "p99": math.nan,
            "mean": math.nan,
            "max": math.nan,
            "count": 0,
        }
    xs = sorted(values)
    return {
        "p50": quantile(xs, 0.50),
        "p90": quantile(xs, 0.90),
        "p99": quantile(xs, 0.99),
        "mean": sum(xs) / len(xs),
        "max": xs[-1],
        "count": len(xs),
    }


def _union_length(spans: list[tuple[float, float]]) -> float:
    """Total length covered by the spans (overlaps counted once)."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def room_latencies(records: Iterable[TraceRecord]) -> dict[int, dict[str, float]]:
    """Per room, from its trace rows alone:

    - `arrival`: the decode's first `room_open` (the request arrived);
    - `transfer_start`: the prefill's first `room_open` (its first forward began);
    - `forward_start` / `forward_end`: the earliest start and the latest end of the
      room's prefill `compute` rows (first chunk's forward start, last chunk's end);
    - `staging_wait`: the time at least one of its chunks waited for the watermark
      (the union of its `wm_wait` spans over every prefill rank and target);
    - `admitted`: the decode's first `room_open` (its KV pages were granted; later
      than `arrival`, the decode's `arrive` row, when admission waited);
    - `generate_start` / `generate_end` / `output_tokens`: the room in its decode
      instance's continuous batch (when the decode side's generation is modeled);
    - `done`: the last decode rank's `room_done` (only when every decode rank that
      has a row of the room finished it: in a cluster, the ranks of the decode
      instance the room was routed to); `failed`: 1.0 when a rank failed it;
    - `ring_byte_s` / `ring_bytes` / `ring_region_bytes` (staging path): what the room
      took of one decode rank's staging ring: per chunk, its region's bytes (the
      decode's `free` row) times the time they held data, from the first write into
      the region (the prefill's `write` row naming the rank as `peer`) to its free
      after the scatter, summed over the chunks (byte-seconds), and the bytes alone,
      each averaged over the decode ranks that freed its regions (they are alike);
      and its largest region's bytes.
    """
    rooms: dict[int, dict[str, float]] = {}
    decode_ranks: dict[int, set[int]] = {}  # room -> decode ranks with a row of it
    done_count: dict[int, int] = {}
    waits: dict[int, list[tuple[float, float]]] = {}
    written: dict[
        tuple[int, int, int], float
    ] = {}  # (decode rank, room, chunk) -> first write start
    freed: list[
        tuple[int, int, int, float, int]
    ] = []  # (decode rank, room, chunk, free time, region bytes)
    for r in records:
        if r.room < 0:
            continue
        if r.role == "decode":
            decode_ranks.setdefault(r.room, set()).add(r.rank)
        info = rooms.setdefault(r.room, {})
        if r.phase == "room_open":
            key = "arrival" if r.role == "decode" else "transfer_start"
            info[key] = min(info.get(key, math.inf), r.start)
            if r.role == "decode":
                info["admitted"] = min(info.get("admitted", math.inf), r.start)
        elif r.phase == "arrive":  # the decode's admission waited for KV pages
            info["arrival"] = min(info.get("arrival", math.inf), r.start)
        elif r.phase == "generate":
            info["generate_start"] = max(info.get("generate_start", -math.inf), r.start)
            info["generate_end"] = max(info.get("generate_end", -math.inf), r.end)
            info["output_tokens"] = r.requests
        elif r.phase == "compute" and r.role == "prefill":
            info["forward_start"] = min(info.get("forward_start", math.inf), r.start)
            info["forward_end"] = max(info.get("forward_end", -math.inf), r.end)
        elif r.phase == "wm_wait":
            waits.setdefault(r.room, []).append((r.start, r.end))
        elif r.phase == "room_done" and r.role == "decode":
            info["done"] = max(info.get("done", -math.inf), r.end)
            done_count[r.room] = done_count.get(r.room, 0) + 1
        elif r.phase == "room_failed":
            info["failed"] = 1.0
        elif r.phase == "write" and r.peer >= 0:  # a prefill's write into decode rank `peer`
            key = (r.peer, r.room, r.chunk)
            written[key] = min(written.get(key, math.inf), r.start)
        elif r.phase == "free" and r.role == "decode" and r.bytes > 0:
            freed.append((r.rank, r.room, r.chunk, r.end, r.bytes))
    for room, info in rooms.items():
        info["staging_wait"] = _union_length(waits.get(room, []))
        if done_count.get(room, 0) < len(decode_ranks.get(room, ())):
            info.pop("done", None)
    _ring_holds(rooms, written, freed)
    return rooms


def _ring_holds(
    rooms: dict[int, dict[str, float]],
    written: dict[tuple[int, int, int], float],
    freed: list[tuple[int, int, int, float, int]],
) -> None:
    """Each room's `ring_byte_s` and `ring_region_bytes` (see `room_latencies`)."""
    held: dict[int, dict[int, list[float]]] = {}  # room -> decode rank -> [byte-seconds, bytes]
    largest: dict[int, int] = {}
    for rank, room, chunk, end, nbytes in freed:
        start = written.get((rank, room, chunk))
        if start is None:  # never written (the room failed first): it held no data
            continue
        acc = held.setdefault(room, {}).setdefault(rank, [0.0, 0.0])
        acc[0] += nbytes * max(0.0, end - start)
        acc[1] += nbytes
        largest[room] = max(largest.get(room, 0), nbytes)
    for room, per_rank in held.items():
        info = rooms[room]
        info["ring_byte_s"] = sum(a[0] for a in per_rank.values()) / len(per_rank)
        info["ring_bytes"] = sum(a[1] for a in per_rank.values()) / len(per_rank)
        info["ring_region_bytes"] = float(largest[room])


# summary.json's per-request breakdown: key -> (from, to) in `room_latencies` terms.
# transfer_latency_s (prefill room_open -> decode ready) contains the prefill forward;
# kv_transfer_latency_s is the part of it the request waits for after the forward.
BREAKDOWN: dict[str, tuple[str, str]] = {
    "queueing_s": ("arrival", "forward_start"),
    "prefill_compute_s": ("forward_start", "forward_end"),
    "kv_transfer_latency_s": ("forward_end", "done"),
}


def request_breakdown(rooms: dict[int, dict[str, float]]) -> dict[str, list[float]]:
    """Per finished request: transfer_latency_s, ttft_s, the BREAKDOWN spans and
    staging_wait_s, each a list over the requests that have both ends in the trace."""
    out: dict[str, list[float]] = {
        k: [] for k in ("transfer_latency_s", "ttft_s", *BREAKDOWN, "staging_wait_s")
    }
    spans = {
        "transfer_latency_s": ("transfer_start", "done"),
        "ttft_s": ("arrival", "done"),
        **BREAKDOWN,
    }
    for info in rooms.values():
        if info.get("failed") or "done" not in info:
            continue
        for key, (a, b) in spans.items():
            if a in info and b in info:
                out[key].append(info[b] - info[a])
        out["staging_wait_s"].append(info.get("staging_wait", 0.0))
        for key, value in _decode_side(info).items():
            out.setdefault(key, []).append(value)
    if not any(out.get("decode_admission_wait_s", ())):
        out.pop("decode_admission_wait_s", None)  # nobody waited: not a figure of this run
    return out


def _decode_side(info: dict[str, float]) -> dict[str, float]:
    """A done request's decode-side spans, where the trace has them: admission wait
    (kept only when some request waited), time per output token and end to end (when
    generation is modeled)."""
    out = {}
    if "admitted" in info and "arrival" in info:
        out["decode_admission_wait_s"] = info["admitted"] - info["arrival"]
    if "generate_end" in info and info.get("output_tokens", 0) > 0:
        out["tpot_s"] = (info["generate_end"] - info["generate_start"]) / info["output_tokens"]
        out["e2e_s"] = info["generate_end"] - info["arrival"]
    return out


def request_figures(info: dict[str, float]) -> dict[str, float] | None:
    """A finished request's SLO figures (ttft_s; tpot_s and e2e_s when its generation is
    modeled); None when it failed or did not finish."""
    if info.get("failed") or "done" not in info or "arrival" not in info:
        return None
    side = _decode_side(info)
    return {
        "ttft_s": info["done"] - info["arrival"],
        **{k: side[k] for k in ("tpot_s", "e2e_s") if k in side},
    }


def serving_span(rooms: dict[int, dict[str, float]]) -> float:
    """First arrival to the last finished request's end (its last token when generation
    is modeled, else decode ready): the time the run served its requests."""
    starts = [i["arrival"] for i in rooms.values() if "arrival" in i]
    ends = [
        i.get("generate_end", i["done"])
        for i in rooms.values()
        if "done" in i and not i.get("failed")
    ]
    return max(ends) - min(starts) if starts and ends else 0.0


def slo_figures(
    rooms: dict[int, dict[str, float]], targets: dict[str, float], *, requests: int, gpus: int
) -> dict:
    """summary.json's SLO keys for `targets` (metric -> bound in seconds; empty: none).

    A request meets the SLO when it finished and every target holds for it; a failed or
    unfinished request, or one without a figure a target names (no TPOT when generation
    is not modeled), misses. `slo_attainment` = met / `requests`; `goodput_rps` = met /
    `serving_span` (first arrival -> last finished request's end); `goodput_per_gpu_rps`
    divides it by the run's GPUs. `slo_unmeasured` names targets no request has a figure of.
    """
    if not targets:
        return {}
    figures = [f for f in map(request_figures, rooms.values()) if f is not None]
    met = sum(1 for f in figures if all(k in f and f[k] <= v for k, v in targets.items()))
    span = serving_span(rooms)
    goodput = met / span if span > 0 else 0.0
    out = {
        "slo": dict(targets),
        "slo_met": met,
        "slo_attainment": met / requests if requests else 0.0,
        "goodput_rps": goodput,
        "goodput_per_gpu_rps": goodput / gpus if gpus else 0.0,
        "serving_span_s": span,
    }
    unmeasured = [k for k in targets if not any(k in f for f in figures)]
    if unmeasured:
        out["slo_unmeasured"] = unmeasured
    return out


@dataclass
class RingSeries:
    """One decode rank's staging ring over time, from the trace.

    `live`: (time, bytes written and not yet freed). A writer block counts from the
    moment its write lands (the `write` row's end, recorded by the prefill with the
    decode rank as `peer`) until its region's `free` at the decode; a block that lands
    after its region was freed is not counted. The ring hands a region's bytes to a
    writer only after the watermark passed them, so this never exceeds the pool.
    `reserved`: (time, bytes of the regions handed out and not yet freed) -- the
    decode's `ring_used` after each of its events. A region of the next round may be
    handed out over bytes still live (overcommit), so this may exceed the pool.
    `watermark`: (time, round, tail) after each decode event that carries it.
    """

    live: list[tuple[float, int]] = field(default_factory=list)
    reserved: list[tuple[float, int]] = field(default_factory=list)
    watermark: list[tuple[float, int, int]] = field(default_factory=list)

    @property
    def live_peak(self) -> int:
        return max((v for _, v in self.live), default=0)

    @property
    def reserved_peak(self) -> int:
        return max((v for _, v in self.reserved), default=0)


def ring_series(records: Iterable[TraceRecord]) -> dict[int, RingSeries]:
    """Per decode rank that has ring rows (writes, frees, reservations, watermark):
    its live bytes, reservations and watermark over time (see `RingSeries`)."""
    out: dict[int, RingSeries] = {}
    steps: list[
        tuple[float, int, int, tuple[int, int, int], int]
    ] = []  # (t, order, decode, key, bytes)
    for r in records:
        if r.role == "prefill" and r.phase == "write" and r.peer >= 0 and r.bytes > 0:
            steps.append((r.end, 1, r.peer, (r.peer, r.room, r.chunk), r.bytes))
        elif r.role == "decode":
            if r.phase == "free":
                steps.append(
                    (r.end, 0, r.rank, (r.rank, r.room, r.chunk), 0)
                )  # a free before a write at the same time
            series = (
                out.setdefault(r.rank, RingSeries())
                if r.ring_used >= 0 or r.wm_round >= 0
                else None
            )
            if series is not None and r.ring_used >= 0:
                series.reserved.append((r.end, r.ring_used))
            if series is not None and r.wm_round >= 0 and r.wm_tail >= 0:
                series.watermark.append((r.end, r.wm_round, r.wm_tail))
    held: dict[tuple[int, int, int], int] = {}  # (decode, room, chunk) -> bytes landed, not freed
    freed: set[tuple[int, int, int]] = set()
    live: dict[int, int] = {}
    for t, _, rank, key, nbytes in sorted(steps, key=lambda s: (s[0], s[1])):
        if nbytes:  # a write landed
            if key in freed:
                continue
            held[key] = held.get(key, 0) + nbytes
            live[rank] = live.get(rank, 0) + nbytes
        else:
            freed.add(key)
            live[rank] = live.get(rank, 0) - held.pop(key, 0)
        out.setdefault(rank, RingSeries()).live.append((t, live[rank]))
    for series in out.values():
        series.reserved.sort(key=lambda p: p[0])
        series.watermark.sort(key=lambda p: p[0])
    return dict(sorted(out.items()))


def ring_figures(records: Iterable[TraceRecord], pool_bytes: int) -> dict:
    """summary.json's ring keys: the peaks over every decode rank of live bytes and of
    reservations, in bytes and as a fraction of one rank's pool (see `RingSeries`)."""
    series = ring_series(records)
    live = max((s.live_peak for s in series.values()), default=0)
    reserved = max((s.reserved_peak for s in series.values()), default=0)
    return {
        "ring_live_peak_bytes": live,
        "ring_live_peak_fraction": (live / pool_bytes) if pool_bytes else 0.0,
        "ring_reserved_peak_bytes": reserved,
        "ring_reserved_peak_fraction": (reserved / pool_bytes) if pool_bytes else 0.0,
    }


def summarize(
    records: Sequence[TraceRecord],
    *,
    mode: str,
    pool_bytes: int,
    requests: int,
    rooms: dict[int, dict[str, float]] | None = None,
) -> dict:
    """The trace metrics of summary.json; `rooms`: `room_latencies(records)` if already made."""
    rooms = room_latencies(records) if rooms is None else rooms
    done = sum(1 for i in rooms.values() if "done" in i and not i.get("failed"))
    failed = sum(1 for i in rooms.values() if i.get("failed"))
    per_request = request_breakdown(rooms)
    payload = 0
    req_total = 0
    first = math.inf
    last = -math.inf
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
        if r.end > r.start:
            phase_time[r.phase] = phase_time.get(r.phase, 0.0) + (r.end - r.start)
    busy = last - first if last > first else 0.0
    return {
        "mode": mode,
        "requests": requests,
        "requests_done": done,
        "requests_failed": failed,
        **{key: percentiles(values) for key, values in per_request.items()},
        "payload_bytes": payload,
        "throughput_gbps": (payload * 8 / 1e9 / busy) if busy else 0.0,
        **ring_figures(records, pool_bytes),
        "watermark_stall_s": {
            "total": float(sum(stalls)),
            "p99": percentiles(stalls)["p99"] if stalls else 0.0,
            "chunks": len(stalls),
        },
        "transfer_requests": {
            "total": req_total,
            "per_request": (req_total / done) if done else 0.0,
        },
        "phase_busy_s": dict(sorted(phase_time.items())),
    }
