"""The `kvstage` command line."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from shared.scenario import Scenario, ScenarioError, load_scenario

app = typer.Typer(
    name="kvstage",
    help=(
        "Staged KV-cache transfer between prefill and decode with different TP sizes: "
        "validate scenarios, simulate them (SimPy), run them on real NIXL / Mooncake "
        "transfers, and check the protocol's invariants."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
err = Console(stderr=True)

ScenarioArg = Annotated[Path, typer.Argument(help="Scenario TOML file (see scenarios/README.md).")]
SetOpt = Annotated[
    Optional[list[str]],
    typer.Option(
        "--set",
        help="Override a scenario field, e.g. --set decode.staging_pool_mb=512 (repeatable).",
    ),
]


def _fail(message: str, code: int = 2) -> None:
    err.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(code)


def _load(path: Path, overrides: list[str] | None, seed: int | None = None) -> Scenario:
    sets = list(overrides or [])
    if seed is not None:
        sets.append(f"workload.seed={seed}")
    try:
        return load_scenario(path, overrides=sets)
    except ScenarioError as exc:
        _fail(str(exc))
    except FileNotFoundError as exc:
        _fail(f"scenario file not found: {exc.filename or path}")
    raise AssertionError("unreachable")


def _mib(n: float) -> str:
    return f"{n / (1 << 20):,.2f} MiB"


@app.command()
def validate(scenario: ScenarioArg, set_: SetOpt = None) -> None:
    """Print the resolved scenario and its derived layout: per decode rank its writers
    and head slices; bytes per token, chunk and request; how many chunks the staging
    pool holds; and the slice path's transfer requests against the staging path's."""
    from kvstage.layout_report import layout_report

    s = _load(scenario, set_)
    console.rule(f"scenario {s.name}")
    console.print(s.to_toml(), highlight=False, markup=False)
    console.rule("derived layout")
    layout_report(s, console)


@app.command()
def sim(
    scenario: ScenarioArg,
    set_: SetOpt = None,
    out: Annotated[Optional[Path], typer.Option(help="Run directory (default runs/<scenario>-sim-<time>/).")] = None,
    seed: Annotated[Optional[int], typer.Option(help="Workload seed (overrides workload.seed).")] = None,
    trace_format: Annotated[str, typer.Option(help="parquet or jsonl.")] = "parquet",
    scaled: Annotated[bool, typer.Option(help="Apply [hardware.scale_down] (to compare with a hw run).")] = False,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
) -> None:
    """Simulate the scenario's whole workload in simulated time (SimPy), through the
    same shared state machines the hardware mode runs. Writes trace, resolved scenario
    and summary.json to a run directory; exits 1 if an invariant was violated."""
    from kvstage.simrun import run_simulation

    if trace_format not in ("parquet", "jsonl"):
        _fail(f"--trace-format {trace_format!r} not allowed (allowed: parquet, jsonl)")
    s = _load(scenario, set_, seed)
    if scaled:
        s = s.scaled()
    code = run_simulation(s, out=out, trace_format=trace_format, progress=progress, console=console)
    raise typer.Exit(code)


@app.command()
def check(
    run: Annotated[Path, typer.Argument(help="Run directory or trace file.")],
) -> None:
    """Check a run's trace against the protocol invariants (safety, exactly once, no
    leak, liveness, monotone watermark); print each violation and exit 1 if any."""
    from kvstage.tracefile import read_records
    from shared.invariants import check_records

    try:
        mode, records = read_records(run)
    except FileNotFoundError as exc:
        _fail(str(exc))
    path = "slice" if any(r.phase == "slice_write" for r in records) and not any(
        r.phase == "write" for r in records
    ) else "staging"
    found = check_records(records, path)
    if not found:
        console.print(f"[green]ok[/]: {len(records)} records ({mode}), no invariant violated")
        return
    for v in found[:50]:
        console.print(v.format(), markup=False, highlight=False)
    console.print(f"[red]{len(found)} violation(s)[/]")
    raise typer.Exit(1)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
