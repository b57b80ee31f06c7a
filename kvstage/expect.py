"""Checking a run against its scenario's [expect] table (fault scenarios)."""

from __future__ import annotations

from kvstage.shared.scenario import Scenario


def check_expectation(scenario: Scenario, failures: dict[int, str], requests: int, mode: str,
                      run_failed: bool = False) -> list[str]:
    """Problems with the outcome, [] when it is what the scenario expects (or expects nothing)."""
    exp = scenario.expect
    problems: list[str] = []
    if mode == "hw" and exp.hw_run_fails:
        if not run_failed:
            problems.append("expected the hardware run to fail (e.g. a killed rank), but it finished")
        return problems
    if exp.failed_rooms is None:
        return problems
    want = set(exp.failed_rooms)
    got = set(failures)
    if got != want:
        problems.append(f"expected failed rooms {sorted(want)}, got {sorted(got)}")
    if exp.reason_contains:
        for room, reason in sorted(failures.items()):
            if exp.reason_contains not in reason:
                problems.append(f"room {room} failed with {reason!r}, expected a reason containing {exp.reason_contains!r}")
    if any(room >= requests for room in want):
        problems.append(f"[expect] names rooms beyond the {requests} requests of the workload")
    return problems
