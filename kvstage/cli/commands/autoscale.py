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
    disaggregated: Annotated[
        bool,
        typer.Option(
            "--disaggregated",
            help="Scale the scenario's prefill and decode instances separately on the "
            "disaggregated simulation (the fixed plan: its cluster.prefill_instances and "
            "decode_instances).",
        ),
    ] = False,
    tp: Annotated[
        int | None, typer.Option(help="TP of each colocated instance (default 1).")
    ] = None,
    profile: Annotated[
        str,
        typer.Option(
            metavar="F1,F2,...|day",
            help="Rate factors over equal segments of the workload's span (day: 24 hourly).",
        ),
    ] = "day",
    fixed_instances: Annotated[
        int | None,
        typer.Option(
            help="Colocated: the fixed plan's instances, held all day (GPU-hours against; "
            "default 4)."
        ),
    ] = None,
    capacity_rps: Annotated[
        float | None,
        typer.Option(
            help="Colocated: requests/s one instance serves within the SLO (default: the "
            "peak rate over --fixed-instances)."
        ),
    ] = None,
    floor: Annotated[int, typer.Option(help="Never fewer instances (each side).")] = 1,
    ceiling: Annotated[
        int | None,
        typer.Option(
            help="Never more instances (each side; default 64 colocated, twice the fixed "
            "plan's per side disaggregated)."
        ),
    ] = None,
    startup_s: Annotated[float, typer.Option(help="Seconds from asking to serving.")] = 120.0,
    interval_s: Annotated[float, typer.Option(help="Seconds between decisions.")] = 60.0,
    cooldown_s: Annotated[
        float, typer.Option(help="No scale-down within this long of a scale-up.")
    ] = 300.0,
    out: Annotated[Path | None, typer.Option(help="Output directory.")] = None,
) -> None:
    """Replay the scenario's workload with its rate warped by a daily profile on
    instances a planner adds and removes every --interval-s (a start-up delay, a floor,
    a ceiling and a cooldown). Colocated (the default): instances of TP --tp, targets
    from the arrival rate and the waiting queue (kvstage/explore/autoscale.py).
    --disaggregated: prefill and decode instances scaled separately, each side's target
    its tokens/s over one instance's, as Dynamo's SLA planner
    (kvstage/explore/autoscale_disagg.py). Prints GPU-hours against the fixed plan and
    the SLO attainment; writes autoscale.csv (per interval), autoscale.json and
    autoscale.png."""
    from kvstage.explore.autoscale import parse_profile
    from kvstage.explore.executor import ExploreError
    from kvstage.shared.scenario import ScenarioError, load_scenario

    if floor < 1:
        _fail(f"--floor {floor}: must be at least 1")
    if ceiling is not None and ceiling < floor:
        _fail(f"--ceiling {ceiling}: must be at least --floor {floor}")
    if interval_s <= 0 or startup_s < 0 or cooldown_s < 0:
        _fail("--interval-s must be > 0, --startup-s and --cooldown-s >= 0")
    try:
        factors = parse_profile(profile)
        base = load_scenario(scenario, list(set_ or []))
    except (ExploreError, ScenarioError, OSError) as exc:
        _fail(str(exc))
    if not base.slo.targets():
        _fail(f"{scenario} has no [slo] targets: add e.g. --set slo.ttft_s=2")
    policy = {"startup_s": startup_s, "interval_s": interval_s, "cooldown_s": cooldown_s}
    if disaggregated:
        for name, value in (("--tp", tp), ("--fixed-instances", fixed_instances),
                            ("--capacity-rps", capacity_rps)):  # fmt: skip
            if value is not None:
                _fail(
                    f"{name}: not with --disaggregated (each side's TP and the fixed plan "
                    "are the scenario's prefill.tp, decode.tp, cluster.prefill_instances "
                    "and cluster.decode_instances: use --set)"
                )
        text = _disagg_day(base, factors, floor, ceiling, policy, out, scenario.stem)
    else:
        text = _colocated_day(
            base, factors, tp or 1, fixed_instances or 4, capacity_rps, (floor, ceiling or 64),
            policy, out, scenario.stem,
        )  # fmt: skip
    console.print(escape(text), highlight=False, soft_wrap=True)


def _colocated_day(
    base, factors, tp: int, fixed: int, capacity_rps, bounds, policy, out, name
) -> str:
    from kvstage.explore.autoscale import Planner, run_day, warp_arrivals
    from kvstage.shared.workload import generate_requests
    from kvstage.sim.colocated import colocated_problem, colocated_scenario

    for flag, value in (("--tp", tp), ("--fixed-instances", fixed)):
        if value < 1:
            _fail(f"{flag} {value}: must be at least 1")
    floor, ceiling = bounds
    s = colocated_scenario(base, tp, floor)
    why = colocated_problem(s)
    if why:
        _fail(f"--tp {tp}: {why}")
    requests = warp_arrivals(generate_requests(s), factors)
    cap = capacity_rps or _capacity(requests, factors, fixed)
    planner = Planner(cap, floor, ceiling, policy["startup_s"], policy["interval_s"],
                      cooldown_s=policy["cooldown_s"])  # fmt: skip
    day = run_day(s, requests, planner, fixed)
    out_dir = out or Path("runs") / f"{name}-autoscale"
    out_dir.mkdir(parents=True, exist_ok=True)
    _write(day, out_dir, name)
    saved = 1 - day["gpu_hours"] / day["fixed_gpu_hours"] if day["fixed_gpu_hours"] else 0.0
    return (
        f"autoscaled {day['requests']:,} requests over {day['span_s'] / 3600:.2f} h on TP{tp} "
        f"instances (capacity {cap:.3g} req/s each, {floor}..{ceiling}, start-up "
        f"{policy['startup_s']:g} s): peak {day['peak_instances']} instances, "
        f"{day['gpu_hours']:.2f} GPU-hours against {day['fixed_gpu_hours']:.2f} for "
        f"{fixed} fixed ({saved:+.0%} saved), SLO attainment "
        f"{day['slo_attainment']:.1%}; files in {out_dir}"
    )


def _disagg_day(base, factors, floor: int, ceiling, policy, out, name) -> str:
    from kvstage.explore.autoscale import warp_arrivals
    from kvstage.explore.autoscale_disagg import (
        DisaggPlanner,
        SidePlanner,
        peak_capacities,
        run_disagg_day,
    )
    from kvstage.shared.workload import generate_requests

    c = base.cluster
    tops = {side: ceiling or 2 * n for side, n in
            (("prefill", c.prefill_instances), ("decode", c.decode_instances))}  # fmt: skip
    requests = warp_arrivals(generate_requests(base), factors)
    if not requests:
        _fail(f"{name}: the workload has no requests")
    cp, cd = peak_capacities(requests, factors, c.prefill_instances, c.decode_instances)
    planner = DisaggPlanner(
        SidePlanner(cp, floor, max(floor, tops["prefill"])),
        SidePlanner(cd, floor, max(floor, tops["decode"])),
        **policy,
    )
    day = run_disagg_day(base, requests, planner)
    out_dir = out or Path("runs") / f"{name}-autoscale"
    out_dir.mkdir(parents=True, exist_ok=True)
    _write(day, out_dir, name)
    saved = 1 - day["gpu_hours"] / day["fixed_gpu_hours"] if day["fixed_gpu_hours"] else 0.0
    peak = day["peak_instances"]
    return (
        f"autoscaled {day['requests']:,} requests over {day['span_s'] / 3600:.2f} h, "
        f"disaggregated: prefill TP{base.prefill.tp} (capacity {cp:.4g} prompt tokens/s "
        f"each), decode TP{base.decode.tp} ({cd:.4g} output tokens/s each), {floor}.."
        f"{tops['prefill']} / {floor}..{tops['decode']}, start-up {policy['startup_s']:g} s: "
        f"peak {peak['prefill']} prefill + {peak['decode']} decode, {day['gpu_hours']:.2f} "
        f"GPU-hours against {day['fixed_gpu_hours']:.2f} for {c.prefill_instances} + "
        f"{c.decode_instances} fixed ({saved:+.0%} saved), SLO attainment "
        f"{day['slo_attainment']:.1%}; files in {out_dir}"
    )


def _write(day: dict, out_dir: Path, name: str) -> None:
    from kvstage.explore.autoscale import day_figure

    tl = day["timeline"]
    cols = list(tl[0]) if tl else ["t_s"]
    if "slo_attainment" not in cols:
        cols.append("slo_attainment")
    lines = [",".join(cols)]
    for row in tl:
        lines.append(",".join("" if row.get(c) is None else f"{row[c]:g}" for c in cols))
    (out_dir / "autoscale.csv").write_text("\n".join(lines) + "\n")
    summary = {k: v for k, v in day.items() if k not in ("timeline", "lives", "routes")}
    (out_dir / "autoscale.json").write_text(json.dumps(summary, indent=2) + "\n")
    day_figure(day, name).savefig(out_dir / "autoscale.png", dpi=100)


def register(app: typer.Typer) -> None:
    app.command("autoscale")(autoscale)
