"""`kvstage sim`: simulate, write the run directory, print the summary table."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvstage.run import conditions
from kvstage.run.expect import check_expectation, print_outcome
from kvstage.run.rundir import make_run_dir, write_run
from kvstage.run.summary import run_summary
from kvstage.run.summary_table import print_summary
from kvstage.shared.scenario import Scenario
from kvstage.sim.driver import SimResult
from kvstage.sim.shard import simulate_scenario


def simulation_summary(scenario: Scenario, result: SimResult) -> dict:
    """summary.json of a simulation (kvstage/run/summary.py), plus the simulated time."""
    return run_summary(scenario, "sim", result.records, result.ranks, requests=len(result.requests),
                       wall_s=result.wall_s, violations=len(result.violations),
                       extra={"sim_time_s": result.sim_time_s})


def run_simulation(
    scenario: Scenario,
    *,
    out: Path | None = None,
    trace_format: str = "parquet",
    progress: bool = True,
    console: Console | None = None,
) -> int:
    """Simulate `scenario`, write its run directory; 0 if no invariant broke and the
    failed rooms are the ones the scenario's [expect] allows (none without one), else 1."""
    console = console or Console()
    total = scenario.workload.requests
    bar = Progress(
        TextColumn("[bold]simulating[/] {task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=not progress or total < 50,
        transient=True,
    )
    before = conditions.sample()  # how busy the host was during the run (kvstage/run/conditions.py)
    with bar:
        task = bar.add_task(scenario.name, total=total)
        result = simulate_scenario(scenario, progress=lambda done, _n: bar.update(task, completed=done))
    summary = simulation_summary(scenario, result)
    summary["conditions"] = conditions.measure(before)
    run_dir = make_run_dir(scenario, "sim", out)
    write_run(run_dir, scenario, result.records, summary, "sim", trace_format)
    print_summary(summary, console, title=f"{scenario.name} (simulation)")
    console.print(f"run directory: {run_dir}")
    problems = check_expectation(scenario, result.failures, len(result.requests), "sim")
    code = print_outcome(console, problems, result.failures)
    if result.violations:
        console.print(f"[bold red]{len(result.violations)} invariant violation(s):[/]")
        for v in result.violations[:10]:
            console.print(v.format(), markup=False, highlight=False)
        return 1
    return code
