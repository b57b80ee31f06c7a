"""Figures of one or more runs, from their traces only (simulation and hardware alike).
The figures of sweeps and plans are kvstage/explore/figures.py.

Every figure is a `matplotlib.figure.Figure` built without pyplot (no global state,
Agg rendering), returned, so callers save it (`fig.savefig(...)`) or embed it. Colours come from the
Okabe-Ito palette, which stays distinguishable with the common forms of colour
blindness.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import NullFormatter

from kvstage.analysis.compare import PHASE_KEYS, PHASE_LABELS, phase_breakdown, room_metrics
from kvstage.fmt import MIB, OKABE_ITO, quantile
from kvstage.metrics.rooms import (
    RingSeries,
    percentiles,
    request_breakdown,
    ring_series,
    room_latencies,
)
from kvstage.run.rundir import Run, load_run

RUN_COLORS = [
    OKABE_ITO[k]
    for k in ("blue", "orange", "green", "vermillion", "purple", "sky_blue", "black", "yellow")
]
PHASE_COLORS = {
    "compute": "#C8C8C8",  # neutral grey: context, not transfer
    "wm_wait": OKABE_ITO["yellow"],
    "gather": OKABE_ITO["sky_blue"],
    "write": OKABE_ITO["blue"],
    "slice_write": OKABE_ITO["purple"],
    "scatter": OKABE_ITO["green"],
    "chunk_ready": OKABE_ITO["orange"],
    "control_req_rsp": OKABE_ITO["vermillion"],
    "control_chunk_ready": OKABE_ITO["orange"],
}


def _log(ax, axis: str = "x") -> None:
    """Log scale without minor tick labels (they crowd the axis and cost layout time)."""
    for name in axis:
        getattr(ax, f"set_{name}scale")("log")
        getattr(ax, f"{name}axis").set_minor_formatter(NullFormatter())


def run_color(i: int) -> str:
    return RUN_COLORS[i % len(RUN_COLORS)]


def _runs(runs: Sequence[Run | str]) -> list[Run]:
    return [load_run(r) for r in runs]


def _label(run: Run) -> str:
    return f"{run.name} ({run.mode}, {run.transfer_path})"


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="#555555")
    ax.set_xticks([])
    ax.set_yticks([])


# --- Gantt timeline -----------------------------------------------------------------------

# Bands inside a lane of height 1: (bottom, height); a phase maps to its band.
_BANDS = {
    "prefill": {"compute": (0.68, 0.26), "xfer": (0.36, 0.28), "wm_wait": (0.06, 0.26)},
    "decode": {"chunk_ready": (0.60, 0.28), "scatter": (0.18, 0.38)},
}
_PHASE_BAND = {
    ("prefill", "compute"): "compute",
    ("prefill", "gather"): "xfer",
    ("prefill", "write"): "xfer",
    ("prefill", "slice_write"): "xfer",
    ("prefill", "wm_wait"): "wm_wait",
    ("decode", "chunk_ready"): "chunk_ready",
    ("decode", "scatter"): "scatter",
}
_MAX_SUBROWS = 6


def _pack(items: list[tuple[float, float]]) -> tuple[list[int], int]:
    """Greedy interval packing: a sub-row per item so that spans in one sub-row do not
    overlap (at most _MAX_SUBROWS; beyond, the sub-row that frees first is shared)."""
    order = sorted(range(len(items)), key=lambda i: items[i])
    ends: list[float] = []
    row = [0] * len(items)
    for i in order:
        start, end = items[i]
        k = next((j for j, e in enumerate(ends) if e <= start), None)
        if k is None and len(ends) < _MAX_SUBROWS:
            k = len(ends)
            ends.append(end)
        elif k is None:
            k = min(range(len(ends)), key=ends.__getitem__)
        ends[k] = max(ends[k], end)
        row[i] = k
    return row, max(len(ends), 1)


def _gantt_records(
    run: Run, max_rooms: int, window: tuple[float, float] | None
) -> tuple[list, str]:
    """The records a gantt draws (the first `max_rooms` rooms, or those in `window`)
    and the note saying which, for the title."""
    recs = [r for r in run.records if r.room >= 0]
    first_seen: dict[int, float] = {}
    for r in recs:
        first_seen[r.room] = min(first_seen.get(r.room, math.inf), r.start)
    order = sorted(first_seen, key=lambda k: (first_seen[k], k))
    if window is not None:
        t0, t1 = window
        return [r for r in recs if r.end >= t0 and r.start <= t1], f"window {t0:g}-{t1:g} s"
    if len(order) > max_rooms:
        keep = set(order[:max_rooms])
        return [r for r in recs if r.room in keep], f"first {max_rooms} of {len(order)} rooms"
    return recs, f"all {len(order)} rooms"


def gantt(
    run: Run | str, *, max_rooms: int = 8, window: tuple[float, float] | None = None
) -> Figure:
    """Per-rank timeline of chunk phases: one lane per prefill and decode rank; on a
    prefill lane compute (grey, top), gather / write / slice write (middle) and the
    watermark wait (bottom); on a decode lane chunk_ready (top) and scatter. Long runs
    are cut to the first `max_rooms` rooms (or to `window`, seconds), said in the title."""
    run = load_run(run)
    recs, note = _gantt_records(run, max_rooms, window)
    prefill_ranks = sorted({r.rank for r in run.records if r.role == "prefill"})
    decode_ranks = sorted({r.rank for r in run.records if r.role == "decode"})
    lanes = [("prefill", p) for p in prefill_ranks] + [("decode", d) for d in decode_ranks]
    lane_y = {lane: len(lanes) - 1 - i for i, lane in enumerate(lanes)}  # prefill on top

    # (role, rank, band) -> [(start, end, phase, room)], packed into non-overlapping sub-rows
    groups: dict[tuple[str, int, str], list[tuple[float, float, str, int]]] = {}
    for r in recs:
        band = _PHASE_BAND.get((r.role, r.phase))
        if band is not None and r.end >= r.start:
            groups.setdefault((r.role, r.rank, band), []).append((r.start, r.end, r.phase, r.room))
    packed = {key: _pack([(a, b) for a, b, _, _ in items]) for key, items in groups.items()}
    depth = max((n for _, n in packed.values()), default=1)
    lane_in = 0.42 + 0.09 * (min(depth, _MAX_SUBROWS) - 1)  # lanes grow when spans overlap
    fig = Figure(figsize=(11, 1.6 + lane_in * max(len(lanes), 2)), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    xmin = min((r.start for r in recs), default=0.0)
    xmax = max((r.end for r in recs), default=1.0)
    span = max(xmax - xmin, 1e-9)
    present = set()
    bars: dict[tuple[str, float, float], list[tuple[float, float]]] = {}  # (phase, y, h) -> spans
    ticks: dict[tuple[str, float, float], list[float]] = {}
    labels: list[tuple[float, float, str]] = []
    for (role, rank, band), items in groups.items():
        bottom, height = _BANDS[role][band]
        sub, n = packed[(role, rank, band)]
        h = height / n
        for (start, end, phase, room), k in zip(items, sub, strict=True):
            y = lane_y[(role, rank)] + bottom + (n - 1 - k) * h
            present.add(phase)
            if end > start:
                bars.setdefault((phase, y, h), []).append((start, end - start))
                if (
                    h * lane_in >= 0.11
                    and phase in ("write", "slice_write", "scatter")
                    and (end - start) / span > 0.035
                ):
                    labels.append(((start + end) / 2, y + h / 2, f"r{room}"))
            else:
                ticks.setdefault((phase, y, h), []).append(start)
    for (phase, y, h), xs in bars.items():
        color = PHASE_COLORS[phase]
        # an edge in the face colour keeps microsecond spans visible as a thin line
        ax.broken_barh(
            xs,
            (y + h * 0.06, h * 0.88),
            facecolors=color,
            edgecolors={"wm_wait": "#333333", "compute": "white"}.get(phase, color),
            linewidth=0.6,
            alpha=0.9,
        )
    for (phase, y, h), ts in ticks.items():
        ax.vlines(ts, y + h * 0.06, y + h * 0.94, colors=PHASE_COLORS[phase], linewidth=1.4)
    for x, y, text in labels:
        ax.text(x, y, text, ha="center", va="center", fontsize=7, color="white")
    ax.set_xlim(xmin - 0.01 * span, xmax + 0.01 * span)
    ax.set_ylim(-0.1, len(lanes) + 0.1)
    ax.set_yticks(
        [lane_y[lane] + 0.5 for lane in lanes], [f"{role} {rank}" for role, rank in lanes]
    )
    for i in range(1, len(lanes)):
        ax.axhline(i, color="#DDDDDD", linewidth=0.6)
    if prefill_ranks and decode_ranks:
        ax.axhline(len(decode_ranks), color="#777777", linewidth=1.2)
    ax.set_xlabel("time since run start (s)")
    ax.set_title(f"{run.name}: chunk phases per rank ({run.describe()}; {note})", fontsize=10)
    _phase_legend(ax, present)
    ax.grid(axis="x", color="#EEEEEE")
    ax.set_axisbelow(True)
    return fig


def _phase_legend(ax, present: set[str]) -> None:
    """The gantt's legend: the phases that occur, in pipeline order (or a note if none)."""
    order_phases = [
        "compute",
        "gather",
        "write",
        "slice_write",
        "wm_wait",
        "chunk_ready",
        "scatter",
    ]
    names = {
        "compute": "compute (prefill forward)",
        "wm_wait": "waiting for watermark",
        "chunk_ready": "chunk_ready (decode)",
        "slice_write": "slice write",
        "write": "write (bulk)",
    }
    handles = [
        Patch(
            facecolor=PHASE_COLORS[p],
            edgecolor="#333333" if p == "wm_wait" else PHASE_COLORS[p],
            label=names.get(p, p),
        )
        for p in order_phases
        if p in present
    ]
    if handles:
        ax.legend(
            handles=handles,
            loc="lower center",
            bbox_to_anchor=(0.5, 1.06),
            ncol=len(handles),
            fontsize=8,
            frameon=False,
        )
    else:
        _empty(ax, "no chunk phases in this run")


# --- staging ring ------------------------------------------------------------------------------


def ring_occupancy(run: Run | str, *, max_ranks: int = 8) -> Figure:
    """Per decode rank, on one y scale shared by every rank: live staging bytes (written,
    not yet freed: never above the pool) as a filled area, reservations (regions handed
    out, which overcommit and may exceed the pool) as a line, the pool (dashed), and the
    watermark as a position in ring rounds (round + tail / pool) on the right axis.
    Both byte series come from `kvstage.metrics.rooms.ring_series`."""
    run = load_run(run)
    pool = run.pool_bytes
    series = ring_series(run.records)
    ranks = sorted({r.rank for r in run.records if r.role == "decode"})
    shown = ranks[:max_ranks]
    used = {
        k: s
        for k, s in series.items()
        if k in shown and (s.reserved_peak or s.live_peak or s.watermark)
    }
    if not used:
        fig = Figure(figsize=(11, 1.4), dpi=100, layout="constrained")
        ax = fig.add_subplot()
        _empty(
            ax,
            f"the staging ring was not used in this run ({run.transfer_path} path): nothing to plot",
        )
        ax.set_title(f"{run.name}: staging ring per decode rank", fontsize=10)
        return fig
    ymax = max([pool] + [max(s.reserved_peak, s.live_peak) for s in used.values()]) / MIB * 1.08
    wmax = max(
        (rd + (tl / pool if pool else 0.0) for s in used.values() for _, rd, tl in s.watermark),
        default=1.0,
    )
    n = max(len(shown), 1)
    fig = Figure(figsize=(11, 1.0 + 2.0 * n), dpi=100, layout="constrained")
    axes = fig.subplots(n, 1, sharex=True, sharey=True, squeeze=False)[:, 0]
    for ax, rank in zip(axes, shown, strict=False):
        s = used.get(rank)
        if s is None:
            _empty(ax, f"decode {rank}: the staging ring was not used ({run.transfer_path} path)")
            continue
        _ring_panel(ax, s, pool)
        ax.set_ylabel(f"decode {rank}\nMiB")
        ax.set_ylim(0, ymax)
        if s.watermark:
            ax2 = ax.twinx()
            ax2.step(
                [t for t, _, _ in s.watermark],
                [rd + (tl / pool if pool else 0.0) for _, rd, tl in s.watermark],
                where="post",
                color=OKABE_ITO["vermillion"],
                linewidth=1.2,
                label="watermark (round + tail/pool)",
            )
            ax2.set_ylabel("watermark\n(ring rounds)", color=OKABE_ITO["vermillion"])
            ax2.tick_params(axis="y", colors=OKABE_ITO["vermillion"])
            ax2.set_ylim(0, wmax * 1.05)  # the same scale on every rank
    handles, labels = [], []
    for a in fig.axes:
        for h, lab in zip(*a.get_legend_handles_labels(), strict=True):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="outside lower center", ncol=4, fontsize=8, frameon=False)
    axes[-1].set_xlabel("time since run start (s)")
    more = f"; first {len(shown)} of {len(ranks)} decode ranks" if len(ranks) > len(shown) else ""
    fig.suptitle(
        f"{run.name}: staging ring per decode rank (one scale for every rank{more})\n"
        "live = written, not yet freed (never above the pool); reserved = regions handed out "
        "(the next round may be handed out over live bytes)",
        fontsize=10,
    )
    return fig


def _ring_panel(ax, s: RingSeries, pool: int) -> None:
    """One decode rank's live bytes (filled), reservations (line) and the pool (dashed)."""
    if s.live:
        t = [0.0] + [x for x, _ in s.live]
        y = [0.0] + [v / MIB for _, v in s.live]
        ax.fill_between(t, y, step="post", color=OKABE_ITO["sky_blue"], alpha=0.45, linewidth=0)
        ax.step(
            t,
            y,
            where="post",
            color=OKABE_ITO["blue"],
            linewidth=1.2,
            label="live bytes (written, not yet freed)",
        )
    if s.reserved:
        ax.step(
            [0.0] + [x for x, _ in s.reserved],
            [0.0] + [v / MIB for _, v in s.reserved],
            where="post",
            color=OKABE_ITO["orange"],
            linewidth=1.1,
            label="reserved bytes (regions handed out)",
        )
    if pool:
        ax.axhline(
            pool / MIB,
            color=OKABE_ITO["black"],
            linestyle="--",
            linewidth=1,
            label=f"pool ({pool / MIB:,.0f} MiB)",
        )
    ax.text(
        0.005,
        0.95,
        f"peak live {s.live_peak / MIB:,.0f} MiB, reserved {s.reserved_peak / MIB:,.0f} MiB",
        transform=ax.transAxes,
        ha="left",
        va="top",
        fontsize=8,
        color="#333333",
    )
    ax.grid(color="#EEEEEE")


# --- latency distributions -------------------------------------------------------------------


def _ms_axis(ax, values: Sequence[float]) -> None:
    pos = [v for v in values if v > 0]
    if pos and max(pos) / min(pos) > 20:
        _log(ax, "x")


def latency_cdfs(runs: Sequence[Run | str]) -> Figure:
    """Empirical CDFs of transfer latency and TTFT, one curve per run; circles mark
    each run's p50 and p99, whose values the legend under each panel prints."""
    runs = _runs(runs)
    height = 4.0 + 0.17 * len(runs)
    fig = Figure(figsize=(11, height), dpi=100)
    # fixed margins: constrained layout would measure every (log) tick label twice
    fig.subplots_adjust(
        left=0.065,
        right=0.985,
        bottom=(0.75 + 0.17 * len(runs)) / height,
        top=1 - 0.35 / height,
        wspace=0.2,
    )
    axes = fig.subplots(1, 2)
    for ax, key, title in (
        (axes[0], "transfer", "transfer latency (first STAGING_REQ -> room done)"),
        (axes[1], "ttft", "TTFT (arrival -> first token)"),
    ):
        allv: list[float] = []
        for i, run in enumerate(runs):
            vals = sorted(m[key] * 1e3 for m in room_metrics(run.records).values() if key in m)
            if not vals:
                continue
            allv += vals
            ys = [(k + 1) / len(vals) for k in range(len(vals))]
            q = percentiles(vals)
            ax.step(
                [vals[0]] + vals,
                [0.0] + ys,
                where="post",
                color=run_color(i),
                linewidth=1.8,
                label=f"{_label(run)}, n={len(vals)}: p50 {q['p50']:,.1f} ms, p99 {q['p99']:,.1f} ms",
            )
            ax.plot(
                [q["p50"], q["p99"]],
                [0.5, 0.99],
                linestyle="none",
                marker="o",
                markersize=5,
                markerfacecolor="white",
                markeredgecolor=run_color(i),
            )
        if not allv:
            _empty(ax, "no completed rooms")
            continue
        _ms_axis(ax, allv)
        ax.set_xlabel(f"{key == 'ttft' and 'TTFT' or 'transfer latency'} (ms)")
        ax.set_ylabel("fraction of rooms")
        ax.set_ylim(0, 1.02)
        ax.set_title(title, fontsize=10)
        ax.grid(color="#EEEEEE")
        ax.axhline(0.5, color="#999999", linewidth=0.6, linestyle=":")
        ax.axhline(0.99, color="#999999", linewidth=0.6, linestyle=":")
        ax.legend(loc="upper left", bbox_to_anchor=(0.0, -0.13), fontsize=7, frameon=False)
    return fig


# --- phase breakdown ------------------------------------------------------------------------------


def phase_bars(runs: Sequence[Run | str]) -> Figure:
    """Total time per phase (s) and mean per chunk and rank (ms), one bar per run.
    Control: the req -> rsp gap and the wait from the last write to chunk_ready."""
    runs = _runs(runs)
    data = [phase_breakdown(run.records) for run in runs]
    phases = [k for k in PHASE_KEYS if any(d[k]["count"] for d in data)] or list(PHASE_KEYS)
    height = 1.9 + 0.3 * len(phases) * max(len(runs), 1)
    fig = Figure(figsize=(11, height), dpi=100)
    fig.subplots_adjust(
        left=0.23, right=0.97, wspace=0.12, bottom=0.65 / height, top=1 - 0.8 / height
    )
    axes = fig.subplots(1, 2, sharey=True)
    n = max(len(runs), 1)
    h = 0.8 / n
    for ax, key, scale, xlabel in (
        (axes[0], "total_s", 1.0, "total time, all ranks (s)"),
        (axes[1], "mean_s", 1e3, "mean per chunk and rank (ms)"),
    ):
        values = []
        for i, (run, d) in enumerate(zip(runs, data, strict=True)):
            ys = [len(phases) - 1 - j + (n - 1 - i) * h - 0.4 + h / 2 for j in range(len(phases))]
            xs = [d[p][key] * scale for p in phases]
            values += xs
            ax.barh(ys, xs, height=h * 0.92, color=run_color(i), label=_label(run))
            for y, x in zip(ys, xs, strict=True):
                if x > 0:
                    ax.text(
                        x, y, f" {x:,.0f}" if x >= 1000 else f" {x:.3g}", va="center", fontsize=7
                    )
        pos = [v for v in values if v > 0]
        if pos and max(pos) / min(pos) > 200:
            _log(ax, "x")
            ax.set_xlim(min(pos) / 2, max(pos) * 8)
        elif pos:
            ax.set_xlim(0, max(pos) * 1.25)
        ax.set_xlabel(xlabel)
        ax.grid(axis="x", color="#EEEEEE")
        ax.set_axisbelow(True)
    axes[0].set_yticks(
        [len(phases) - 1 - j for j in range(len(phases))], [PHASE_LABELS[p] for p in phases]
    )
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(
        handles,
        names,
        loc="upper center",
        bbox_to_anchor=(0.5, 1 - 0.3 / height),
        ncol=min(n, 4),
        fontsize=8,
        frameon=False,
    )
    fig.suptitle(
        "phase breakdown per run (phases no run has are left out; control = message gaps)",
        fontsize=10,
        y=1 - 0.08 / height,
    )
    return fig


# --- staging vs slice -----------------------------------------------------------------------------


# What each latency panel measures: (request_breakdown key, title, the span it measures).
_PATH_PANELS = (
    ("ttft_s", "TTFT", "arrival -> first token: what the user waits"),
    (
        "kv_transfer_latency_s",
        "exposed KV transfer",
        "last forward end -> decode ready: the part of TTFT\nthe transfer adds",
    ),
)


def _quantile_bars(ax, breakdowns: list[dict[str, list[float]]], key: str) -> None:
    """p50 (solid) and p99 (hatched) bars of one per-request span, a pair per run
    (`breakdowns`: each run's `request_breakdown`)."""
    x = list(range(len(breakdowns)))
    spans = [b.get(key, []) for b in breakdowns]
    for j, (q, hatch) in enumerate(((0.5, ""), (0.99, "//"))):
        vals = [quantile(sorted(v), q) * 1e3 if v else 0.0 for v in spans]
        xs = [i + (j - 0.5) * 0.38 for i in x]
        ax.bar(
            xs,
            vals,
            width=0.36,
            color=[run_color(i) for i in x],
            hatch=hatch,
            edgecolor="white" if not hatch else "#333333",
        )
        for xi, v in zip(xs, vals, strict=True):
            ax.text(
                xi, v, f"{v:,.0f}" if v >= 10 else f"{v:.2g}", ha="center", va="bottom", fontsize=7
            )


def staging_vs_slice(runs: Sequence[Run | str]) -> Figure:
    """Side by side, per run: TTFT, the exposed KV transfer inside it (p50 solid / p99
    hatched, ms), and transfer requests per request (log scale), each panel saying
    what it measures; runs labelled with their transfer path."""
    runs = _runs(runs)
    fig = Figure(figsize=(11, 4.4), dpi=100)
    fig.subplots_adjust(left=0.07, right=0.985, bottom=0.14, top=0.80, wspace=0.32)
    axes = fig.subplots(1, 3)
    names = [f"{run.name}\n{run.transfer_path}" for run in runs]
    x = list(range(len(runs)))
    breakdowns = [request_breakdown(room_latencies(run.records)) for run in runs]
    for ax, (key, title, what) in zip(axes, _PATH_PANELS, strict=False):
        _quantile_bars(ax, breakdowns, key)
        ax.set_ylabel(f"{title} (ms)")
        ax.set_title(f"{title}, p50 (solid) / p99 (hatched)\n{what}", fontsize=9)
    per_req = []
    for run in runs:
        done = len(room_metrics(run.records)) or 1
        total = sum(r.requests for r in run.records if r.phase in ("write", "slice_write"))
        per_req.append(total / done)
    ax = axes[2]
    ax.bar(x, per_req, width=0.6, color=[run_color(i) for i in x])
    for xi, v in zip(x, per_req, strict=True):
        ax.text(xi, v, f"{v:,.0f}", ha="center", va="bottom", fontsize=7)
    if any(v > 0 for v in per_req):
        _log(ax, "y")
    ax.set_ylabel("transfer requests per request (log)")
    ax.set_title(
        "transfer requests per request\nengine requests posted / requests done", fontsize=9
    )
    for ax in axes:
        ax.set_xticks(x, names, fontsize=8)
        ax.grid(axis="y", color="#EEEEEE")
        ax.set_axisbelow(True)
    fig.suptitle("staging vs slice", fontsize=11)
    return fig


# --- comparison of two runs -------------------------------------------------------------------------


def comparison_scatter(result: dict) -> Figure:
    """B against A (from `compare_runs`): per-room transfer latency and TTFT, and per
    (room, chunk, decode rank) chunk latency, with the y = x line and the tolerance band."""
    a, b = result["a"], result["b"]
    tol = result.get("tolerance", 0.15)
    panels = [
        (
            "transfer latency per room",
            [(p["a_transfer_s"], p["b_transfer_s"]) for p in result["per_room"]],
            result["transfer_latency"],
        ),
        (
            "TTFT per room",
            [(p["a_ttft_s"], p["b_ttft_s"]) for p in result["per_room"]],
            result["ttft"],
        ),
        (
            "chunk latency per (room, chunk, decode rank)",
            [(p["a_s"], p["b_s"]) for p in result.get("per_chunk", [])],
            result["chunk_latency"],
        ),
    ]
    fig = Figure(figsize=(11, 4.3), dpi=100)
    fig.subplots_adjust(left=0.065, right=0.985, bottom=0.12, top=0.82, wspace=0.3)
    axes = fig.subplots(1, 3)
    for ax, (title, pairs, metrics) in zip(axes, panels, strict=True):
        pairs = [(x * 1e3, y * 1e3) for x, y in pairs if x is not None and y is not None]
        if not pairs:
            _empty(ax, "nothing matched")
            ax.set_title(title, fontsize=9)
            continue
        xs, ys = zip(*pairs, strict=True)
        lo = min(min(xs), min(ys))
        hi = max(max(xs), max(ys))
        log = lo > 0 and hi / lo > 20
        if log:
            lo, hi = lo / 1.3, hi * 1.3
            _log(ax, "xy")
        else:
            pad = (hi - lo) * 0.08 or max(hi, 1e-9) * 0.1
            lo, hi = max(0.0, lo - pad), hi + pad
        line = [lo, hi]
        ax.fill_between(
            line,
            [v * (1 - tol) for v in line],
            [v * (1 + tol) for v in line],
            color="#DDDDDD",
            alpha=0.6,
            linewidth=0,
            label=f"within {tol:.0%}",
        )
        ax.plot(line, line, color=OKABE_ITO["black"], linewidth=1, linestyle="--", label="y = x")
        ax.scatter(
            xs,
            ys,
            s=14,
            color=OKABE_ITO["blue"],
            alpha=0.75,
            edgecolors="none",
            label=f"n={len(xs)}",
        )
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.set_xlabel(f"A: {a['name']} (ms)")
        ax.set_ylabel(f"B: {b['name']} (ms)")
        mape, bias = metrics.get("mape"), metrics.get("bias")
        sub = ""
        if mape is not None and math.isfinite(mape):
            sub = f"\nMAPE {mape:.1%}, bias {bias:+.1%}"
        ax.set_title(title + sub, fontsize=9)
        ax.grid(color="#EEEEEE")
        bias_ok = bias is not None and math.isfinite(bias)
        ax.legend(loc="lower right" if bias_ok and bias > 0 else "upper left", fontsize=7)
    fig.suptitle(
        f"B vs A: {b['name']} ({b['mode']}, {b['transfer_path']}) against {a['name']} "
        f"({a['mode']}, {a['transfer_path']})",
        fontsize=10,
    )
    return fig


_CLIENT_PANELS = (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"))


def client_cdfs(runs: Sequence[Run | str]) -> Figure:
    """Empirical CDFs of TTFT, TPOT and ITL (the clients' definitions), one curve per run;
    a run that has only its tool's reported quantiles (no per-request rows) is drawn as
    its p50 / p90 / p99 points."""
    runs = _runs(runs)
    fig = Figure(figsize=(11, 3.8), dpi=100)
    fig.subplots_adjust(left=0.06, right=0.985, bottom=0.3, top=0.9, wspace=0.25)
    axes = fig.subplots(1, 3)
    per_run = [request_breakdown(room_latencies(run.records)) for run in runs]
    for ax, (key, title) in zip(axes, _CLIENT_PANELS, strict=True):
        allv: list[float] = []
        for i, (run, per) in enumerate(zip(runs, per_run, strict=True)):
            vals = sorted(v * 1e3 for v in per.get(key, []))
            if vals:
                ys = [(k + 1) / len(vals) for k in range(len(vals))]
                ax.step([vals[0], *vals], [0.0, *ys], where="post", color=run_color(i),
                        linewidth=1.6, label=_label(run))  # fmt: skip
                allv += vals
                continue
            rep = run.summary.get(key) or {}
            pts = [(rep[q] * 1e3, y) for q, y in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))
                   if isinstance(rep.get(q), int | float)]  # fmt: skip
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o", color=run_color(i),
                        label=f"{_label(run)} (reported)")  # fmt: skip
                allv += [p[0] for p in pts]
        if not allv:
            _empty(ax, f"no {title}")
            continue
        ax.set_xlabel(f"{title} (ms)")
        ax.set_ylim(0, 1.02)
        ax.set_title(title, fontsize=10)
        ax.grid(color="#EEEEEE")
    handles, labels = axes[0].get_legend_handles_labels()
    for ax in axes[1:]:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize=8)
    return fig
