"""The target of a sweep (`kvstage sweep ... --target 'transfer_latency_s.p99<0.5'`).

For each setting of the other varied keys: the smallest value of the *first* varied
key whose point meets the target -- numerically smallest for numbers, else the first
in the order given. A point meets the target when it ran ("ok"), its metric is a
number satisfying the comparison and, unless the target is about `requests_done` /
`requests_failed` themselves, none of its requests failed (a latency percentile over
the few requests that survived a timeout is not a pass). "None meets it" is a valid
answer. No monotonicity is assumed: every value is simulated and the smallest passing
one is reported.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvstage.sweep import STATUS_OK, SweepError, SweepResult, check_metric

__all__ = ["Target", "is_numeric", "parse_target", "target_answers", "target_report", "value_order"]

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
        x = row.get(self.metric)
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
    "metric_value": the metric at that point (None if none meets it), "meets": bool}.
    """
    first, others = result.varies[0], result.varies[1:]
    answers = []
    for combo in itertools.product(*(range(len(v.values)) for v in others)):
        settings = {v.key: v.values[j] for v, j in zip(others, combo, strict=True)}
        best = None
        for i in value_order(first.values):
            row = result.row_at((i, *combo))
            if target.met_by(row):
                best = row
                break
        answers.append(
            {
                "settings": settings,
                "smallest": best[first.key] if best else None,
                "metric_value": best[target.metric] if best else None,
                "meets": best is not None,
            }
        )
    return answers


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
