"""summary.json, built once for both modes.

Every key means the same thing in a simulated and a hardware run: the trace
metrics (kvstage/metrics.py) plus the ranks' own results (`RankResult`, summed or
listed per rank). A mode adds only what exists in that mode (simulated time; the
backend, verified bytes and posted transfer requests of hardware).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvstage.expect import group_failures
from kvstage.metrics import summarize
from kvstage.shared.runtime import RankResult, merge_failures, sum_counts
from kvstage.shared.scenario import Scenario
from kvstage.shared.trace import TraceRecord

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
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The run's summary. `ranks` are the ranks that reported (a killed one does not)."""
    summary = summarize(records, mode=mode, pool_bytes=scenario.pool_bytes, requests=requests)
    failures = merge_failures(list(ranks))
    summary.update(
        {
            "scenario": scenario.name,
            "transfer_path": scenario.transfer.path,
            "events": sum(r.events for r in ranks),  # events the rank machines handled
            "wall_s": wall_s,
            "invariant_violations": violations,
            "failures": {str(k): v for k, v in list(failures.items())[:FAILURES_LISTED]},
            # every failed room, counted per reason with its numbers as `#` (kvstage/expect.py)
            "failure_groups": {g.pattern: len(g.rooms) for g in group_failures(failures)},
            "faults_injected": sum_counts(r.faults_injected for r in ranks),
            "faults_by_rank": {r.name: dict(sorted(r.faults_injected.items())) for r in ranks if r.faults_injected},
            "dropped_messages": sum(r.dropped for r in ranks),
            "ring_used_at_end": {str(r.rank): r.ring_used for r in ranks if r.role == "decode"},
            "ranks_died": sorted(r.name for r in ranks if r.died),
        }
    )
    summary.update(extra or {})
    return summary
