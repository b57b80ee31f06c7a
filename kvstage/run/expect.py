"""A run's outcome against its scenario's [expect] table, and failed rooms by reason.

What may fail: `[expect] failed_rooms = [2, 5]` lists exactly the rooms that must fail
(`[]`: none); without it -- no [expect] at all, the catalogue's case -- no room may
fail. `reason_contains` and `hw_run_fails` (a hardware run that must itself fail, e.g.
a killed rank) refine it. `kvstage sim` and `kvstage hw` exit 1 when the outcome is not
the expected one, printing the failed rooms grouped by reason (`group_failures`): the
numbers in a reason (ranks, rooms, chunks, times) are replaced by `#`, so "room 4 timed
out ... chunks [0]" and "room 9 timed out ... chunks [1]" are one group; summary.json's
`failure_groups` counts every failed room of the run per such reason.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from rich.console import Console
from rich.markup import escape

from kvstage.shared.scenario import Scenario

__all__ = [
    "FailureGroup",
    "check_expectation",
    "format_failure_groups",
    "group_failures",
    "print_outcome",
    "reason_pattern",
]

# Shown on the console: a handful of lines whatever the run's size.
GROUPS_SHOWN = 6
ROOMS_SHOWN = 5
REASON_CHARS = 240

_NUMBER_LIST = re.compile(r"\[[\d\s,.]*\]")  # [0], [1, 3], []
_NUMBER = re.compile(r"\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def reason_pattern(reason: str) -> str:
    """`reason` with its numbers as `#` and number lists as `[#]`: the group key."""
    return _NUMBER.sub("#", _NUMBER_LIST.sub("[#]", reason))


@dataclass(slots=True)
class FailureGroup:
    """The failed rooms whose reasons differ only in their numbers."""

    pattern: str
    rooms: list[int] = field(default_factory=list)
    example: str = ""  # the first room's reason, as it was
    same: bool = True  # every room failed with exactly `example`


def group_failures(failures: dict[int, str]) -> list[FailureGroup]:
    """Failed rooms (room -> reason) grouped by `reason_pattern`, biggest group first
    (ties: the group with the lowest room first); rooms ascending in each group."""
    groups: dict[str, FailureGroup] = {}
    for room, reason in sorted(failures.items()):
        key = reason_pattern(reason)
        g = groups.get(key)
        if g is None:
            g = groups[key] = FailureGroup(key, example=reason)
        g.rooms.append(room)
        g.same = g.same and reason == g.example
    return sorted(groups.values(), key=lambda g: (-len(g.rooms), g.rooms[0]))


def _clip(text: str) -> str:
    return text if len(text) <= REASON_CHARS else text[: REASON_CHARS - 3] + "..."


def format_failure_groups(
    failures: dict[int, str], verb: str = "failed", key: str = "failure_groups"
) -> list[str]:
    """The failed rooms by reason, as a few console lines (at most GROUPS_SHOWN groups,
    ROOMS_SHOWN room ids each); [] when no room failed. `verb` and `key` say what
    happened to them and which summary.json key has them all ("rejected", "rejected"
    for the requests an engine refused)."""
    if not failures:
        return []
    groups = group_failures(failures)
    lines = [f"{len(failures)} room(s) {verb}, by reason:"]
    for g in groups[:GROUPS_SHOWN]:
        shown = ", ".join(str(r) for r in g.rooms[:ROOMS_SHOWN])
        more = ", ..." if len(g.rooms) > ROOMS_SHOWN else ""
        noun = "room" if len(g.rooms) == 1 else "rooms"
        lines.append(
            f"  {len(g.rooms)} {noun} ({shown}{more}): {_clip(g.example if g.same else g.pattern)}"
        )
        if not g.same:
            lines.append(f"      e.g. room {g.rooms[0]}: {_clip(g.example)}")
    rest = groups[GROUPS_SHOWN:]
    if rest:
        lines.append(
            f"  ... {len(rest)} more reason(s), {sum(len(g.rooms) for g in rest)} room(s) "
            f"(summary.json {key})"
        )
    return lines


def check_expectation(
    scenario: Scenario, failures: dict[int, str], requests: int, mode: str, run_failed: bool = False
) -> list[str]:
    """Problems with the outcome, [] when it is what the scenario expects: without
    `[expect] failed_rooms`, that no room failed."""
    exp = scenario.expect
    problems: list[str] = []
    if mode == "hw" and exp.hw_run_fails:
        if not run_failed:
            problems.append(
                "expected the hardware run to fail (e.g. a killed rank), but it finished"
            )
        return problems
    if exp.failed_rooms is None:
        if failures:
            problems.append(
                f"{len(failures)} room(s) failed, and the scenario has no [expect] failed_rooms "
                "allowing it (without one no room may fail)"
            )
        return problems
    want = set(exp.failed_rooms)
    got = set(failures)
    if got != want:
        problems.append(f"expected failed rooms {_rooms(want)}, got {_rooms(got)}")
    if exp.reason_contains:
        wrong = {
            room: reason for room, reason in failures.items() if exp.reason_contains not in reason
        }
        if wrong:
            problems.append(
                f"{len(wrong)} failed room(s) with a reason not containing {exp.reason_contains!r}, "
                f"e.g. room {min(wrong)}: {_clip(wrong[min(wrong)])!r}"
            )
    if any(room >= requests for room in want):
        problems.append(f"[expect] names rooms beyond the {requests} requests of the workload")
    return problems


def _rooms(rooms: set[int]) -> str:
    """Room ids as a list, shortened when long (a 10,000-room run)."""
    ids = sorted(rooms)
    if len(ids) <= 2 * ROOMS_SHOWN:
        return str(ids)
    return f"[{', '.join(map(str, ids[:ROOMS_SHOWN]))}, ...] ({len(ids)} rooms)"


def print_outcome(console: Console, problems: list[str], failures: dict[int, str]) -> int:
    """Print the problems (then the failed rooms by reason); 1 if there is any, else 0.
    Failures the scenario expects are one green line."""
    for p in problems:  # one line each, whatever the terminal's width (logs grep well)
        console.print(
            f"[bold red]unexpected outcome:[/] {escape(p)}", highlight=False, soft_wrap=True
        )
    if problems:
        for line in format_failure_groups(failures):
            console.print(line, markup=False, highlight=False, soft_wrap=True)
        return 1
    if failures:
        console.print(
            f"[green]expected outcome:[/] {len(failures)} room(s) failed as the scenario's "
            "\\[expect] says",
            highlight=False,
        )
    return 0
