"""One configuration of a plan, simulated and measured over its steady window.

`run_plan_point(scenario, attainment)` runs in a worker (local process or Ray, like
the sweep's `run_point`): it simulates the scenario, takes the steady-state figures of
`kvstage.metrics.steady` (warm-up and drain cut; the quantile the attainment names,
with its interval; goodput over the window) and the bottleneck verdict of
`kvstage.metrics.bottleneck` with the busiest stage's utilization. One flat row.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from kvstage.explore.executor import error_row
from kvstage.explore.sweep import STATUS_OK
from kvstage.metrics.steady import QUANTILES, SLO_FIGURES, quantile_name
from kvstage.shared.serving.capacity import gpus

if TYPE_CHECKING:
    from kvstage.shared.scenario import Scenario

__all__ = ["busiest_stage", "figure_columns", "gpus_of", "run_plan_point"]


def gpus_of(settings: dict[str, Any]) -> int:
    """GPUs of a configuration's settings, both sides (shared/serving/capacity.py `gpus`)."""
    keys = ("cluster.prefill_instances", "prefill.tp", "cluster.decode_instances", "decode.tp")
    return sum(gpus(*(settings[k] for k in keys), settings.get("prefill.pp", 1)))


def figure_columns(attainment: float) -> tuple[str, ...]:
    """Per simulated point, the figures kept: the steady window, attainment and goodput
    with their intervals, p50 / p90 / p99 of TTFT, TPOT and end to end and the target
    quantile (`quantile_name(attainment)`) with its interval, ITL (every gap) at those
    quantiles, tokens per GPU, the busiest stage."""
    q = quantile_name(attainment)
    lat = []
    for key in SLO_FIGURES:
        names = [f"{key}.{quantile_name(x)}" for x in QUANTILES]
        if f"{key}.{q}" not in names:
            names.append(f"{key}.{q}")
        lat += [*names, f"{key}.{q}_lo", f"{key}.{q}_hi"]
    itl = [f"itl_s.{quantile_name(x)}" for x in QUANTILES]  # every gap pooled: no interval
    lat += itl if f"itl_s.{q}" in itl else [*itl, f"itl_s.{q}"]
    return (
        "requests",
        "window_requests",
        "warmup_requests",
        "drain_requests",
        "slo_attainment",
        "slo_attainment_lo",
        "slo_attainment_hi",
        "goodput_rps",
        "goodput_rps_lo",
        "goodput_rps_hi",
        "goodput_per_gpu_rps",
        "offered_load_rps",
        *lat,
        "input_tokens_per_gpu_s",
        "output_tokens_per_gpu_s",
        "tokens_per_user_s",
        "requests_failed",
        "busiest_stage",
        "busiest_utilization",
    )


def busiest_stage(verdict: dict[str, Any]) -> tuple[str | None, float | None]:
    """The stage with the highest utilization in a bottleneck verdict, and that utilization."""
    utils = {
        k: math.inf if v.get("infeasible") else v["utilization"]
        for k, v in verdict.get("stages", {}).items()
        if v.get("utilization") is not None or v.get("infeasible")
    }
    if not utils:
        return None, None
    stage = max(utils, key=utils.get)
    return stage, utils[stage]


def run_plan_point(scenario: Scenario, attainment: float) -> dict[str, Any]:
    """Simulate one configuration; its steady-state row (or status "error" and why)."""
    try:
        from kvstage.metrics.rooms import room_latencies, summarize
        from kvstage.metrics.steady import steady_figures
        from kvstage.run.summary import capacity_figures
        from kvstage.shared.serving.capacity import scenario_gpus
        from kvstage.sim.shard import simulate_scenario

        result = simulate_scenario(scenario)
        rooms = room_latencies(result.records)
        gpus = sum(scenario_gpus(scenario))
        row = steady_figures(rooms, result.requests, scenario.slo.targets(), attainment, gpus=gpus)
        summary = summarize(
            result.records,
            mode="sim",
            pool_bytes=scenario.pool_bytes,
            requests=len(result.requests),
            rooms=rooms,
        )
        verdict = capacity_figures(
            scenario,
            rooms,
            summary,
            requests=len(result.requests),
            workload=result.requests,
            always=True,
        )["bottleneck"]
        stage, util = busiest_stage(verdict)
        row |= {
            "status": STATUS_OK,
            "requests": len(result.requests),
            "prefill_gpu": scenario.prefill.gpu,
            "decode_gpu": scenario.decode.gpu,
            "requests_failed": result.rooms_failed,
            "bottleneck": verdict["stage"],
            "bottleneck_why": verdict["explanation"],
            "busiest_stage": stage,
            "busiest_utilization": util if util is None or math.isfinite(util) else None,
            "sim_time_s": result.sim_time_s,
            "wall_s": result.wall_s,
        }
        if result.violations:
            row["reason"] = "; ".join(v.format() for v in result.violations[:3])
        return row
    except Exception as exc:  # a simulator bug: report it as the point's row
        return error_row(exc)
