"""Steady-state figures of a run: the window, quantiles with intervals, goodput.

A run's first requests find empty queues (the warm-up) and its last ones finish after
arrivals stop, in a lighter batch (the drain); neither is the load the run stands for.
`steady_window` keeps the requests that arrived in between:

* warm-up: MSER-5 truncation (White, "An effective truncation heuristic for bias
  reduction in simulation output", Simulation 69(6), 1997; Franklin and White, WSC
  2008) on TTFT in arrival order: of the batch means of 5 requests, drop the first d
  (d at most half of them) that minimise the standard error of the mean of the rest;
  at least `MIN_WARMUP_SHARE` of the requests are dropped.
* drain: a request that arrives less than a median end to end (TTFT without
  generation) before the last arrival spends most of its life after arrivals stopped;
  those are dropped, but the window keeps at least half of what the warm-up left.

Figures over the window (`steady_figures`):

* quantiles p50 / p90 / p99 of TTFT, TPOT, ITL (every gap, pooled) and end to end, and the target quantile
  (`quantile_name`: attainment 0.99 -> p99) with a 95% interval: order statistics at
  q +- 1.96 sqrt(q (1 - q) / n_eff), where n_eff is n over the variance inflation
  that batch means (`BATCHES` consecutive batches) measure for the indicator
  "figure <= the estimated quantile" -- requests queued behind each other are not
  independent samples, and batch means is the standard correction (Law, Simulation
  Modeling and Analysis, 5th ed., section 9.5.3);
* attainment (met / requests in the window, failed ones miss) and goodput (attainment x
  the window's arrival rate: a run that drains slowly is not charged for it), each with
  a batch-means 95% interval (Student t over the batches);
* served input and output tokens per second of the window (requests that finished).

Pure functions of `kvstage.metrics.rooms.room_latencies` rooms and the requests.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstage.fmt import quantile
from kvstage.metrics.rooms import meets, request_figures

if TYPE_CHECKING:
    from kvstage.shared.workload import Request

__all__ = [
    "BATCHES",
    "MIN_WARMUP_SHARE",
    "QUANTILES",
    "Window",
    "quantile_name",
    "steady_figures",
    "steady_window",
]

MIN_WARMUP_SHARE = 0.05
MSER_BATCH = 5
BATCHES = 10
QUANTILES = (0.5, 0.9, 0.99)
SLO_FIGURES = ("ttft_s", "tpot_s", "e2e_s")
Z95 = 1.96
# Student t, two-sided 95%, by degrees of freedom (tables; BATCHES - 1 = 9 in use)
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def quantile_name(q: float) -> str:
    """p50, p90, p99, p99.9 ... of a share of requests."""
    return f"p{round(q * 100, 6):g}"


@dataclass(frozen=True)
class Window:
    """The steady window: requests arriving in [start_s, end_s] (rooms, by arrival)."""

    start_s: float
    end_s: float
    rooms: tuple[int, ...]
    warmup: int  # requests dropped before
    drain: int  # requests dropped after

    @property
    def span_s(self) -> float:
        return self.end_s - self.start_s


def _mser(series: Sequence[float]) -> int:
    """Requests to drop at the start (MSER-5)."""
    means = [
        statistics.fmean(series[i : i + MSER_BATCH])
        for i in range(0, len(series) - MSER_BATCH + 1, MSER_BATCH)
    ]
    best, best_d = math.inf, 0
    for d in range(len(means) // 2 + 1):
        rest = means[d:]
        if len(rest) < 2:
            break
        m = statistics.fmean(rest)
        se = sum((y - m) ** 2 for y in rest) / len(rest) ** 2
        if se < best - 1e-18:
            best, best_d = se, d
    return best_d * MSER_BATCH


def steady_window(rooms: dict[int, dict[str, float]]) -> Window:
    """The requests of the steady state (see the module docstring)."""
    arrived = sorted((i["arrival"], room) for room, i in rooms.items() if "arrival" in i)
    n = len(arrived)
    if n < 2 * MSER_BATCH:
        return Window(arrived[0][0] if arrived else 0.0, arrived[-1][0] if arrived else 0.0,
                      tuple(r for _, r in arrived), 0, 0)  # fmt: skip
    figs = [request_figures(rooms[room]) for _, room in arrived]
    worst = max((f["ttft_s"] for f in figs if f), default=0.0)
    ttft = [f["ttft_s"] if f else worst for f in figs]  # failed: as the worst
    cut = max(math.ceil(MIN_WARMUP_SHARE * n), _mser(ttft))
    life = [f.get("e2e_s", f["ttft_s"]) for f in figs[cut:] if f]
    last = arrived[-1][0]
    end = n
    if life:
        horizon = last - statistics.median(life)
        keep_min = cut + (n - cut + 1) // 2
        while end > keep_min and arrived[end - 1][0] > horizon:
            end -= 1
    kept = arrived[cut:end]
    return Window(kept[0][0], kept[-1][0], tuple(r for _, r in kept), cut, n - end)


def _batches(values: Sequence[float]) -> list[list[float]]:
    k = min(BATCHES, len(values))
    size = len(values) / k if k else 0
    return [list(values[round(i * size) : round((i + 1) * size)]) for i in range(k)]


def _inflation(indicator: Sequence[float]) -> float:
    """Variance of the batch means over the variance iid samples would give (>= 1)."""
    batches = [b for b in _batches(indicator) if b]
    if len(batches) < 2:
        return 1.0
    p = statistics.fmean(indicator)
    iid = p * (1 - p)
    if iid <= 0:
        return 1.0
    m = len(indicator) / len(batches)
    var = statistics.variance([statistics.fmean(b) for b in batches])
    return max(1.0, var * m / iid)


def _interval(per_batch: Sequence[float]) -> float:
    """Half-width of the 95% interval of the mean of `per_batch` (Student t)."""
    k = len(per_batch)
    if k < 2:
        return math.inf
    return T95.get(k - 1, Z95) * statistics.stdev(per_batch) / math.sqrt(k)


def quantile_interval(values: Sequence[float], q: float) -> tuple[float, float, float]:
    """(estimate, low, high) of the q-quantile of `values` (in time order)."""
    xs = sorted(values)
    if not xs:
        return math.nan, math.nan, math.nan
    est = quantile(xs, q)
    n_eff = len(xs) / _inflation([1.0 if v <= est else 0.0 for v in values])
    half = Z95 * math.sqrt(q * (1 - q) / n_eff) if n_eff > 0 else 1.0
    lo_rank = math.floor((q - half) * len(xs))
    hi_rank = math.ceil((q + half) * len(xs))
    lo = xs[lo_rank] if lo_rank >= 0 else -math.inf
    hi = xs[hi_rank] if hi_rank < len(xs) else math.inf
    return est, min(lo, est), max(hi, est)


def steady_figures(
    rooms: dict[int, dict[str, float]],
    requests: Sequence[Request],
    targets: dict[str, float],
    attainment: float,
    *,
    gpus: int,
) -> dict[str, Any]:
    """The window's figures, flat (sweep-style names; None where a figure has no sample):
    `<fig>.p50/.p90/.p99` and `<fig>.<pQ>` with `_lo` / `_hi`, `slo_attainment` and
    `goodput_rps` (+ `_lo` / `_hi`), `goodput_per_gpu_rps`, `input_tokens_per_gpu_s`,
    `output_tokens_per_gpu_s`, `tokens_per_user_s` (1 / TPOT p50) and the window."""
    w = steady_window(rooms)
    by_room = {r.room: r for r in requests}
    figs = [(room, request_figures(rooms[room])) for room in w.rooms]
    qname = quantile_name(attainment)
    out: dict[str, Any] = {
        "window_start_s": w.start_s,
        "window_end_s": w.end_s,
        "window_requests": len(w.rooms),
        "warmup_requests": w.warmup,
        "drain_requests": w.drain,
    }
    for key in SLO_FIGURES:
        values = [f[key] for _, f in figs if f and key in f]
        xs = sorted(values)
        for q in QUANTILES:
            out[f"{key}.{quantile_name(q)}"] = _finite(quantile(xs, q))
        est, lo, hi = quantile_interval(values, attainment)
        out[f"{key}.{qname}"] = _finite(est)
        out[f"{key}.{qname}_lo"] = _finite(lo)
        out[f"{key}.{qname}_hi"] = _finite(hi)

    itls = sorted(gap for room in w.rooms for gap in rooms[room].get("itls", ()))
    for q in {*QUANTILES, attainment}:  # every gap of the window's requests, pooled
        out[f"itl_s.{quantile_name(q)}"] = _finite(quantile(itls, q))
    hits = [float(meets(f, targets)) for _, f in figs]
    n = len(hits)
    rate = (n - 1) / w.span_s if n > 1 and w.span_s > 0 else 0.0
    att = statistics.fmean(hits) if hits else 0.0
    batches = [b for b in _batches(hits) if b]
    att_half = _interval([statistics.fmean(b) for b in batches])
    out |= {
        "slo_attainment": att,
        "slo_attainment_lo": max(0.0, att - att_half),
        "slo_attainment_hi": min(1.0, att + att_half),
        "offered_load_rps": rate,
        "goodput_rps": att * rate,
        "goodput_rps_lo": max(0.0, att - att_half) * rate,
        "goodput_rps_hi": min(1.0, att + att_half) * rate,
        "goodput_per_gpu_rps": att * rate / gpus if gpus else 0.0,
    }
    done = [room for room, f in figs if f]
    tokens_in = sum(by_room[r].prompt_tokens for r in done if r in by_room)
    tokens_out = sum(by_room[r].output_tokens for r in done if r in by_room)
    per = n / rate if rate > 0 else math.inf  # the window's span, n arrivals long
    out["input_tokens_per_gpu_s"] = tokens_in / per / gpus if gpus and per < math.inf else None
    out["output_tokens_per_gpu_s"] = (
        tokens_out / per / gpus if gpus and per < math.inf and tokens_out else None
    )
    tpot = out.get("tpot_s.p50")
    out["tokens_per_user_s"] = 1.0 / tpot if tpot else None
    return out


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None
