"""Figures of many runs: a parameter sweep's rows (`plot_sweep`, written as PNG files)
and a capacity plan's Pareto front (`front_figure`, from plan.json).

Built without pyplot, like the run figures (kvstage/analysis/figures.py), whose
Okabe-Ito palette they share.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

import matplotlib
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from kvstage.explore.sweep import STATUS_INVALID, STATUS_OK, SweepResult, fmt_number, metric_display
from kvstage.explore.sweep_target import Target, is_numeric, value_order
from kvstage.fmt import OKABE_ITO

# --- parameter sweeps (`kvstage sweep`) -------------------------------------------------------

# Line colours of the sweep figures: the Okabe-Ito palette, in this order.
SWEEP_COLORS = tuple(
    OKABE_ITO[k]
    for k in ("blue", "orange", "green", "purple", "sky_blue", "vermillion", "yellow", "black")
)
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
_LINESTYLES = ("-", "--", "-.", ":")

_KEY_LABELS = {
    "decode.staging_pool_mb": "staging pool per decode rank (MiB)",
    "workload.rate_per_s": "arrival rate (requests/s)",
    "workload.requests": "requests",
    "workload.prompt_tokens": "prompt length (tokens)",
    "workload.prompt_max": "longest prompt (tokens)",
    "prefill.chunked_prefill_size": "prefill chunk (tokens)",
    "prefill.tp": "prefill TP size",
    "decode.tp": "decode TP size",
    "decode.page_size": "decode page size (tokens)",
    "decode.prefix_tokens": "cached prefix (tokens)",
    "prefill.tokens_per_s": "prefill speed (tokens/s)",
    "links.inter_bandwidth_gbps": "inter-node link (Gbit/s)",
    "links.intra_bandwidth_gbps": "intra-node link (Gbit/s)",
}
_SUFFIX_UNITS = (
    ("_mb", "MiB"),
    ("_gbps", "Gbit/s"),
    ("_gbs", "GB/s"),
    ("_per_s", "1/s"),
    ("_tflops", "TFLOP/s"),
    ("_us", "µs"),
    ("_tokens", "tokens"),
    ("_s", "s"),
)


def key_label(key: str) -> str:
    if key in _KEY_LABELS:
        return _KEY_LABELS[key]
    leaf = key.rsplit(".", 1)[-1]
    for suffix, unit in _SUFFIX_UNITS:
        if leaf.endswith(suffix):
            return f"{key} ({unit})"
    return key


def _fmt_value(v: Any) -> str:
    if isinstance(v, float) and v.is_integer():
        return f"{v:g}"
    return str(v)


def plot_sweep(
    result: SweepResult, metric: str, out_dir: Path, target: Target | None = None
) -> list[Path]:
    """heatmap-<metric>.png for two varied keys; lines-<metric>.png (metric against the
    first varied key, one line per setting of the others) whenever that makes at most
    12 lines. Returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    slug = metric.replace(".", "_")
    scale, unit, label = metric_display(metric, [r[metric] for r in result.rows])
    ylabel = f"{label} ({unit})" if unit else label
    figures: list[tuple[str, Figure]] = []
    if len(result.varies) == 2:
        figures.append(("heatmap", _sweep_heatmap(result, metric, scale, label, ylabel, target)))
    if math.prod(len(v.values) for v in result.varies[1:]) <= 12:
        figures.append(
            ("lines", _sweep_lines(result, metric, (scale, unit, label, ylabel), target))
        )
    written: list[Path] = []
    for kind, fig in figures:
        path = out_dir / f"{kind}-{slug}.png"
        fig.savefig(path, dpi=120)
        written.append(path)
    return written


def _sweep_heatmap(
    result: SweepResult, metric: str, scale: float, label: str, ylabel: str, target: Target | None
) -> Figure:
    """The metric over the two varied keys, one annotated cell per point; cells whose
    point meets `target` are outlined."""
    first, second = result.varies
    fig = Figure(
        figsize=(max(6.0, 2.2 + 1.2 * len(second.values)), max(4.0, 1.6 + 0.6 * len(first.values)))
    )
    ax = fig.add_subplot()
    grid = [
        [result.row_at((a, b)) for b in range(len(second.values))] for a in range(len(first.values))
    ]
    data = [
        [
            math.nan if r[metric] is None or r["status"] != STATUS_OK else r[metric] * scale
            for r in line
        ]
        for line in grid
    ]
    finite = [x for line in data for x in line if math.isfinite(x)]
    vmin, vmax = (min(finite), max(finite)) if finite else (0.0, 1.0)
    if vmin == vmax:
        vmin, vmax = vmin - 0.5, vmax + 0.5
    cmap = matplotlib.colormaps["cividis"].with_extremes(bad="#d9d9d9")
    im = ax.imshow(data, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto", origin="lower")
    for i, line in enumerate(grid):
        for j, r in enumerate(line):
            text, colour = _cell_text(r, data[i][j], cmap, vmin, vmax)
            if target is not None and target.met_by(r):
                text += " ✓"
                ax.add_patch(
                    Rectangle(
                        (j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="#E69F00", linewidth=2.5
                    )
                )
            ax.text(j, i, text, ha="center", va="center", color=colour, fontsize=9)
    ax.set_xticks(range(len(second.values)), [_fmt_value(v) for v in second.values])
    ax.set_yticks(range(len(first.values)), [_fmt_value(v) for v in first.values])
    ax.set_xlabel(key_label(second.key))
    ax.set_ylabel(key_label(first.key))
    title = label
    if target is not None:
        title += f"   (✓ outlined: meets {target.text})"
    ax.set_title(title, fontsize=10)
    fig.colorbar(im, ax=ax, label=ylabel)
    fig.tight_layout()
    return fig


def _cell_text(
    row: dict[str, Any], x: float, cmap: Any, vmin: float, vmax: float
) -> tuple[str, str]:
    """A heatmap cell's text and its colour (black or white, whichever reads on the cell)."""
    if row["status"] != STATUS_OK:
        return row["status"], "#333333"
    if not math.isfinite(x):
        return "n/a", "#333333"
    rgba = cmap((x - vmin) / (vmax - vmin))
    lum = 0.2126 * rgba[0] + 0.7152 * rgba[1] + 0.0722 * rgba[2]
    return fmt_number(x), "black" if lum > 0.5 else "white"


def _sweep_lines(
    result: SweepResult, metric: str, display: tuple[float, str, str, str], target: Target | None
) -> Figure:
    """The metric against the first varied key (smallest first), one line per setting of
    the other keys; categories get markers only. Points that did not run are left out."""
    scale, unit, label, ylabel = display
    first, others = result.varies[0], result.varies[1:]
    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    numeric = is_numeric(first.values)
    order = value_order(first.values)
    xs_all = [first.values[i] for i in order]
    positions = xs_all if numeric else list(range(len(xs_all)))
    for n, combo in enumerate(itertools.product(*(range(len(v.values)) for v in others))):
        xs, ys = [], []
        for pos, i in zip(positions, order, strict=True):
            r = result.row_at((i, *combo))
            if r["status"] == STATUS_OK and r[metric] is not None:
                xs.append(pos)
                ys.append(r[metric] * scale)
        name = ", ".join(
            f"{v.key}={_fmt_value(v.values[j])}" for v, j in zip(others, combo, strict=True)
        )
        ax.plot(
            xs,
            ys,
            color=SWEEP_COLORS[n % len(SWEEP_COLORS)],
            marker=_MARKERS[n % len(_MARKERS)],
            linestyle=_LINESTYLES[(n // len(SWEEP_COLORS)) % len(_LINESTYLES)]
            if numeric
            else "none",
            label=name or None,
        )
    if target is not None and target.metric == metric:
        ax.axhline(
            target.value * scale,
            color="black",
            linestyle=":",
            linewidth=1.2,
            label=f"target {target.op} {fmt_number(target.value * scale)} {unit}".rstrip(),
        )
    if numeric:
        pos = [p for p in positions if p > 0]
        if len(pos) == len(positions) and max(pos) / min(pos) >= 8:
            ax.set_xscale("log", base=2)
            ax.minorticks_off()
        ax.set_xticks(positions, [_fmt_value(v) for v in xs_all])
    else:  # categories: markers only, no line between unrelated values
        ax.set_xticks(positions, [str(v) for v in xs_all])
        ax.margins(x=0.2)
    if all(y >= 0 for line in ax.get_lines() for y in line.get_ydata()):
        ax.set_ylim(bottom=0)
    ax.set_xlabel(key_label(first.key))
    ax.set_ylabel(ylabel)
    omitted = " (invalid points omitted)" if result.count(STATUS_INVALID) else ""
    ax.set_title(f"{label} against {first.key}{omitted}", fontsize=10)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


# --- capacity plans (`kvstage plan`) -----------------------------------------------------------


def shape(row: dict[str, Any]) -> str:
    """`P 2xTP4 + D 1xTP4, pool 4096 MiB, chunk 8192`: a configuration in a few words
    (the router and the path when they are not round-robin and staging)."""
    pe = f" EP{row['prefill.ep']}" if (row.get("prefill.ep") or 1) > 1 else ""
    pe += f" PP{row['prefill.pp']}" if (row.get("prefill.pp") or 1) > 1 else ""
    de = f" EP{row['decode.ep']}" if (row.get("decode.ep") or 1) > 1 else ""
    text = (
        f"P {row['cluster.prefill_instances']}xTP{row['prefill.tp']}{pe} + "
        f"D {row['cluster.decode_instances']}xTP{row['decode.tp']}{de}, pool {row['decode.staging_pool_mb']:g} MiB"
    )
    if row.get("prefill.chunked_prefill_size") is not None:
        text += f", chunk {row['prefill.chunked_prefill_size']}"
    if row.get("cluster.router") not in (None, "round-robin"):
        text += f", router {row['cluster.router']}"
    if row.get("transfer.path") not in (None, "staging"):
        text += f", {row['transfer.path']} path"
    if row.get("cluster.max_local_prefill_length") not in (None, "off"):
        text += f", prompts <= {row['cluster.max_local_prefill_length']} prefilled on D"
    return text


def _throughput_key(points: list[dict[str, Any]]) -> tuple[str, str]:
    """The y axis: output tokens/s per GPU, or input tokens/s where nothing is generated."""
    if any(r.get("output_tokens_per_gpu_s") for r in points):
        return "output_tokens_per_gpu_s", "output tokens/s per GPU"
    return "input_tokens_per_gpu_s", "input (prompt) tokens/s per GPU"


def front_figure(plan: dict[str, Any]) -> Any:
    """Two panels of every simulated point (plan.json's `points`, steady window):
    throughput per GPU against tokens/s per user (1 / TPOT p50) and against TTFT at the
    target quantile. Points that meet the SLO in colour, the front ringed, the winner
    starred, the SLO targets as lines."""
    q = plan.get("quantile", "p90")
    ttft = f"ttft_s.{q}"
    pts = [r for r in plan["points"] if r["status"] == STATUS_OK and r.get(ttft) is not None]
    ykey, ylabel = _throughput_key(pts)
    pts = [r for r in pts if r.get(ykey) is not None]
    fig = Figure(figsize=(11, 4.6), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    slo = plan.get("slo") or {}
    panels = (
        ("tokens_per_user_s", "tokens/s per user (1 / TPOT p50)", slo.get("tpot_s"), True),
        (ttft, f"TTFT {q} (s)", slo.get("ttft_s"), False),
    )
    w = plan.get("winner")
    for ax, (xkey, xlabel, target, inverse) in zip(axes, panels, strict=True):
        sel_all = [r for r in pts if r.get(xkey) is not None]
        for meets, color, label in (
            (False, "#b0b0b0", "misses the SLO"),
            (True, "#2c7fb8", "meets the SLO"),
        ):
            sel = [r for r in sel_all if bool(r["meets"]) == meets]
            ax.scatter(
                [r[xkey] for r in sel], [r[ykey] for r in sel], s=22, color=color, label=label
            )
        front = [r for r in sel_all if r["on_front"]]
        ax.scatter(
            [r[xkey] for r in front],
            [r[ykey] for r in front],
            s=70,
            facecolors="none",
            edgecolors="#d95f02",
            linewidths=1.3,
            label="on the front",
        )
        for r in front:
            ax.annotate(
                f"{r['gpus']}", (r[xkey], r[ykey]), fontsize=7, xytext=(4, 4),
                textcoords="offset points",
            )  # fmt: skip
        if w and w.get(xkey) is not None and w.get(ykey) is not None:
            ax.scatter(
                [w[xkey]], [w[ykey]], marker="*", s=240, color="#1b9e77", edgecolor="black",
                zorder=3, label=f"winner: {w['gpus']} GPUs ({shape(w)})",
            )  # fmt: skip
        if target:
            x = 1.0 / target if inverse else target
            what = f"TPOT target {target * 1e3:g} ms" if inverse else f"TTFT target {target:g} s"
            ax.axvline(x, color="black", ls="--", lw=0.8, label=what)
        xs = [r[xkey] for r in sel_all if r[xkey] > 0]
        if xs and max(xs) / min(xs) > 20:
            ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    axes[0].set_ylabel(ylabel)
    fig.suptitle(
        f"plan {plan.get('scenario_name', '')}: {len(pts)} configurations simulated "
        "(steady window; labels: GPUs)",
        fontsize=10,
    )
    return fig


def load_plan(path: str | Path) -> dict[str, Any]:
    """A plan directory's plan.json."""
    return json.loads((Path(path) / "plan.json").read_text())


def is_plan_dir(path: str | Path) -> bool:
    return (Path(path) / "plan.json").is_file()
