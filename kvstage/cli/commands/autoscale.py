"""`kvstage autoscale`: a day of load on instances an autoscaling policy adds and removes.

The model is kvstage/explore/autoscale.py (the rate warp, the planner, GPU-hours); this
module is the command line: options, the summary, files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from kvstage.cli.errors import fail as _fail
from kvstage.cli.options import SetOpt

console = Console()


def _capacity(requests: list, profile: tuple[float, ...], fixed: int) -> float:
    """One instance's share of the peak: the warped trace's busiest segment rate over
    the fixed plan's instances (a fixed plan sized for the peak)."""
    span = requests[-1].arrival_s or 1.0
    mean_rate = len(requests) / span
    return mean_rate * max(profile) / (sum(profile) / len(profile)) / fixed


def autoscale(
    scenario: Annotated[Path, typer.Argument(help="Scenario TOML file with an [slo] table.")],
    set_: SetOpt = None,
    tp: Annotated[int, typer.Option(help="TP of each (colocated) instance.")] = 1,
    profile: Annotated[
        str,
        typer.Option(
            metavar="F1,F2,...|day",
            help="Rate factors over equal segments of the workload's span (day: 24 hourly).",
        ),
    ] = "day",
    fixed_instances: Annotated[
        int, typer.Option(help="The fixed plan's instances, held all day (GPU-hours against).")
    ] = 4,
    capacity_rps: Annotated[
        float | None,
        typer.Option(
            help="Requests/s one instance serves within the SLO (default: the peak rate over "
            "--fixed-instances)."
        ),
    ] = None,
    floor: Annotated[int, typer.Option(help="Never fewer instances.")] = 1,
    ceiling: Annotated[int, typer.Option(help="Never more instances.")] = 64,
    startup_s: Annotated[float, typer.Option(help="Seconds from asking to serving.")] = 120.0,
    interval_s: Annotated[float, typer.Option(help="Seconds between decisions.")] = 60.0,
    cooldown_s: Annotated[
        float, typer.Option(help="No scale-down within this long of a scale-up.")
    ] = 300.0,
    out: Annotated[Path | None, typer.Option(help="Output directory.")] = None,
) -> None:
    """Replay the scenario's workload with its rate warped by a daily profile on
    colocated instances of TP --tp that a planner adds and removes every --interval-s
    (targets from the arrival rate and the waiting queue, a start-up delay, a floor
    and a cooldown; kvstage/explore/autoscale.py). Prints GPU-hours against
    --fixed-instances held all day and the SLO attainment; writes autoscale.csv
    (instances, rate, queue and attainment per interval), autoscale.json and
    autoscale.png."""
    from kvstage.explore.autoscale import Planner, parse_profile, run_day, warp_arrivals
    from kvstage.explore.executor import ExploreError
    from kvstage.shared.scenario import ScenarioError, load_scenario
    from kvstage.shared.workload import generate_requests
    from kvstage.sim.colocated import colocated_problem, colocated_scenario

    for name, value in (("--tp", tp), ("--fixed-instances", fixed_instances), ("--floor", floor)):
        if value < 1:
            _fail(f"{name} {value}: must be at least 1")
    if ceiling < floor:
        _fail(f"--ceiling {ceiling}: must be at least --floor {floor}")
    if interval_s <= 0 or startup_s < 0 or cooldown_s < 0:
        _fail("--interval-s must be > 0, --startup-s and --cooldown-s >= 0")
    try:
        factors = parse_profile(profile)
        s = colocated_scenario(load_scenario(scenario, list(set_ or [])), tp, floor)
    except (ExploreError, ScenarioError, OSError) as exc:
        _fail(str(exc))
    if not s.slo.targets():
        _fail(f"{scenario} has no [slo] targets: add e.g. --set slo.ttft_s=2")
    why = colocated_problem(s)
    if why:
        _fail(f"--tp {tp}: {why}")
    requests = warp_arrivals(generate_requests(s), factors)
    cap = capacity_rps or _capacity(requests, factors, fixed_instances)
    planner = Planner(cap, floor, ceiling, startup_s, interval_s, cooldown_s=cooldown_s)
    day = run_day(s, requests, planner, fixed_instances)
    out_dir = out or Path("runs") / f"{scenario.stem}-autoscale"
    out_dir.mkdir(parents=True, exist_ok=True)
    _write(day, out_dir, scenario.stem)
    saved = 1 - day["gpu_hours"] / day["fixed_gpu_hours"] if day["fixed_gpu_hours"] else 0.0
    console.print(
        escape(
            f"autoscaled {day['requests']:,} requests over {day['span_s'] / 3600:.2f} h on TP{tp} "
            f"instances (capacity {cap:.3g} req/s each, {floor}..{ceiling}, start-up "
            f"{startup_s:g} s): peak {day['peak_instances']} instances, "
            f"{day['gpu_hours']:.2f} GPU-hours against {day['fixed_gpu_hours']:.2f} for "
            f"{fixed_instances} fixed ({saved:+.0%} saved), SLO attainment "
            f"{day['slo_attainment']:.1%}; files in {out_dir}"
        ),
        highlight=False,
        soft_wrap=True,
    )


def _write(day: dict, out_dir: Path, name: str) -> None:
    from kvstage.explore.autoscale import day_figure

    cols = ("t_s", "rate_rps", "waiting", "target", "instances", "serving", "slo_attainment")
    lines = [",".join(cols)]
    for row in day["timeline"]:
        lines.append(",".join("" if row.get(c) is None else f"{row[c]:g}" for c in cols))
    (out_dir / "autoscale.csv").write_text("\n".join(lines) + "\n")
    summary = {k: v for k, v in day.items() if k not in ("timeline", "lives")}
    (out_dir / "autoscale.json").write_text(json.dumps(summary, indent=2) + "\n")
    day_figure(day, name).savefig(out_dir / "autoscale.png", dpi=100)


def register(app: typer.Typer) -> None:
    app.command("autoscale")(autoscale)
