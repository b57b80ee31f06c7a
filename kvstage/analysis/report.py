"""One self-contained HTML report of one or more runs.

The file carries everything inline: figures as base64 PNG `data:` URIs, CSS in a
`<style>` element, no script and no external URL (a Content-Security-Policy meta tag
forbids loading anything else), so it opens from disk in any browser, mails as one
attachment and archives with the run.
"""

from __future__ import annotations

import base64
import html
import io
import math
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from matplotlib.figure import Figure

from kvstage.analysis import figures
from kvstage.analysis.compare import PHASE_KEYS, compare_runs, room_metrics
from kvstage.fmt import MIB, fixed, ms, pct
from kvstage.metrics.rooms import percentiles, ring_figures, summarize
from kvstage.run.conditions import describe, loaded_warnings
from kvstage.run.rundir import Run, load_run

DPI = 100

_CSS = """
body { font-family: -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif;
       margin: 0; background: #f6f7f9; color: #1d2125; line-height: 1.45; }
main { max-width: 1180px; margin: 0 auto; padding: 24px 28px 60px; background: #fff; }
h1 { font-size: 1.7em; margin: 0 0 4px; }
h2 { font-size: 1.35em; margin: 40px 0 6px; padding-top: 12px; border-top: 2px solid #0072B2; }
h3 { font-size: 1.1em; margin: 26px 0 8px; }
p.meta { color: #555; margin: 2px 0 12px; font-size: 0.92em; word-break: break-all; }
nav ul { margin: 6px 0; padding-left: 20px; }
nav a, a { color: #0072B2; }
table { border-collapse: collapse; margin: 8px 0 16px; font-size: 0.9em; }
th, td { border: 1px solid #d5d9de; padding: 4px 10px; text-align: left; vertical-align: top; }
th { background: #eef1f4; font-weight: 600; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td:first-child { min-width: 12em; }
tr:nth-child(even) td { background: #fafbfc; }
.cols { display: flex; flex-wrap: wrap; gap: 24px; align-items: flex-start; }
.cols > div { flex: 1 1 420px; }
figure { margin: 14px 0 22px; }
figure img { max-width: 100%; height: auto; border: 1px solid #e3e6ea; display: block; }
figcaption { font-size: 0.88em; color: #444; margin-top: 4px; }
.verdict { font-size: 1.1em; font-weight: 600; padding: 10px 14px; margin: 10px 0 14px;
           border-left: 6px solid #009E73; background: #eef8f4; }
.verdict.off { border-left-color: #D55E00; background: #fbf0ea; }
.note { color: #8a4a00; }
.warn { color: #8a2a00; font-weight: 600; border-left: 6px solid #D55E00; background: #fbf0ea; padding: 6px 12px; }
code { background: #f0f2f4; padding: 0 4px; border-radius: 3px; }
"""


def _png(fig: Figure, dpi: int = DPI) -> bytes:
    buf = io.BytesIO()
    # no Software/URL metadata: the file should name no external address at all
    fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})
    return buf.getvalue()


def fig_to_data_uri(fig: Figure, dpi: int = DPI) -> str:
    return "data:image/png;base64," + base64.b64encode(_png(fig, dpi)).decode("ascii")


def _e(x) -> str:
    return html.escape(str(x), quote=True)


class _Figures:
    """Renders each figure once: into the page, and as `<png_dir>/<name>.png` when asked."""

    def __init__(self, png_dir: Path | None) -> None:
        self.png_dir = Path(png_dir) if png_dir is not None else None
        self.written: list[Path] = []
        if self.png_dir is not None:
            self.png_dir.mkdir(parents=True, exist_ok=True)

    def __call__(self, fig: Figure, name: str, alt: str, caption: str) -> str:
        raw = _png(fig)
        if self.png_dir is not None:
            path = self.png_dir / f"{name}.png"
            path.write_bytes(raw)
            self.written.append(path)
        uri = "data:image/png;base64," + base64.b64encode(raw).decode("ascii")
        return f'<figure><img src="{uri}" alt="{_e(alt)}"><figcaption>{_e(caption)}</figcaption></figure>'


def _gbs(gbit_s):
    """summary.json's Gbit/s as GB/s (10^9 bytes/s), the unit kvstage prints."""
    return gbit_s / 8 if isinstance(gbit_s, (int, float)) else gbit_s


def _table(
    rows: Iterable[Sequence], header: Sequence[str] | None = None, num_cols: Iterable[int] = ()
) -> str:
    nums = set(num_cols)
    out = ["<table>"]
    if header:
        out.append("<tr>" + "".join(f"<th>{_e(h)}</th>" for h in header) + "</tr>")
    for row in rows:
        cells = []
        for i, v in enumerate(row):
            cls = ' class="num"' if i in nums else ""
            cells.append(f"<td{cls}>{_e(v)}</td>")
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</table>")
    return "".join(out)


def _summary(run: Run) -> dict:
    if run.summary:
        return run.summary
    rooms = {r.room for r in run.records if r.room >= 0}
    return summarize(run.records, mode=run.mode, pool_bytes=run.pool_bytes, requests=len(rooms))


def _summary_rows(run: Run) -> list[tuple[str, str]]:
    s = _summary(run)
    lat, ttft = s.get("transfer_latency_s") or {}, s.get("ttft_s") or {}
    stall = s.get("watermark_stall_s") or {}
    tr = s.get("transfer_requests") or {}
    rows = [
        (
            "requests done / failed",
            f"{s.get('requests_done', '-')} / {s.get('requests_failed', '-')} of {s.get('requests', '-')}",
        ),
        (
            "transfer latency p50 / p90 / p99",
            f"{ms(lat.get('p50'))} / {ms(lat.get('p90'))} / {ms(lat.get('p99'))}",
        ),
        ("transfer latency mean / max", f"{ms(lat.get('mean'))} / {ms(lat.get('max'))}"),
        (
            "TTFT p50 / p90 / p99",
            f"{ms(ttft.get('p50'))} / {ms(ttft.get('p90'))} / {ms(ttft.get('p99'))}",
        ),
        ("payload", f"{(s.get('payload_bytes') or 0) / (1 << 30):,.2f} GiB"),
        ("throughput", f"{fixed(_gbs(s.get('throughput_gbps')))} GB/s"),
        *_ring_rows(run, s),
        (
            "watermark stall total / p99 / chunks",
            f"{fixed(stall.get('total'), ' s', 4)} / {ms(stall.get('p99'))} / {stall.get('chunks', '-')}",
        ),
        (
            "transfer requests total / per request",
            f"{fixed(tr.get('total'))} / {fixed(tr.get('per_request'), '', 1)}",
        ),
    ]
    for key, label in (
        ("events", "events"),
        ("sim_time_s", "simulated time (s)"),
        ("wall_s", "wall time (s)"),
        ("backend", "backend"),
        ("device", "device"),
        ("verify", "verify"),
        ("bytes_verified", "bytes verified"),
        ("bytes_wrong", "bytes wrong"),
        ("invariant_violations", "invariant violations"),
    ):
        if key in s and s[key] is not None:
            v = s[key]
            rows.append(
                (
                    label,
                    fixed(v, "", 3)
                    if isinstance(v, float)
                    else fixed(v)
                    if isinstance(v, int)
                    else str(v),
                )
            )
    if s.get("conditions"):
        rows.append(("host during the run", describe(s["conditions"])))
    failures = s.get("failures") or {}
    if failures:
        rows.append(
            ("failures", "; ".join(f"room {k}: {v}" for k, v in list(failures.items())[:10]))
        )
    return rows


def _ring_rows(run: Run, s: dict) -> list[tuple[str, str]]:
    """Live bytes (written, not yet freed) and reservations (may overcommit), from the
    summary, or from the trace for a summary written before these keys existed."""
    if "ring_live_peak_bytes" not in s:
        s = ring_figures(run.records, run.pool_bytes)
    return [
        (
            f"ring {kind} peak ({what})",
            f"{(s.get(f'ring_{kind}_peak_bytes') or 0) / MIB:,.1f} MiB "
            f"({(s.get(f'ring_{kind}_peak_fraction') or 0):.0%} of the pool)",
        )
        for kind, what in (("live", "written, not yet freed"), ("reserved", "regions handed out"))
    ]


def _warning(text: str) -> str:
    return f'<p class="warn">warning: {_e(text)}</p>'


def _scenario_rows(run: Run) -> list[tuple[str, str]]:
    sc = run.scenario
    m, p, d = sc.get("model", {}), sc.get("prefill", {}), sc.get("decode", {})
    links, w, t = sc.get("links", {}), sc.get("workload", {}), sc.get("transfer", {})
    rows = [
        (
            "model",
            f"{m.get('preset', 'custom')}: {m.get('layers', '?')} layers, {m.get('kv_heads', '?')} KV heads x {m.get('head_dim', '?')}, {m.get('dtype', '?')}",
        ),
        (
            "prefill TP -> decode TP",
            f"{p.get('tp', '?')} -> {d.get('tp', '?')} (chunked prefill {p.get('chunked_prefill_size', '?')} tokens, page {d.get('page_size', '?')})",
        ),
        (
            "transfer path",
            f"{run.transfer_path} (staging pool {d.get('staging_pool_mb', '?')} MiB per decode rank)",
        ),
        (
            "links",
            f"{links.get('profile', 'custom')}, {links.get('placement', '?')}: {fixed(_gbs(links.get('inter_bandwidth_gbps')))} GB/s inter-node",
        ),
        (
            "workload",
            f"{w.get('requests', '?')} requests, {w.get('arrival', '?')} arrivals at {w.get('rate_per_s', '?')}/s, {w.get('prompt', '?')} prompts (~{w.get('prompt_tokens', '?')} tokens), seed {w.get('seed', '?')}",
        ),
    ]
    if t.get("room_timeout_s") is not None:
        rows.append(("room timeout", f"{t['room_timeout_s']} s"))
    return rows


def _unique_labels(runs: list[Run]) -> None:
    seen: dict[str, int] = {}
    for run in runs:
        base = run.path.name or str(run.path)
        seen[base] = seen.get(base, 0) + 1
        run.label = base if seen[base] == 1 else f"{base} ({seen[base]})"


def _run_section(i: int, run: Run, max_rooms: int, figure: _Figures) -> str:
    out = [f'<section id="run-{i}">']
    out.append(f"<h2>Run {i}: {_e(run.name)}</h2>")
    hw = f" &middot; backend {_e(run.backend)} on {_e(run.device)}" if run.mode == "hw" else ""
    out.append(
        f'<p class="meta">scenario <b>{_e(run.scenario_name)}</b> &middot; mode <b>{_e(run.mode)}</b>'
        f" &middot; {_e(run.transfer_path)} path{hw} &middot; {len(run.records):,} trace rows"
        f" &middot; <code>{_e(run.path)}</code></p>"
    )
    out += [
        _warning(w)
        for w in loaded_warnings([(f"Run {i}", run.mode, run.summary.get("conditions"))])
    ]
    out.append('<div class="cols"><div><h3>Summary</h3>')
    out.append(_table(_summary_rows(run), header=("metric", "value"), num_cols=(1,)))
    out.append("</div><div><h3>Scenario</h3>")
    out.append(_table(_scenario_rows(run), header=("field", "value")))
    out.append("</div></div>")
    out.append(
        figure(
            figures.gantt(run, max_rooms=max_rooms),
            f"run{i}-timeline",
            f"Gantt timeline of {run.name}",
            "Chunk phases per rank. Prefill lanes: compute (grey, top), gather / write (middle), waiting for the "
            "watermark (bottom, yellow). Decode lanes: chunk_ready (orange) and scatter (green). rN marks the room "
            "of a wide enough bar; microsecond spans show as thin lines.",
        )
    )
    out.append(
        figure(
            figures.ring_occupancy(run),
            f"run{i}-ring",
            f"Staging ring of {run.name}",
            "Per decode rank, on one scale for every rank: live bytes (blue, filled: written by a writer and not yet "
            "freed; never above the pool), reservations (orange: regions handed out and not yet freed; a region of "
            "the next round may be handed out over live bytes, so this may exceed the pool), the pool (dashed), and "
            "the watermark (vermillion, right axis) in ring rounds: round + tail / pool.",
        )
    )
    out.append("</section>")
    return "".join(out)


def _err_rows(name: str, m: dict) -> list[tuple]:
    rows = []
    for q in ("p50", "p99", "mean"):
        e = m.get(q) or {}
        rows.append(
            (f"{name} {q}", ms(e.get("a")), ms(e.get("b")), ms(e.get("diff_s")), pct(e.get("rel")))
        )
    unit = "chunks" if name.startswith("chunk") else "rooms"
    rows.append(
        (
            f"{name} MAPE / bias over {m.get('count', 0)} {unit}",
            "",
            "",
            "",
            f"{pct(m.get('mape')).lstrip('+')} / {pct(m.get('bias'))}",
        )
    )
    return rows


def _room_matching(result: dict) -> list[str]:
    """The compare section's room-matching table and the rooms found in one run only."""
    out: list[str] = []
    r = result["rooms"]
    room_rows = [
        ("rooms matched (completed in both)", r["matched"]),
        ("rooms only in A", r["only_in_a"]),
        ("rooms only in B", r["only_in_b"]),
        ("completed only in A", r["completed_only_in_a"]),
        ("completed only in B", r["completed_only_in_b"]),
        (
            "chunks only in A / only in B",
            f"{result['chunk_latency'].get('only_in_a', 0)} / {result['chunk_latency'].get('only_in_b', 0)}",
        ),
    ]
    out.append(_table(room_rows, header=("room matching", "count"), num_cols=(1,)))
    for key, label in (("only_in_a_rooms", "only in A"), ("only_in_b_rooms", "only in B")):
        if r.get(key):
            out.append(
                f'<p class="note">rooms {label}: {_e(", ".join(map(str, r[key][:40])))}'
                f"{' ...' if len(r[key]) > 40 else ''}</p>"
            )
    return out


def _client_table(client: dict | None) -> str:
    """The client figures of B against A (kvstage/analysis/client_compare.py)."""
    if not client or not client["figures"]:
        return ""
    from kvstage.analysis.client_compare import LABELS

    rows = [
        (f"{LABELS[r['metric']]} {r['quantile']}", ms(r["a"]), ms(r["b"]), pct(r["error"]))
        for r in client["figures"]
    ]
    rows += [
        (
            r["metric"].replace("_", " "),
            "-" if r["a"] is None else f"{r['a']:,.3f}",
            "-" if r["b"] is None else f"{r['b']:,.3f}",
            pct(r["error"]),
        )
        for r in client["throughput"]
    ]
    return f'<p class="meta">client figures, over {_e(client["basis"])}</p>' + _table(
        rows, header=("figure", "A", "B", "(B - A) / A"), num_cols=(1, 2, 3)
    )


def _compare_section(k: int, result: dict, figure: _Figures) -> str:
    a, b = result["a"], result["b"]
    out = [f'<section id="compare-{k}">']
    out.append(f"<h3>A = {_e(a['name'])} &nbsp;vs&nbsp; B = {_e(b['name'])}</h3>")
    out.append(
        f'<p class="meta">A: {_e(a["scenario"])} / {_e(a["mode"])} / {_e(a["transfer_path"])} &middot; '
        f"B: {_e(b['scenario'])} / {_e(b['mode'])} / {_e(b['transfer_path'])}</p>"
    )
    mape = result["transfer_latency"].get("mape")
    ok = mape is not None and math.isfinite(mape) and mape <= result.get("tolerance", 0.15)
    if "measured" in (a["mode"], b["mode"]):
        ok = result["verdict"].startswith("B matches")
    out.append(f'<div class="verdict{"" if ok else " off"}">{_e(result["verdict"])}</div>')
    out += [_warning(w) for w in result.get("warnings") or []]
    if result.get("scenario_diff_note"):
        out.append(f'<p class="meta">{_e(result["scenario_diff_note"])}</p>')
    diff = result.get("scenario_diff") or []
    if diff:
        out.append(
            '<p class="note">The resolved scenarios differ (names, hardware and fault settings '
            "left out); the comparison may not be like for like:</p>"
        )
        out.append(
            _table([(d["field"], d["a"], d["b"]) for d in diff[:20]], header=("field", "A", "B"))
        )
        if len(diff) > 20:
            out.append(f'<p class="note">... and {len(diff) - 20} more</p>')
    rows = []
    rows += _err_rows("transfer latency", result["transfer_latency"])
    rows += _err_rows("TTFT", result["ttft"])
    rows += _err_rows("chunk latency", result["chunk_latency"])
    out.append(
        _table(rows, header=("metric", "A", "B", "B - A", "(B - A) / A"), num_cols=(1, 2, 3, 4))
    )
    out.append(_client_table(result.get("client")))
    out.append('<div class="cols"><div>')
    out += _room_matching(result)
    out.append("</div><div>")
    ph_rows = []
    for p in PHASE_KEYS:
        ph = result["phases"][p]
        if not ph["a"]["count"] and not ph["b"]["count"]:
            continue
        ph_rows.append(
            (
                ph["label"],
                fixed(ph["a"]["total_s"], " s", 4),
                fixed(ph["b"]["total_s"], " s", 4),
                ms(ph["a"]["mean_s"]),
                ms(ph["b"]["mean_s"]),
            )
        )
    out.append(
        _table(
            ph_rows,
            header=("phase", "A total", "B total", "A mean / chunk", "B mean / chunk"),
            num_cols=(1, 2, 3, 4),
        )
    )
    out.append("</div></div>")
    out.append(
        figure(
            figures.comparison_scatter(result),
            f"compare{k}-scatter",
            f"{b['name']} against {a['name']}",
            "Each point is one room (or one chunk at one decode rank) present in both runs; the dashed line is "
            "y = x, the grey band the tolerance around it. Points above the line: B slower.",
        )
    )
    out.append("</section>")
    return "".join(out)


def _cdf_values(runs: list[Run]) -> str:
    """The p50 / p99 the CDF figure marks, as numbers (percentiles as in summary.json)."""
    rows = []
    for run in runs:
        rm = room_metrics(run.records).values()
        tr = percentiles([m["transfer"] for m in rm if "transfer" in m])
        tt = percentiles([m["ttft"] for m in rm if "ttft" in m])
        rows.append(
            (run.name, ms(tr["p50"]), ms(tr["p99"]), ms(tt["p50"]), ms(tt["p99"]), tr["count"])
        )
    return _table(
        rows,
        header=(
            "run",
            "transfer latency p50",
            "transfer latency p99",
            "TTFT p50",
            "TTFT p99",
            "rooms",
        ),
        num_cols=(1, 2, 3, 4, 5),
    )


def _across_runs(runs: list[Run], figure: _Figures) -> str:
    body = ['<section id="all-runs"><h2>Latency and phases across runs</h2>']
    body.append(
        figure(
            figures.latency_cdfs(runs),
            "latency-cdf",
            "latency CDFs",
            "Empirical CDFs over completed rooms, one curve per run; dotted lines at 0.5 and 0.99, "
            "circles where each run crosses them (its p50 and p99, in the legend and the table below).",
        )
    )
    body.append(_cdf_values(runs))
    if any(r.mode == "measured" or (r.summary.get("tpot_s") or {}).get("count") for r in runs):
        body.append(
            figure(
                figures.client_cdfs(runs),
                "client-cdf",
                "client figures",
                "TTFT, TPOT and ITL as the benchmark clients define them (docs/metrics.md), one curve per "
                "run over its finished requests (ITL: every gap); a run with only reported figures "
                "(an aggregate file) shows its p50 / p90 / p99 as points.",
            )
        )  # only where generation is modeled or measured
    body.append(
        figure(
            figures.phase_bars(runs),
            "phases",
            "phase breakdown",
            "Time per phase summed over every chunk at every rank, and its mean per chunk and rank. Control: the "
            "STAGING_REQ -> STAGING_RSP gap per prefill rank and chunk, and the wait from a chunk's last write to "
            "its chunk_ready at the decode.",
        )
    )
    if len({r.transfer_path for r in runs}) > 1:
        body.append(
            figure(
                figures.staging_vs_slice(runs),
                "staging-vs-slice",
                "staging vs slice",
                "TTFT (arrival -> first token at the client), the exposed KV transfer inside it (last forward end -> "
                "decode ready: what the transfer adds to TTFT) and transfer requests per request, by "
                "transfer path.",
            )
        )
    body.append("</section>")
    return "".join(body)


def _plan_section(i: int, plan_dir: Path, figure: _Figures) -> str:
    """A `kvstage plan` directory: its verdict, Pareto front (table and figure) and search."""
    from kvstage.explore.figures import front_figure, load_plan, shape

    plan = load_plan(plan_dir)
    q = plan.get("quantile", "p90")
    rows = [
        (
            shape(r),
            r["gpus"],
            f"{r['slo_attainment']:.0%}",
            f"{r['goodput_per_gpu_rps']:.3g}",
            ms(r[f"ttft_s.{q}"]),
            ms(r[f"tpot_s.{q}"]),
            ms(r.get(f"itl_s.{q}")),
            r["bottleneck"] or "-",
            "winner" if r["winner"] else ("meets" if r["meets"] else "misses"),
        )
        for r in plan["front"]
    ]
    counts = ", ".join(f"{n} {k}" for k, n in plan["counts"].items())
    return "".join(
        [
            f'<section id="plan-{i}"><h2>Plan {i}: {_e(plan.get("scenario_name", plan_dir.name))}</h2>',
            f'<p class="meta">{_e(plan_dir)} &middot; SLO {_e(plan["slo"])} for at least {plan["attainment"]:.0%} of '
            f"requests &middot; configurations: {_e(counts)}</p>",
            f"<p><b>{_e(plan['verdict'])}</b></p>",
            *(f"<p>warning: {_e(w)}</p>" for w in plan.get("warnings", [])),
            _table(
                rows,
                header=(
                    "configuration",
                    "GPUs",
                    "attainment",
                    "goodput/GPU (req/s)",
                    f"TTFT {q}",
                    f"TPOT {q}",
                    f"ITL {q}",
                    "bottleneck",
                    "",
                ),
                num_cols=(1, 2, 3, 4, 5, 6),
            ),
            figure(
                front_figure(plan),
                f"plan-front-{i}",
                "plan front",
                "Throughput per GPU against tokens/s per user and against TTFT of every simulated "
                "configuration (steady window); ringed: the Pareto front, star: the winner (fewest GPUs "
                "that meets the SLO), dashed: the SLO targets.",
            ),
            "</section>",
        ]
    )


def _header(runs: list[Run], title: str, plans: Sequence[Path] = ()) -> str:
    body = [f"<header><h1>{_e(title)}</h1>"]
    body.append(
        f'<p class="meta">{len(runs)} run(s) &middot; generated {_e(time.strftime("%Y-%m-%d %H:%M:%S"))} by '
        "<code>kvstage report</code> from each run's trace, summary.json and scenario.toml</p>"
    )
    body += [
        _warning(w)
        for w in loaded_warnings(
            [
                (f"Run {i} ({r.name})", r.mode, r.summary.get("conditions"))
                for i, r in enumerate(runs, 1)
            ]
        )
    ]
    nav = [
        f'<li><a href="#run-{i}">Run {i}: {_e(r.name)}</a> ({_e(r.describe())})</li>'
        for i, r in enumerate(runs, 1)
    ]
    if runs:
        nav.append('<li><a href="#all-runs">Latency and phases across runs</a></li>')
    nav += [
        f'<li><a href="#plan-{i}">Plan {i}: {_e(Path(p).name)}</a></li>'
        for i, p in enumerate(plans, 1)
    ]
    if len(runs) > 1:
        nav.append('<li><a href="#comparison">Comparison (first run vs each other run)</a></li>')
    body.append("<nav><ul>" + "".join(nav) + "</ul></nav></header>")
    return "".join(body)


def write_report(
    run_dirs: Sequence[Path | Run],
    out: Path,
    *,
    max_rooms: int = 8,
    title: str | None = None,
    png_dir: Path | None = None,
    plans: Sequence[Path] = (),
) -> tuple[Path, list[Path]]:
    """Write one self-contained HTML report of `run_dirs` to `out` and, with `png_dir`,
    each of its figures as a PNG file there; returns (out, the PNG files).
    With several runs the first is the reference A, compared with each other run.
    `plans`: `kvstage plan` directories, each a section with its Pareto front."""
    if not run_dirs and not plans:
        raise ValueError("build_report needs at least one run directory")
    runs = [load_run(p) for p in run_dirs]
    _unique_labels(runs)
    out = Path(out)
    title = title or (
        "kvstage report: " + ", ".join([r.name for r in runs] + [Path(p).name for p in plans])
    )
    figure = _Figures(png_dir)
    body = [_header(runs, title, plans)]
    body += [_run_section(i, run, max_rooms, figure) for i, run in enumerate(runs, 1)]
    if runs:
        body.append(_across_runs(runs, figure))
    body += [_plan_section(i, Path(p), figure) for i, p in enumerate(plans, 1)]
    if len(runs) > 1:
        body.append('<section id="comparison"><h2>Comparison</h2>')
        body.append(
            f'<p class="meta">A is {_e(runs[0].name)}, the reference; B is each other run. Errors are '
            "B relative to A over rooms (and chunks) present and completed in both.</p>"
        )
        for k, other in enumerate(runs[1:], 1):
            body.append(_compare_section(k, compare_runs(runs[0], other), figure))
        body.append("</section>")

    page = (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; img-src data:; '
        "style-src 'unsafe-inline'\">"
        f"<title>{_e(title)}</title><style>{_CSS}</style></head>\n<body><main>\n"
        + "\n".join(body)
        + "\n</main></body></html>\n"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    return out, figure.written


def build_report(
    run_dirs: Sequence[Path | Run], out: Path, *, max_rooms: int = 8, title: str | None = None
) -> Path:
    """Write one self-contained HTML report of `run_dirs` to `out`; returns `out`."""
    return write_report(run_dirs, out, max_rooms=max_rooms, title=title)[0]
