"""What `kvstage validate` says about a scenario's workload before anything runs: the
requests an engine would refuse at admission (shared/admission.py), the prompt lengths
it could draw beyond the model's context though this seed drew none, and the parts of
a named trace the scenario overrides (shared/workload.py)."""

from __future__ import annotations

from kvstage.run.expect import format_failure_groups
from kvstage.shared.admission import admit
from kvstage.shared.scenario import Scenario
from kvstage.shared.workload import generate_requests
from kvstage.sim.driver import engine_limits

__all__ = ["admission_warnings", "trace_overrides", "workload_notes"]


def _longest_drawable(scenario: Scenario) -> int | None:
    """The longest prompt the workload's distribution can draw (None: a trace's rows,
    all of which are in the requests already)."""
    w = scenario.workload
    if w.prompt == "trace":
        return None
    longest = w.prompt_tokens if w.prompt == "fixed" else w.prompt_max
    return longest if w.max_prompt_tokens is None else min(longest, w.max_prompt_tokens)


def admission_warnings(scenario: Scenario) -> list[str]:
    """Plain lines, [] when every request the workload can produce is admitted."""
    requests = generate_requests(scenario)
    limits = engine_limits(scenario, any(r.output_tokens for r in requests))
    _, refused = admit(requests, limits)
    lines: list[str] = []
    if refused:
        lines.append(
            f"warning: {len(refused)} of {len(requests)} requests would be rejected at "
            "admission, by reason:"
        )
        lines += format_failure_groups(refused, key="rejected")[1:]
    ctx, longest = limits.context_tokens, _longest_drawable(scenario)
    if not refused and ctx is not None and longest is not None and longest >= ctx:
        lines.append(
            f"warning: workload.prompt = {scenario.workload.prompt!r} can draw prompts up to "
            f"{longest} tokens, not shorter than the model's context length ({ctx}): such "
            "requests would be rejected at admission (none with this seed)"
        )
    return lines


def trace_overrides(scenario: Scenario) -> list[str]:
    """A note per part of a named trace the scenario replaces with its own ([] when
    the trace supplies everything it has)."""
    w = scenario.workload
    if not w.trace:
        return []
    parts = []
    if w.arrival != "trace":
        parts.append(f"workload.arrival = {w.arrival!r} replaces the trace's arrivals")
    if w.prompt != "trace":
        parts.append(
            f"workload.prompt = {w.prompt!r} replaces the trace's prompt lengths and hash ids"
        )
    if w.output_tokens is not None:
        parts.append(f"workload.output_tokens = {w.output_tokens} replaces its output lengths")
    return [f'note: {part} (set it to "trace", or leave it out, to replay them)' for part in parts]


def workload_notes(scenario: Scenario) -> list[str]:
    """Everything `kvstage validate` prints about the workload, warnings first."""
    return admission_warnings(scenario) + trace_overrides(scenario)
