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

if TYPE_CHECKING:
    from kvstage.shared.scenario import Scenario

__all__ = ["busiest_stage", "run_plan_point"]


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
