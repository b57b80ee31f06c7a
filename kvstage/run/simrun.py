"""A simulated run: `simulate` gives its RunResult (kvstage/run/result.py); `kvstage sim`
(`run_simulation`) ends it with `finish_run`: run directory, summary table, exit code."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvstage.run import conditions
from kvstage.run.result import RunResult, finish_run
from kvstage.run.rundir import make_run_dir
from kvstage.run.summary import simulation_summary
from kvstage.shared.scenario import Scenario
from kvstage.shared.workload import trace_rows
from kvstage.sim.driver import SimResult, Stalled
from kvstage.sim.shard import simulate_scenario


def simulate(scenario: Scenario, progress: Callable[[int, int], None] | None = None) -> RunResult:
    """Simulate `scenario` (in independent groups where [cluster] shard asks, sim/shard.py);
    `progress(done, total)` as requests end. The summary holds how busy the host was
    meanwhile (kvstage/run/conditions.py). Writes and prints nothing."""
    before = conditions.sample()
    result = simulate_scenario(scenario, progress=progress)
    summary = simulation_summary(scenario, result)
    summary["conditions"] = conditions.measure(before)
    return run_result(scenario, result, summary)


def run_result(scenario: Scenario, result: SimResult, summary: dict) -> RunResult:
    """A simulation's RunResult, with its summary.json dict."""
    return RunResult(
        scenario,
        "sim",
        result.records,
        result.ranks,
        result.violations,
        errors=[],
        failures=result.failures,
        wall_s=result.wall_s,
        requests=len(result.requests),
        summary=summary,
        rejected=result.rejected,
    )


def run_simulation(
    scenario: Scenario,
    *,
    out: Path | None = None,
    trace_format: str = "parquet",
    progress: bool = True,
    console: Console | None = None,
) -> int:
    """`kvstage sim`: simulate `scenario` under a progress bar and end the run
    (`finish_run`): 0 if no invariant broke and the failed rooms are the ones the
    scenario's [expect] allows (none without one), else 1."""
    console = console or Console()
    rows = trace_rows(scenario)  # a trace without workload.requests replays every row
    total = rows[0] if rows else scenario.workload.requests or 0
    bar = Progress(
        TextColumn("[bold]simulating[/] {task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=not progress or total < 50,
        transient=True,
    )
    with bar:
        task = bar.add_task(scenario.name, total=total)
        try:
            result = simulate(scenario, progress=lambda done, _n: bar.update(task, completed=done))
        except Stalled as exc:  # one line naming what waits, never a traceback
            console.print(
                f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True
            )
            return 1
    run_dir = make_run_dir(scenario, "sim", out)
    return finish_run(result, run_dir, trace_format=trace_format, console=console)
