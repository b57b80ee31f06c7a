"""`kvstage compare`, `kvstage report`, `kvstage export-trace`: look at finished runs.

All three read only run directories (trace, summary.json, scenario.toml), so they
work the same on simulation and hardware runs. A path that is not a run directory
gets one error line and exit status 2.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvstage.cli.errors import fail as _fail
from kvstage.cli.errors import warn
from kvstage.fmt import ms, pct
from kvstage.tables import print_table

console = Console()

RunArg = Annotated[
    Path,
    typer.Argument(
        help="Run directory (or its trace file), as written by `kvstage sim` / `kvstage hw`."
    ),
]


def _load(path: Path):
    from kvstage.run.rundir import RunError, load_run

    try:
        return load_run(path)
    except RunError as exc:
        _fail(str(exc))


def _print_compare(result: dict) -> None:
    from kvstage.analysis.compare import PHASE_KEYS

    a, b = result["a"], result["b"]
    for tag, run in (("A", a), ("B", b)):
        console.print(
            f"{tag} = [bold]{escape(run['name'])}[/] "
            + escape(f"({run['scenario']}, {run['mode']}, {run['transfer_path']})  {run['path']}"),
            highlight=False,
        )
    t = Table(title="B relative to A")
    for col in ("metric", "A", "B", "B - A", "(B - A) / A"):
        t.add_column(col, justify="left" if col == "metric" else "right")
    for key, name in (
        ("transfer_latency", "transfer latency"),
        ("ttft", "TTFT"),
        ("chunk_latency", "chunk latency"),
    ):
        m = result[key]
        for q in ("p50", "p99", "mean"):
            e = m[q]
            t.add_row(f"{name} {q}", ms(e["a"]), ms(e["b"]), ms(e["diff_s"]), pct(e["rel"]))
        mape = m["mape"]
        t.add_row(
            f"{name} MAPE / bias (n={m['count']})",
            "",
            "",
            "",
            f"{'-' if not math.isfinite(mape) else f'{mape:.1%}'} / {pct(m['bias'])}",
            end_section=True,
        )
    print_table(console, t)
    _print_client(result["client"])
    ph = Table(title="phase breakdown (total over all chunks and ranks; mean per chunk and rank)")
    for col in ("phase", "A total", "B total", "A mean", "B mean"):
        ph.add_column(col, justify="left" if col == "phase" else "right")
    for k in PHASE_KEYS:
        p = result["phases"][k]
        if not p["a"]["count"] and not p["b"]["count"]:
            continue
        ph.add_row(
            p["label"],
            f"{p['a']['total_s']:,.4f} s",
            f"{p['b']['total_s']:,.4f} s",
            ms(p["a"]["mean_s"]),
            ms(p["b"]["mean_s"]),
        )
    print_table(console, ph)
    r = result["rooms"]
    console.print(
        f"rooms matched: {r['matched']}; only in A: {r['only_in_a']}; only in B: {r['only_in_b']}; "
        f"completed only in A: {r['completed_only_in_a']}; completed only in B: {r['completed_only_in_b']}",
        highlight=False,
    )
    _print_conditions(result)
    mape = result["transfer_latency"]["mape"]
    ok = mape is not None and math.isfinite(mape) and mape <= result["tolerance"]
    if "measured" in (a["mode"], b["mode"]):
        ok = result["verdict"].startswith("B matches")
    console.print(
        f"[bold {'green' if ok else 'yellow'}]verdict:[/] {escape(result['verdict'])}",
        highlight=False,
    )


def _print_client(client: dict) -> None:
    """The client figures of B against A (kvstage/analysis/client_compare.py)."""
    if not client["figures"] and not client["throughput"]:
        return
    from kvstage.analysis.client_compare import LABELS

    t = Table(title=f"client figures, over {client['basis']}")
    for col in ("figure", "A", "B", "(B - A) / A"):
        t.add_column(col, justify="left" if col == "figure" else "right")
    for r in client["figures"]:
        t.add_row(f"{LABELS[r['metric']]} {r['quantile']}", ms(r["a"]), ms(r["b"]), pct(r["error"]))
    for r in client["throughput"]:
        fmt = lambda v: "-" if v is None else f"{v:,.3f}"  # noqa: E731
        t.add_row(r["metric"].replace("_", " "), fmt(r["a"]), fmt(r["b"]), pct(r["error"]))
    print_table(console, t)


def _print_conditions(result: dict) -> None:
    """The scenario fields that differ (those that matter to the modes compared), the
    conditions of the hosts of hardware runs, and a warning per run taken on a loaded
    host."""
    from kvstage.run.conditions import describe

    diff = result.get("scenario_diff") or []
    if diff:
        t = Table(title="scenario fields that differ")
        for col in ("field", "A", "B"):
            t.add_column(col)
        for d in diff[:12]:
            t.add_row(escape(d["field"]), escape(str(d["a"])), escape(str(d["b"])))
        print_table(console, t)
        if len(diff) > 12:
            console.print(f"... and {len(diff) - 12} more", highlight=False, markup=False)
    if result.get("scenario_diff_note"):
        console.print(result["scenario_diff_note"], highlight=False, markup=False)
    cond = result.get("conditions") or {}
    for tag in ("a", "b"):
        if result[tag]["mode"] == "sim":
            continue  # simulated times do not depend on the host: its load stays in summary.json
        console.print(
            f"host of {tag.upper()}: {describe(cond.get(tag))}", highlight=False, markup=False
        )
    for w in result.get("warnings") or []:
        warn(w)


def compare(
    run_a: Annotated[Path, typer.Argument(help="Run A, the reference (e.g. the hardware run).")],
    run_b: Annotated[Path, typer.Argument(help="Run B, measured against A (e.g. the simulation).")],
    json_out: Annotated[
        Path | None,
        typer.Option("--json", help="Also write the full comparison as JSON to this file."),
    ] = None,
    plots: Annotated[
        Path | None,
        typer.Option("--plots", help="Also write the comparison figures (PNG) into this folder."),
    ] = None,
    tolerance: Annotated[
        float, typer.Option(help="MAPE under which the verdict says B matches A.")
    ] = 0.15,
) -> None:
    """Compare run B with run A, room by room and chunk by chunk.

    Per-request transfer latency and TTFT are matched by room, chunk latency by
    (room, chunk, decode rank). Prints p50 / p99 / mean of both with the difference
    and relative difference, MAPE and signed bias (mean relative error, positive:
    B slower), a per-phase breakdown (watermark wait, gather, write, scatter,
    control-message gaps), how many rooms only one run has, and a verdict line.
    """
    from kvstage.analysis.compare import compare_runs, to_json

    a, b = _load(run_a), _load(run_b)
    if not (0 < tolerance < 10):
        _fail(f"--tolerance {tolerance} not allowed (a fraction, e.g. 0.15 for 15%)")
    result = compare_runs(a, b, tolerance=tolerance)
    _print_compare(result)
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(to_json(result))
        console.print(f"comparison JSON: {json_out}", highlight=False, markup=False)
    if plots is not None:
        from kvstage.analysis import figures as figs

        plots.mkdir(parents=True, exist_ok=True)
        written = []
        items = [
            ("compare_scatter.png", figs.comparison_scatter(result)),
            ("latency_cdf.png", figs.latency_cdfs([a, b])),
            ("phases.png", figs.phase_bars([a, b])),
        ]
        if a.transfer_path != b.transfer_path:
            items.append(("staging_vs_slice.png", figs.staging_vs_slice([a, b])))
        for name, fig in items:
            fig.savefig(plots / name, dpi=100)
            written.append(name)
        console.print(f"figures in {plots}: {', '.join(written)}", highlight=False, markup=False)


def report(
    runs: Annotated[
        list[Path],
        typer.Argument(
            help="One or more run directories; the first is the reference for comparisons. A `kvstage plan` directory adds its Pareto front."
        ),
    ],
    out: Annotated[Path, typer.Option(help="HTML file to write.")] = Path("report.html"),
    max_rooms: Annotated[
        int, typer.Option(help="Rooms shown in each run's timeline (the first N).")
    ] = 8,
    png: Annotated[
        Path | None,
        typer.Option(
            "--png",
            help="Also write every figure of the report as a PNG file into this folder (for a terminal that cannot open HTML).",
        ),
    ] = None,
) -> None:
    """Write ONE self-contained HTML report of the runs: per run its scenario and
    summary numbers, a per-rank timeline of chunk phases and the staging ring (live
    bytes, reservations, watermark); across runs latency CDFs with their p50 / p99, a
    phase breakdown and (when the paths differ) staging vs slice; with several runs a
    comparison of the first with each other. Warns of runs taken on a loaded host.
    Figures are embedded PNGs; no script, no external URL: it opens from disk."""
    from kvstage.analysis.report import write_report
    from kvstage.run.conditions import loaded_warnings

    if max_rooms < 1:
        _fail(f"--max-rooms {max_rooms} not allowed (at least 1)")
    from kvstage.explore.figures import is_plan_dir

    plans = [p for p in runs if is_plan_dir(p)]
    loaded = [_load(p) for p in runs if not is_plan_dir(p)]
    for w in loaded_warnings([(r.path.name, r.mode, r.summary.get("conditions")) for r in loaded]):
        warn(w)
    path, pngs = write_report(loaded, out, max_rooms=max_rooms, png_dir=png, plans=plans)
    console.print(
        f"report: {path} ({path.stat().st_size / 1024:,.0f} KiB)",
        highlight=False,
        markup=False,
        soft_wrap=True,
    )
    if png is not None:
        console.print(
            f"figures (PNG) in {png}: {', '.join(p.name for p in pngs)}",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )


def export_trace(
    run: RunArg,
    chrome: Annotated[
        bool, typer.Option("--chrome", help="Chrome / Perfetto JSON (the only format so far).")
    ] = False,
    out: Annotated[
        Path | None,
        typer.Option(help="Output file (default: trace.chrome.json in the run directory)."),
    ] = None,
) -> None:
    """Export a run's trace for a trace viewer. With --chrome: Chrome / Perfetto JSON,
    one event per trace row (spans as complete events, instants as instant events, in
    microseconds), a process per role and threads per rank; open it in
    ui.perfetto.dev or chrome://tracing."""
    from kvstage.analysis.chrome_trace import export_chrome

    if not chrome:
        _fail("choose an export format: --chrome (Chrome / Perfetto JSON)")
    loaded = _load(run)
    path = export_chrome(loaded, out)
    console.print(
        f"Chrome trace: {path} ({len(loaded.records):,} events)", highlight=False, markup=False
    )


def register(app: typer.Typer) -> None:
    app.command("compare")(compare)
    app.command("report")(report)
    app.command("export-trace")(export_trace)
