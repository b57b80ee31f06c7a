"""The target of a sweep (`kvstage sweep ... --target 'transfer_latency_s.p99<0.5'`).

For each setting of the other varied keys: the smallest value of the *first* varied
key whose point meets the target -- numerically smallest for numbers, else the first
in the order given. A point meets the target when it ran ("ok"), its metric is a
number satisfying the comparison and, unless the target is about `requests_done` /
`requests_failed` themselves, none of its requests failed (a latency percentile over
the few requests that survived a timeout is not a pass). "None meets it" is a valid
answer, and it comes with the numbers that say why (`why_unmet`): e.g. that
transfer_latency_s contains the prefill forward and prefill_compute_s alone misses the
target. No monotonicity is assumed: every value is simulated and the smallest passing
one is reported.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvstage.explore.sweep import STATUS_OK, SweepError, SweepResult, check_metric, format_metric

__all__ = [
    "Target",
    "is_numeric",
    "parse_target",
    "target_answers",
    "target_report",
    "value_order",
    "why_unmet",
]

_TARGET_RE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_.]*)\s*(<=|>=|<|>)\s*(\S+)\s*$")
_OPS: dict[str, Callable[[float, float], bool]] = {
    "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b,
    ">": lambda a, b: a > b,
    ">=": lambda a, b: a >= b,
}


@dataclass(frozen=True)
class Target:
    """`METRIC<VALUE` (or <=, >, >=)."""

    metric: str
    op: str
    value: float

    @property
    def text(self) -> str:
        return f"{self.metric}{self.op}{self.value:g}"

    def met_by(self, row: dict[str, Any]) -> bool:
        if row.get("status") != STATUS_OK:
            return False
        if self.metric not in ("requests_done", "requests_failed") and row.get("requests_failed"):
            return False
        return self.value_passes(row)

    def value_passes(self, row: dict[str, Any], metric: str | None = None) -> bool:
        """The comparison alone, on `metric` (default: the target's) of `row`."""
        x = row.get(metric or self.metric)
        if x is None or (isinstance(x, float) and not math.isfinite(x)):
            return False
        return _OPS[self.op](float(x), self.value)


def parse_target(text: str) -> Target:
    m = _TARGET_RE.match(text)
    if not m:
        raise SweepError(
            f"--target {text!r}: expected METRIC<VALUE (or <=, >, >=), "
            "e.g. --target 'transfer_latency_s.p99<0.5'"
        )
    metric, op, raw = m.groups()
    check_metric(metric, "--target")
    try:
        value = float(raw)
    except ValueError:
        raise SweepError(f"--target {text!r}: {raw!r} is not a number") from None
    if not math.isfinite(value):
        raise SweepError(f"--target {text!r}: the value must be a finite number")
    return Target(metric, op, value)


# --------------------------------------------------------------------------- the answer


def is_numeric(values: Sequence[Any]) -> bool:
    """All numbers (bools are not)."""
    return all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)


def value_order(values: Sequence[Any]) -> list[int]:
    """Indices of `values`, smallest first (numbers), else as given."""
    if is_numeric(values):
        return sorted(range(len(values)), key=lambda i: values[i])
    return list(range(len(values)))


def target_answers(result: SweepResult, target: Target) -> list[dict[str, Any]]:
    """Per setting of the other varied keys: the smallest first-key value meeting target.

    Each answer: {"settings": {other key: value}, "smallest": value or None,
    "metric_value": the metric at that point (None if none meets it), "meets": bool},
    and when none meets it "why": the numbers that say why (`why_unmet`).
    """
    first, others = result.varies[0], result.varies[1:]
    answers = []
    for combo in itertools.product(*(range(len(v.values)) for v in others)):
        settings = {v.key: v.values[j] for v, j in zip(others, combo, strict=True)}
        rows = [result.row_at((i, *combo)) for i in value_order(first.values)]
        best = next((row for row in rows if target.met_by(row)), None)
        answer = {
            "settings": settings,
            "smallest": best[first.key] if best else None,
            "metric_value": best[target.metric] if best else None,
            "meets": best is not None,
        }
        if best is None:
            answer["why"] = why_unmet(rows, target, first.key)
        answers.append(answer)
    return answers


# What a latency is made of, per request (kvstage/metrics/rooms.py): each part is <= the
# whole for every request, so a part's percentile is a lower bound of the whole's.
_PARTS: dict[str, tuple[tuple[str, str], ...]] = {
    "transfer_latency_s": (
        ("prefill_compute_s", "the prefill forward"),
        ("kv_transfer_latency_s", ""),
    ),
    "ttft_s": (
        ("queueing_s", "the queueing before the prefill"),
        ("prefill_compute_s", "the prefill forward"),
        ("decode_admission_wait_s", "the wait for decode KV pages"),
        ("kv_transfer_latency_s", ""),
    ),
    "kv_transfer_latency_s": (("staging_wait_s", "the wait for the staging watermark"),),
    "e2e_s": (
        ("ttft_s", "the time to the first token"),
        ("queueing_s", "the queueing before the prefill"),
        ("prefill_compute_s", "the prefill forward"),
    ),
}
# What a part is, shown beside its value.
_MEANS = {"kv_transfer_latency_s": "the part the request waits for after its forward"}
# Figures that exist only with [slo] targets in the scenario.
_SLO_ONLY = ("slo_attainment", "goodput_rps", "goodput_per_gpu_rps")


def _at(row: dict[str, Any], key: str) -> str:
    return f"{key}={row[key]}"


def why_unmet(rows: Sequence[dict[str, Any]], target: Target, key: str) -> str:
    """Why no point of `rows` (one setting of the other keys) meets `target`, in numbers:
    points that did not run; points that meet it only over the requests that survived;
    the best value reached and, for a latency, its parts there -- naming a part that
    alone misses the target at every point (e.g. prefill compute inside transfer_latency_s).
    """
    ran = [r for r in rows if r.get("status") == STATUS_OK]
    if not ran:
        return f"no point ran ({', '.join(sorted({str(r.get('status')) for r in rows}))})"
    notes = []
    survivors = [r for r in ran if r.get("requests_failed") and target.value_passes(r)]
    if survivors and target.metric not in ("requests_done", "requests_failed"):
        r = min(survivors, key=lambda row: row["requests_failed"])
        notes.append(
            f"{len(survivors)} point(s) meet it only over the requests that survived "
            f"(at {_at(r, key)}: {r['requests_failed']} failed, {r['requests_done']} done)"
        )
    valued = [r for r in ran if isinstance(r.get(target.metric), int | float)]
    if not valued:
        hint = (
            " (give [slo] targets, e.g. --set slo.ttft_s=2)" if target.metric in _SLO_ONLY else ""
        )
        return "; ".join(notes or [f"no point has a value of {target.metric}{hint}"])
    sign = 1 if target.op in ("<", "<=") else -1
    best = min(valued, key=lambda r: sign * float(r[target.metric]))
    base, _, stat = target.metric.partition(".")
    text = f"{target.metric} is at best {format_metric(target.metric, best[target.metric])} ({_at(best, key)})"
    parts = _PARTS.get(base, ()) if sign == 1 else ()
    shown = []
    for part, what in parts:
        name = f"{part}.{stat}"
        value = best.get(name)
        if value is None:
            continue
        means = f" ({_MEANS[part]})" if part in _MEANS else ""
        shown.append(f"{name} {format_metric(name, value)}{means}")
        if what and all(not target.value_passes(r, name) for r in ran if r.get(name) is not None):
            text += f"; it includes {what}: {name} alone is {format_metric(name, value)} there and misses the target at every point"
    if shown:
        text += f" (there: {', '.join(shown)})"
    if best.get("bottleneck_why"):  # the verdict at the best point (kvstage/metrics/bottleneck.py)
        text += f"; what limits it there: {best['bottleneck_why']}"
    notes.append(text)
    return "; ".join(notes)


def target_report(result: SweepResult, target: Target) -> dict[str, Any]:
    return {
        "target": target.text,
        "metric": target.metric,
        "op": target.op,
        "value": target.value,
        "key": result.varies[0].key,
        "rule": (
            f"smallest {result.varies[0].key} whose point ran, has no failed request"
            f" and {target.text}"
            if target.metric not in ("requests_done", "requests_failed")
            else f"smallest {result.varies[0].key} whose point ran and has {target.text}"
        ),
        "answers": target_answers(result, target),
    }
