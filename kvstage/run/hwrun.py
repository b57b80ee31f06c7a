"""A hardware run: `launch_run` spawns (or waits for) the ranks, merges their reports
(kvstage/hw/merge.py) and gives the run's RunResult (kvstage/run/result.py); `kvstage hw`
(`run_hardware`) shows its progress and ends it with `finish_run`: run directory,
summary table, exit code."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from rich.console import Console

from kvstage.hw.launch import RunProgress, launch
from kvstage.hw.merge import clock_tolerance, hardware_figures, merge_records
from kvstage.run import conditions
from kvstage.run.hw_progress import HwProgress
from kvstage.run.result import RunResult, finish_run
from kvstage.run.rundir import make_run_dir
from kvstage.run.summary import run_summary
from kvstage.shared.invariants import check_records
from kvstage.shared.runtime import RankResult, merge_failures, rank_name
from kvstage.shared.scenario import Scenario
from kvstage.shared.workload import generate_requests


def _run_conditions(before: conditions.Sample, spawned: bool, reports: dict[str, dict]) -> dict:
    """How busy the host was (spawned ranks' CPU time is the run's own), and whether
    every rank loop got its real-time class (a host that refuses it delays control
    messages)."""
    return {**conditions.measure(before, spawned=spawned), "loops_realtime": conditions.loops_realtime(reports)}


def _restarts(scenario: Scenario) -> dict[str, list[float]]:
    """rank -> the delays after which the launcher starts it again, one per kill fault
    with restart_after_s, in the order the kills come."""
    restarts: dict[str, list[float]] = {}
    for k in sorted(scenario.faults.kill, key=lambda k: k.at_s):
        if k.restart_after_s is not None:
            restarts.setdefault(rank_name(k.role, k.rank), []).append(k.restart_after_s)
    return restarts


def launch_run(
    scenario: Scenario,
    run_dir: Path,
    *,
    timeout_s: float = 600.0,
    spawn: bool = True,
    port: int = 0,
    on_started=None,
    on_progress: Callable[[RunProgress], None] | None = None,
    rank_wrapper: list[str] | None = None,
    rejoin_grace_s: float = 0.0,
    **placement: str | None,
) -> RunResult:
    """Run `scenario` on real transfers, the ranks' logs and scenario.toml in `run_dir`
    (which must exist); prints nothing. `placement`: host, bind, advertise
    (hw.launch.launch); `rejoin_grace_s`: how long a dead prefill rank may take to rejoin."""
    hw, g, c = scenario.hardware, scenario.geometry(), scenario.cluster
    scenario_path = Path(run_dir) / "scenario.toml"
    scenario_path.write_text(scenario.to_toml())
    before = conditions.sample()  # how busy the host was during the run (kvstage/run/conditions.py)
    rooms = len(generate_requests(scenario))
    result = launch(scenario_path, c.prefill_instances * g.prefill_tp, c.decode_instances * g.decode_tp,
                    Path(run_dir) / "logs", backend=hw.backend, device=hw.device, timeout_s=timeout_s, spawn=spawn,
                    port=port, on_started=on_started, rank_wrapper=rank_wrapper, rejoin_grace_s=rejoin_grace_s,
                    restarts=_restarts(scenario), on_progress=on_progress, **placement)
    records = merge_records(result.reports)
    errors = list(result.errors)
    violations = check_records(records, scenario.transfer.path, clock_tolerance(result.reports)) if result.ok else []
    ranks = [RankResult.from_wire(r) for _, r in sorted(result.reports.items())]
    summary = run_summary(
        scenario, "hw", records, ranks, requests=rooms, wall_s=result.wall_s,
        violations=len(violations),
        extra={
            **hardware_figures(scenario, result.reports),
            "errors": errors,
            "rejoins": result.rejoined,  # ranks that died (or went silent) and rejoined
            "conditions": _run_conditions(before, spawn, result.reports),
        },
    )
    return RunResult(scenario, "hw", records, ranks, violations, errors, merge_failures(ranks), result.wall_s,
                     rooms, summary, rejoined=result.rejoined)


def run_hardware(
    scenario: Scenario,
    *,
    out: Path | None = None,
    trace_format: str = "parquet",
    console: Console | None = None,
    **launch_options,
) -> tuple[int, Path]:
    """`kvstage hw`: `launch_run` under a progress display, then `finish_run`; (exit code,
    run directory). 0 when every rank finished, every byte verified right, no invariant
    broke and the failed rooms are the ones the scenario's [expect] allows (none without
    one); 1 otherwise. `launch_options`: launch_run's."""
    console = console or Console()
    hw = scenario.hardware
    run_dir = make_run_dir(scenario, "hw", out)
    g, c = scenario.geometry(), scenario.cluster
    instances = "" if c.single else f"{c.prefill_instances} x "
    console.print(
        f"hardware run: {scenario.name}, {instances}prefill TP{g.prefill_tp} -> "
        f"{'' if c.single else f'{c.decode_instances} x '}decode TP{g.decode_tp}, "
        f"{hw.backend} on {hw.device}, {scenario.workload.requests} requests, {scenario.transfer.path} path"
    )
    with HwProgress(console, g.decode_tp, len(generate_requests(scenario))) as progress:
        result = launch_run(scenario, run_dir, on_progress=progress, **launch_options)
    return finish_run(result, run_dir, trace_format=trace_format, console=console), run_dir
