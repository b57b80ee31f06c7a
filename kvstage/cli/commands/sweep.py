"""`kvstage sweep`: simulate the cross product of varied scenario fields, in parallel.

The work is in `kvstage.explore.sweep`, `kvstage.explore.sweep_target` and `kvstage.analysis.figures` (imported
when the command runs, so `kvstage --help` stays fast); this module is the command
line: options, progress bar, tables, files.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvstage.cli.errors import fail as _fail
from kvstage.cli.options import ProgressOpt, RayOpt, SetOpt, WorkersOpt
from kvstage.tables import print_table

console = Console()

_MAX_PRINTED_ROWS = 60


def _default_out(stem: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = Path("runs") / f"{stem}-sweep-{stamp}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def _key_header(key: str) -> str:
    return key.replace(".", ".\n")


_SHORT = {
    "requests_failed": "failed",
    "ttft_s.p99": "TTFT p99",
    "watermark_stall_s.total": "stall total",
}


def _results_table(
    result: Any, metric: str, target_metric: str | None = None
) -> tuple[Table, list[str]]:
    """The rows as a table, and the distinct reasons (footnotes [1], [2], ...)."""
    from kvstage.explore.sweep import STATUS_OK, format_metric, metric_display

    t = Table(title=f"sweep: {len(result.rows)} points", title_justify="left")
    for v in result.varies:
        t.add_column(_key_header(v.key), justify="right", overflow="fold")
    t.add_column("status")
    # The metric, the target's, TTFT and stall; failed requests only if there were any
    # (the table must stay readable in 80 columns; sweep.csv has everything).
    shown = list(dict.fromkeys(m for m in (metric, target_metric, *_SHORT) if m))
    if not any(r["requests_failed"] for r in result.rows):
        shown = [m for m in shown if m != "requests_failed" or m in (metric, target_metric)]
    units = {}
    for m in shown:
        scale, unit, label = metric_display(m, [r[m] for r in result.rows])
        units[m] = scale
        head = _SHORT.get(m, label) if m != metric else label
        t.add_column(head + (f" ({unit})" if unit else ""), justify="right", max_width=10)
    reasons: list[str] = []
    for row in result.rows[:_MAX_PRINTED_ROWS]:
        ok = row["status"] == STATUS_OK
        cells = [str(row[v.key]) for v in result.varies]
        status = row["status"] if ok else f"[yellow]{row['status']}[/]"
        if row["reason"]:
            if row["reason"] not in reasons:
                reasons.append(row["reason"])
            status += f" [{reasons.index(row['reason']) + 1}]"
        cells.append(status)
        for m in shown:
            cells.append(format_metric(m, row[m], (units[m], "")) if ok else "-")
        t.add_row(*cells)
    return t, reasons


def _target_table(result: Any, report: dict) -> Table:
    from kvstage.explore.sweep import format_metric, metric_display

    scale, unit, _ = metric_display(report["metric"], [r[report["metric"]] for r in result.rows])

    first = result.varies[0].key
    t = Table(
        title=f"target {report['target']}: smallest {first} that meets it", title_justify="left"
    )
    for v in result.varies[1:]:
        t.add_column(_key_header(v.key), justify="right", overflow="fold")
    t.add_column(f"smallest {_key_header(first)}", justify="right", overflow="fold")
    t.add_column(f"{report['metric']} there" + (f" ({unit})" if unit else ""), justify="right")
    for a in report["answers"]:
        cells = [str(val) for val in a["settings"].values()]
        if a["meets"]:
            cells += [
                str(a["smallest"]),
                format_metric(report["metric"], a["metric_value"], (scale, "")),
            ]
        else:
            cells += ["[yellow]none meets it[/]", "-"]
        t.add_row(*cells)
    return t


def _write_files(
    result: Any,
    out_dir: Path,
    metric: str,
    tgt: Any,
    report: dict | None,
    plots: bool,
    sets: list[str],
    scenario: Path,
) -> dict[str, Path]:
    from kvstage.explore.figures import plot_sweep
    from kvstage.explore.sweep import STATUS_ERROR, STATUS_INVALID, write_json, write_tables

    files = write_tables(result, out_dir)
    if report is not None:
        files["target"] = write_json(out_dir / "target.json", report)
    meta = {
        "scenario": str(scenario),
        "vary": {v.key: list(v.values) for v in result.varies},
        "set": sets,
        "metric": metric,
        "target": tgt.text if tgt else None,
        "backend": result.backend,
        "points": len(result.rows),
        "invalid": result.count(STATUS_INVALID),
        "errors": result.count(STATUS_ERROR),
        "invariant_violations": len(result.violated),
        "wall_s": result.wall_s,
    }
    files["meta"] = write_json(out_dir / "sweep.json", meta)
    if plots:
        for i, path in enumerate(plot_sweep(result, metric, out_dir, tgt)):
            files[f"plot{i}"] = path
    return files


def sweep(
    scenario: Annotated[Path, typer.Argument(help="Scenario TOML file (see scenarios/README.md).")],
    vary: Annotated[
        list[str] | None,
        typer.Option(
            "--vary",
            metavar="KEY=V1,V2,...",
            help=(
                "A scenario field and the values to sweep, each parsed like a --set value "
                "(repeatable: the cross product is simulated; the first --vary is the one "
                "--target minimises)."
            ),
        ),
    ] = None,
    set_: SetOpt = None,
    workers: WorkersOpt = None,
    ray: RayOpt = None,
    target: Annotated[
        str | None,
        typer.Option(
            metavar="METRIC<VALUE",
            help="Report, per setting of the other keys, the smallest value of the first --vary key that meets it (<, <=, >, >=), e.g. 'transfer_latency_s.p99<0.5'.",
        ),
    ] = None,
    metric: Annotated[
        str,
        typer.Option(
            help="Metric of the plots and the first table column: a metric column of sweep.csv, e.g. ttft_s.p99, watermark_stall_s.total, throughput_gbps."
        ),
    ] = "transfer_latency_s.p99",
    out: Annotated[
        Path | None, typer.Option(help="Output directory (default runs/SCENARIO-sweep-TIME/).")
    ] = None,
    keep_traces: Annotated[
        bool,
        typer.Option(
            help="Also write each point's run directory (trace, scenario, summary) to OUT/points/."
        ),
    ] = False,
    plots: Annotated[bool, typer.Option(help="Write the PNG plots.")] = True,
    progress: ProgressOpt = True,
) -> None:
    """Simulate every combination of the --vary values (on top of the scenario and its
    --set overrides) in parallel, and write one row per point -- the varied keys, the
    run's summary metrics -- to sweep.csv and sweep.parquet, with plots (a heatmap for two
    varied keys, lines against the first key) and, with --target, the smallest value of
    the first key that meets the target, per setting of the others (target.json).

    A combination the scenario rejects (e.g. a staging pool smaller than one chunk) is an
    "invalid" row with the reason; a value that is wrong on its own, an unknown key or
    metric, or a malformed --target exits 2. Exits 1 if a point broke an invariant or
    its simulation failed."""
    sets = list(set_ or [])
    tgt, varies, points = _plan(scenario, vary, sets, metric, target, workers, ray)
    out_dir = out if out is not None else _default_out(scenario.stem)
    _print_plan(scenario, points, varies, workers, ray)
    keep_dir = (out_dir / "points") if keep_traces else None
    result = _run(scenario, varies, points, workers, ray, keep_dir, progress)
    report = _answer_target(result, tgt)
    try:
        files = _write_files(result, out_dir, metric, tgt, report, plots, sets, scenario)
    except OSError as exc:
        _fail(f"cannot write the results to {out_dir}: {exc}")
    _print_results(result, metric, tgt, report, files, out_dir)
    raise typer.Exit(_exit_code(result))


def _plan(
    scenario: Path,
    vary: list[str] | None,
    sets: list[str],
    metric: str,
    target: str | None,
    workers: int | None,
    ray: str | None,
) -> tuple[Any, list[Any], list[Any]]:
    """Check the options and plan the points: (target or None, varies, points); a bad
    option is one error line and exit 2."""
    from kvstage.explore.executor import ExploreError, require_ray
    from kvstage.explore.sweep import SweepError, check_metric, parse_vary, plan_points
    from kvstage.explore.sweep_target import parse_target

    if not scenario.is_file():
        _fail(f"scenario file not found: {scenario}")
    try:
        if not vary:
            raise SweepError("nothing to sweep: give at least one --vary KEY=V1,V2,...")
        check_metric(metric)
        tgt = parse_target(target) if target is not None else None
        varies = [parse_vary(v) for v in vary]
        if workers is not None and workers < 1:
            raise SweepError(f"--workers {workers}: must be at least 1")
        if ray is not None:
            require_ray()
        points = plan_points(scenario, varies, sets)
    except ExploreError as exc:  # SweepError, --ray
        _fail(str(exc))
    return tgt, varies, points


def _print_plan(
    scenario: Path, points: list[Any], varies: list[Any], workers: int | None, ray: str | None
) -> None:
    invalid = sum(1 for p in points if p.scenario is None)
    shape = " x ".join(str(len(v.values)) for v in varies)
    where = f"Ray ({ray})" if ray else f"up to {workers or os.cpu_count()} local processes"
    console.print(
        f"sweep [bold]{escape(str(scenario))}[/]: {len(points)} points ({shape}), {invalid} invalid; "
        f"running on {where}",
        highlight=False,
    )


def _progress_bar(progress: bool) -> Any:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn("[bold]sweeping[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=console,
        disable=not progress,
        transient=True,
    )


def _log_line(text: str) -> None:
    console.print(escape(text), highlight=False, soft_wrap=True)


def _run(
    scenario: Path,
    varies: list[Any],
    points: list[Any],
    workers: int | None,
    ray: str | None,
    keep_dir: Path | None,
    progress: bool,
) -> Any:
    """Simulate the points under a progress bar; a failed sweep is one error line and exit 2."""
    from kvstage.explore.executor import ExploreError
    from kvstage.explore.progress import ProgressLog
    from kvstage.explore.sweep import run_sweep

    # off a terminal, a bar prints nothing useful: lines per quarter or minute instead
    terminal = console.is_terminal
    bar = _progress_bar(progress and terminal)
    task = None
    log: ProgressLog | None = None

    def on_start(n: int) -> None:
        nonlocal task, log
        task = bar.add_task("points", total=n)
        if progress and not terminal:
            log = ProgressLog(n, n, _log_line, what="sweeping")

    def on_point(_index: int, _row: dict) -> None:
        bar.advance(task)
        if log is not None:
            log.advance(1)

    try:
        with bar:
            return run_sweep(
                scenario,
                varies,
                workers=workers,
                ray_address=ray,
                keep_traces_dir=keep_dir,
                on_start=on_start,
                on_point=on_point,
                points=points,
            )
    except ExploreError as exc:  # SweepError, --ray
        _fail(str(exc))


def _answer_target(result: Any, tgt: Any) -> dict | None:
    """The --target answers (smallest first --vary value per setting of the others)."""
    if tgt is None:
        return None
    from kvstage.explore.sweep_target import target_report

    return target_report(result, tgt)


def _print_results(
    result: Any, metric: str, tgt: Any, report: dict | None, files: dict[str, Path], out_dir: Path
) -> None:
    table, reasons = _results_table(result, metric, tgt.metric if tgt else None)
    print_table(console, table)
    for n, reason in enumerate(reasons, 1):
        console.print(f"[{n}] {reason}", markup=False, highlight=False)
    if len(result.rows) > _MAX_PRINTED_ROWS:
        console.print(f"... {len(result.rows) - _MAX_PRINTED_ROWS} more rows in {files['csv']}")
    if report is not None:
        print_table(console, _target_table(result, report))
        for a in report["answers"]:
            if not a["meets"] and a.get("why"):
                where = ", ".join(f"{k}={v}" for k, v in a["settings"].items())
                console.print(
                    f"none meets it{' at ' + where if where else ''}: {a['why']}",
                    markup=False,
                    highlight=False,
                )
    console.print(
        f"{len(result.rows)} points in {result.wall_s:.1f} s on {result.backend}; "
        f"files in {out_dir}: {', '.join(p.name for p in files.values())}",
        highlight=False,
    )


def _exit_code(result: Any) -> int:
    """1 if a point failed to simulate or broke an invariant (each said in red), else 0."""
    from kvstage.explore.sweep import STATUS_ERROR

    code = 0
    if result.count(STATUS_ERROR):
        console.print(
            f"[bold red]{result.count(STATUS_ERROR)} point(s) failed to simulate[/] (status error)"
        )
        code = 1
    if result.violated:
        console.print(
            f"[bold red]{len(result.violated)} point(s) broke an invariant[/] (invariant_violations > 0)"
        )
        code = 1
    return code


def register(app: typer.Typer) -> None:
    app.command("sweep")(sweep)
