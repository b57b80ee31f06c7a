"""summary.json, built once for both modes.

Every key means the same thing in a simulated and a hardware run: the trace
metrics (kvstage/metrics/rooms.py) plus the ranks' own results (`RankResult`, summed or
listed per rank). A mode adds only what exists in that mode (simulated time; the
backend, verified bytes and posted transfer requests of hardware).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvstage.metrics.bottleneck import bottleneck
from kvstage.metrics.rooms import room_latencies, slo_figures, summarize
from kvstage.run.expect import group_failures
from kvstage.shared.runtime import RankResult, merge_failures, sum_counts
from kvstage.shared.scenario import Scenario
from kvstage.shared.serving.capacity import scenario_gpus
from kvstage.shared.serving.compute import efficiency_figures
from kvstage.shared.trace import TraceRecord
from kvstage.shared.workload import Request, generate_requests, trace_rows

if TYPE_CHECKING:
    from kvstage.sim.driver import SimResult

FAILURES_LISTED = 20


def run_summary(
    scenario: Scenario,
    mode: str,
    records: Sequence[TraceRecord],
    ranks: Sequence[RankResult],
    *,
    requests: int,
    wall_s: float,
    violations: int,
    rejected: dict[int, str] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The run's summary. `ranks` are the ranks that reported (a killed one does not);
    `rejected`: room -> why the engine refused it at admission (shared/admission.py)."""
    rooms = room_latencies(records)
    summary = summarize(
        records, mode=mode, pool_bytes=scenario.pool_bytes, requests=requests, rooms=rooms
    )
    failures = merge_failures(list(ranks))
    summary.update(
        {
            "scenario": scenario.name,
            "transfer_path": scenario.transfer.path,
            "events": sum(r.events for r in ranks),  # events the rank machines handled
            "wall_s": wall_s,
            "invariant_violations": violations,
            "failures": {str(k): v for k, v in list(failures.items())[:FAILURES_LISTED]},
            # every failed room, counted per reason with its numbers as `#` (kvstage/run/expect.py)
            "failure_groups": {g.pattern: len(g.rooms) for g in group_failures(failures)},
            # requests the engine refused before any work, counted per reason (as failure_groups)
            "requests_rejected": len(rejected or {}),
            "rejected": {g.pattern: len(g.rooms) for g in group_failures(rejected or {})},
            "faults_injected": sum_counts(r.faults_injected for r in ranks),
            "faults_by_rank": {
                r.name: dict(sorted(r.faults_injected.items())) for r in ranks if r.faults_injected
            },
            "dropped_messages": sum(r.dropped for r in ranks),
            "ring_used_at_end": {str(r.rank): r.ring_used for r in ranks if r.role == "decode"},
            "ranks_died": sorted(r.name for r in ranks if r.died),
            # prompt tokens the prefill's prefix cache served / prompt tokens (shared/serving/prefix_cache.py)
            "prefix_hit_fraction": _prefix_hit_fraction(ranks),
            # the GPUs and efficiencies the compute model used (shared/serving/compute.py)
            "serving_model": efficiency_figures(scenario),
        }
    )
    rows = trace_rows(scenario)
    if rows is not None:  # "N of M trace rows"
        summary["trace_rows_replayed"], summary["trace_rows"] = rows
    summary.update(capacity_figures(scenario, rooms, summary, requests=requests))
    summary.update(extra or {})
    return summary


def _prefix_hit_fraction(ranks: Sequence[RankResult]) -> float:
    prompt = sum(r.prompt_tokens for r in ranks if r.role == "prefill")
    return sum(r.cached_tokens for r in ranks if r.role == "prefill") / prompt if prompt else 0.0


def simulation_summary(scenario: Scenario, result: SimResult) -> dict[str, Any]:
    """summary.json of a simulation, plus the simulated time."""
    return run_summary(
        scenario,
        "sim",
        result.records,
        result.ranks,
        requests=len(result.requests),
        wall_s=result.wall_s,
        violations=len(result.violations),
        rejected=result.rejected,
        extra={"sim_time_s": result.sim_time_s},
    )


def capacity_figures(
    scenario: Scenario,
    rooms: dict,
    summary: dict[str, Any],
    *,
    requests: int,
    workload: Sequence[Request] | None = None,
    always: bool = False,
) -> dict[str, Any]:
    """The SLO keys (kvstage/metrics/rooms.py `slo_figures`) when the scenario has [slo]
    targets; `offered_load_rps` and `bottleneck` (kvstage/metrics/bottleneck.py) when it has
    targets or models the decode side (output tokens, KV capacity), or `always`.
    Without either, nothing: summaries of such runs stay as they were."""
    targets = scenario.slo.targets()
    out = slo_figures(rooms, targets, requests=requests, gpus=sum(scenario_gpus(scenario)))
    decode_side = "tpot_s" in summary or scenario.decode.gpu_memory_gib is not None
    if targets or decode_side or always:
        verdict = bottleneck(
            scenario, generate_requests(scenario) if workload is None else workload, rooms, summary
        )
        if verdict["offered"]["requests_per_s"] is not None:
            out["offered_load_rps"] = verdict["offered"]["requests_per_s"]
        out["bottleneck"] = verdict
    return out
