"""The run contract: what one run of either mode gives back, and the one way it ends.

`kvstage.run.simrun.simulate` and `kvstage.run.hwrun.launch_run` both return a
`RunResult`: the trace records, the ranks that reported, the invariant violations, the
run's errors (hardware: a rank that failed, a timeout), the failed rooms, wall time
and summary.json's dict. A library caller takes its figures from there (`judge` says
what `kvstage sim` / `kvstage hw` would exit with, `write` writes the run directory);
the commands end every run with `finish_run`: write the run directory, print the
summary table, apply the scenario's [expect] and return the exit code.

The exit code is 1 when the outcome is not the one [expect] allows
(kvstage/run/expect.py), when the run had an error, a byte arrived wrong, staging bytes
were still held at the end, or an invariant broke; a hardware run that [expect]
hw_run_fails says must fail is 0 when it did fail.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from kvstage.run.expect import check_expectation, format_failure_groups, print_outcome
from kvstage.run.rundir import write_run
from kvstage.run.summary_table import print_summary
from kvstage.shared.invariants import Violation
from kvstage.shared.runtime import RankResult
from kvstage.shared.scenario import Scenario
from kvstage.shared.trace import TraceRecord

__all__ = ["RunResult", "Verdict", "finish_run", "judge"]

VIOLATIONS_SHOWN = 10


@dataclass
class RunResult:
    """One run of `scenario` in `mode` ("sim" or "hw")."""

    scenario: Scenario
    mode: str
    records: list[TraceRecord]
    ranks: list[RankResult]  # the ranks that reported (a killed one does not)
    violations: list[Violation]
    errors: list[str]  # the run's own failures (hardware); [] for a simulation
    failures: dict[int, str]  # failed room -> reason
    wall_s: float
    requests: int  # rooms of the workload
    summary: dict[str, Any]  # summary.json (kvstage/run/summary.py)
    rejoined: list[dict] = field(default_factory=list)  # hardware: ranks that died and rejoined
    # room -> why the engine refused it at admission (shared/admission.py); not a failure
    rejected: dict[int, str] = field(default_factory=dict)

    def write(self, run_dir: Path, trace_format: str = "parquet") -> dict[str, Path]:
        """The run directory: trace, scenario.toml, summary.json."""
        return write_run(
            run_dir, self.scenario, self.records, self.summary, self.mode, trace_format
        )


@dataclass
class Verdict:
    """What a run's outcome is, against its scenario's [expect]."""

    problems: list[str]  # where the outcome is not the one [expect] allows
    expected_failure: bool  # a hardware run that failed as [expect] hw_run_fails says
    wrong_bytes: int
    leaked: bool  # staging bytes still held at the end
    code: int  # the exit code of `kvstage sim` / `kvstage hw`


def judge(result: RunResult) -> Verdict:
    """The verdict on `result` (see the module docstring); prints nothing."""
    s = result.summary
    problems = check_expectation(
        result.scenario,
        result.failures,
        result.requests,
        result.mode,
        run_failed=bool(result.errors),
    )
    expected = result.mode == "hw" and result.scenario.expect.hw_run_fails and not problems
    wrong = int(s.get("bytes_wrong") or 0)
    leaked = any(s.get("ring_used_at_end", {}).values())
    failed = problems or result.errors or wrong or leaked or result.violations
    return Verdict(problems, expected, wrong, leaked, 0 if expected or not failed else 1)


def _title(result: RunResult) -> str:
    if result.mode == "sim":
        return f"{result.scenario.name} (simulation)"
    hw = result.scenario.hardware
    return f"{result.scenario.name} (hardware, {hw.backend}, {hw.device})"


def _print_rejoins(console: Console, rejoined: list[dict]) -> None:
    for r in rejoined:
        first = f"rooms from {r['first_room']}" if r["first_room"] is not None else "no room"
        console.print(
            f"rank {r['rank']} rejoined as incarnation {r['incarnation']}, serving {first}, after: "
            f"{escape(r['after'])}",
            highlight=False,
        )


def finish_run(
    result: RunResult, run_dir: Path, *, trace_format: str = "parquet", console: Console
) -> int:
    """Write the run directory, print the summary table and the outcome; the exit code."""
    result.write(run_dir, trace_format)
    print_summary(result.summary, console, title=_title(result))
    _print_rejoins(console, result.rejoined)
    for line in format_failure_groups(result.rejected, "rejected at admission", "rejected"):
        console.print(line, markup=False, highlight=False)
    console.print(f"run directory: {run_dir}")
    v = judge(result)
    if v.expected_failure:
        why = escape(result.errors[0]) if result.errors else ""
        console.print(
            f"[green]expected outcome:[/] the run failed as the scenario expects: {why}",
            highlight=False,
        )
        return v.code
    print_outcome(console, v.problems, result.failures)
    for e in result.errors:
        console.print(
            f"[bold red]error:[/] {escape(e)}", highlight=False
        )  # a log tail is not markup
    if v.wrong_bytes:
        rooms = result.summary["wrong_rooms"][:10]
        console.print(f"[bold red]{v.wrong_bytes} byte(s) wrong[/] in rooms {rooms}")
    if v.leaked:
        console.print(
            f"[bold red]staging leak:[/] ring bytes at the end {result.summary['ring_used_at_end']}"
        )
    if result.violations:
        console.print(f"[bold red]{len(result.violations)} invariant violation(s):[/]")
        for x in result.violations[:VIOLATIONS_SHOWN]:
            console.print(x.format(), markup=False, highlight=False)
    return v.code
