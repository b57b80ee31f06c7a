"""Summary metrics of a run, computed from its trace records only.

Simulation and hardware runs go through the same function, so their summaries
are comparable field by field.
"""

from __future__ import annotations

import math
from bisect import bisect_right
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
      instance's continuous batch (when the decode side's generation is modeled):
      it joined (its first token went to the client) and its last token;
    - `first_token` / `last_token`: when the client received its first and last
      token (docs/metrics.md): `generate_start` / `generate_end` when generation is
      modeled, else `done` (the decode streams the prefill's token once the KV is in);
      with decode.first_token = "prefill", the first is `prefill_first`, the prefill's
      `first_token` row at its last forward's end (DistServe streams it from there);
    - `itls`: (a list) its inter-token gaps, the `decode_step` rows of its instance
      between its first and last token (simulated generation), or the gaps between
      its `token` rows (a measured run);
    - a measured run's client rows (kvstage/measured/rundir.py): `arrival`,
      `client_first` / `client_last` (its first and last token), `output_tokens` and
      `prompt_tokens`;
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
    steps: dict[int, list[tuple[float, float]]] = {}  # decode rank -> its instance's steps
    gen_rank: dict[int, int] = {}  # room -> the first decode rank with its generate row
    tokens: dict[int, list[float]] = {}  # room -> a measured client's token times
    for r in records:
        if r.room < 0:
            if r.phase == "decode_step":
                steps.setdefault(r.rank, []).append((r.end, r.end - r.start))
            continue
        if r.role == "client":
            _client_row(rooms.setdefault(r.room, {}), tokens, r)
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
            gen_rank[r.room] = min(gen_rank.get(r.room, r.rank), r.rank)
        elif r.phase == "first_token":  # the prefill streamed it (decode.first_token)
            info["prefill_first"] = r.start
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
    _client_times(rooms, steps, gen_rank)
    for room, times in tokens.items():
        info = rooms[room]
        if "client_first" in info:
            times.sort()
            marks = [info["client_first"], *times]
            info["itls"] = [b - a for a, b in zip(marks, marks[1:], strict=False)]  # type: ignore[assignment]
    return rooms


def _client_row(info: dict[str, float], tokens: dict[int, list[float]], r: TraceRecord) -> None:
    """One row of a measured client (kvstage/measured/rundir.py) into its room's info."""
    if r.phase == "request":
        info["arrival"] = r.start
        info["client_last"] = r.end
        info["output_tokens"] = r.requests
        info["prompt_tokens"] = r.bytes
    elif r.phase == "first_token":
        info["client_first"] = r.start
    elif r.phase == "token":
        tokens.setdefault(r.room, []).append(r.start)
    elif r.phase == "room_failed":
        info["failed"] = 1.0


def _client_times(
    rooms: dict[int, dict[str, float]],
    steps: dict[int, list[tuple[float, float]]],
    gen_rank: dict[int, int],
) -> None:
    """Each finished room's `first_token`, `last_token` and `itls` (see `room_latencies`)."""
    for series in steps.values():
        series.sort()
    ends = {rank: [e for e, _ in series] for rank, series in steps.items()}
    for room, info in rooms.items():
        if ("done" not in info and "client_first" not in info) or info.get("failed"):
            continue
        info["first_token"], info["last_token"] = client_tokens(info)
        series = steps.get(gen_rank.get(room, -1))
        if series is None:
            continue
        # the decode's tokens: the steps that end after the room joined its batch
        lo = bisect_right(ends[gen_rank[room]], info.get("generate_start", info["first_token"]))
        hi = bisect_right(ends[gen_rank[room]], info["last_token"])
        itls = [gap for _, gap in series[lo:hi]]
        if itls and "prefill_first" in info:  # the prefill's token, then the transfer and the
            itls[0] += info["generate_start"] - info["prefill_first"]  # wait for a slot
        info["itls"] = itls  # type: ignore[assignment]


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


# summary.json's per-request breakdown of TTFT: key -> (from, to) in `room_latencies` terms.
# transfer_latency_s (prefill room_open -> decode ready) contains the prefill forward;
# kv_transfer_latency_s is the part of it the request waits for after the forward;
# decode_slot_wait_s the wait of a ready request for a slot in the decode's batch.
BREAKDOWN: dict[str, tuple[str, str]] = {
    "queueing_s": ("arrival", "forward_start"),
    "prefill_compute_s": ("forward_start", "forward_end"),
    "kv_transfer_latency_s": ("forward_end", "done"),
    "decode_slot_wait_s": ("done", "generate_start"),
}
# the client's figures (docs/metrics.md), as sglang.bench_serving, vllm bench serve and
# AIPerf define them
CLIENT_FIGURES = ("ttft_s", "tpot_s", "itl_s", "e2e_s")


def request_breakdown(rooms: dict[int, dict[str, float]]) -> dict[str, list[float]]:
    """Per finished request: the client's figures (`request_figures`; `itl_s` pools
    every inter-token gap of every request, as the clients do), transfer_latency_s, the
    BREAKDOWN spans of TTFT and staging_wait_s; each a list over the requests that have
    the figure."""
    out: dict[str, list[float]] = {
        k: [] for k in ("transfer_latency_s", "ttft_s", *BREAKDOWN, "staging_wait_s")
    }
    spans = {"transfer_latency_s": ("transfer_start", "done"), **BREAKDOWN}
    for info in rooms.values():
        figures = request_figures(info)
        if figures is None:
            continue
        for key, value in figures.items():
            out.setdefault(key, []).append(value)
        out.setdefault("itl_s", []).extend(info.get("itls", ()))  # type: ignore[arg-type]
        if "client_first" in info:
            continue  # a measured client: no transfer-path spans
        for key, (a, b) in spans.items():
            if a in info and b in info:
                out[key].append(info[b] - info[a])
        out["staging_wait_s"].append(info.get("staging_wait", 0.0))
        if "admitted" in info and "arrival" in info:
            out.setdefault("decode_admission_wait_s", []).append(info["admitted"] - info["arrival"])
    if not any(out.get("decode_admission_wait_s", ())):
        out.pop("decode_admission_wait_s", None)  # nobody waited: not a figure of this run
    for key in ("decode_slot_wait_s", "itl_s"):
        if not out.get(key):
            out.pop(key, None)  # generation not modeled
    return out


def client_tokens(info: dict[str, float]) -> tuple[float, float]:
    """A finished room's first and last token at the client (see `room_latencies`)."""
    if "client_first" in info:  # measured by the client itself
        return info["client_first"], info["client_last"]
    if "generate_end" in info:
        return info.get("prefill_first", info["generate_start"]), info["generate_end"]
    return info["done"], info["done"]


def request_figures(info: dict[str, float]) -> dict[str, float] | None:
    """A finished request's client figures (docs/metrics.md); None when it failed or did
    not finish. `ttft_s`: arrival to the first token at the client; with generation
    modeled also `e2e_s` (arrival to its last token) and, for N > 1 output tokens,
    `tpot_s` = (E2E - TTFT) / (N - 1)."""
    if info.get("failed") or "arrival" not in info:
        return None
    if "done" not in info and "client_first" not in info:
        return None
    first, last = client_tokens(info)
    out = {"ttft_s": first - info["arrival"]}
    generated = "generate_end" in info or "client_first" in info
    if generated and info.get("output_tokens", 0) > 0:
        out["e2e_s"] = last - info["arrival"]
        n = info["output_tokens"]
        if n > 1:
            out["tpot_s"] = (out["e2e_s"] - out["ttft_s"]) / (n - 1)
    return out


def meets(figures: dict[str, float] | None, targets: dict[str, float]) -> bool:
    """A request is good when it finished and every target holds for it, as `vllm bench
    serve --goodput` counts: a request of one token has TPOT 0 there; a figure the run
    does not have (no TPOT without modeled generation) misses."""
    if figures is None:
        return False
    if "e2e_s" in figures and "tpot_s" not in figures:
        figures = {**figures, "tpot_s": 0.0}
    return all(k in figures and figures[k] <= v for k, v in targets.items())


def serving_span(rooms: dict[int, dict[str, float]]) -> float:
    """First arrival to the last finished request's end (its last token when generation
    is modeled, else decode ready): the time the run served its requests."""
    starts = [i["arrival"] for i in rooms.values() if "arrival" in i]
    ends = [client_tokens(i)[1] for i in rooms.values() if request_figures(i) is not None]
    return max(ends) - min(starts) if starts and ends else 0.0


def served_rates(rooms: dict[int, dict[str, float]]) -> dict[str, float]:
    """`requests_per_s` and `output_tokens_per_s`: finished requests and their output
    tokens over the serving span, as the clients divide completed work by the run's
    duration."""
    span = serving_span(rooms)
    done = [i for i in rooms.values() if request_figures(i) is not None]
    tokens = sum(i.get("output_tokens", 0) for i in done)
    return {
        "requests_per_s": len(done) / span if span > 0 else 0.0,
        "output_tokens_per_s": tokens / span if span > 0 else 0.0,
    }


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
    met = sum(1 for f in figures if meets(f, targets))
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
    done = sum(
        1 for i in rooms.values() if ("done" in i or "client_first" in i) and not i.get("failed")
    )
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
        **{
            key: percentiles(values)
            for key, values in per_request.items()
            if values or mode != "measured"  # a measured run has no transfer-path spans
        },
        **served_rates(rooms),
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
