"""Capacity planning: the fewest GPUs that meet a scenario's SLOs at its load.

`kvstage plan SCENARIO` takes the scenario's model, links profile, workload (rate or
trace) and [slo] targets, and searches a grid of cluster shapes -- prefill TP, decode
TP, prefill and decode instance counts, staging pool per decode rank -- for the
configuration with the fewest GPUs (instances x TP on both sides) whose SLO
attainment (`kvstage.metrics.rooms.slo_figures`: share of requests that finished and met
every target) reaches a threshold, 0.9 by default: "TTFT p90 < 2 s" is a 2 s TTFT
target met by at least 90% of the requests. Ties at the same GPU count go to the
highest goodput per GPU.

Candidates are the sweep's points (`kvstage.explore.sweep.plan_points`): a combination the
scenario's own validation rejects (a TP pair the rank mapping cannot express, a pool
smaller than one chunk, decode GPU memory that cannot hold the weights) is skipped
before anything runs, with the scenario's reason, as is one above `--max-gpus`.

The search (`run_plan`) simulates GPU counts in increasing order, a whole count at a
time (several counts per batch while there are fewer points than workers), each point
with `kvstage.explore.sweep.run_point` on one executor (kvstage/explore/executor.py: local
process pool or Ray) kept for the whole search. It stops once a count has a
configuration that meets the SLO and the next count above it has been simulated too: the winner is exact (every smaller count was simulated in
full), and the one count more puts on the front what one step up buys. Counts above
it are "not run". `exhaustive=True` simulates every candidate.

The Pareto front is over the simulated points: goodput per GPU (higher is better)
against TTFT p90 (lower is better); a point is on it when no other point is at least
as good in both and better in one.
"""

from __future__ import annotations

import csv
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstage.explore.executor import Executor, ExploreError
from kvstage.explore.figures import front_figure, shape
from kvstage.explore.sweep import (
    STATUS_ERROR,
    STATUS_OK,
    Point,
    SweepError,
    Vary,
    base_data,
    parse_vary,
    plan_points,
    run_point,
    write_json,
)
from kvstage.shared.scenario import DecodeConfig
from kvstage.shared.scenario.slo_table import SLO_METRICS

__all__ = [
    "DEFAULT_ATTAINMENT",
    "DEFAULT_GRID",
    "KEYS",
    "PlanError",
    "PlanResult",
    "gpus_of",
    "pareto_front",
    "plan_candidates",
    "run_plan",
    "skip_reasons",
    "verdict",
    "write_plan",
]

# The searched scenario keys and their command-line options.
KEYS = {
    "prefill.tp": "--prefill-tp",
    "decode.tp": "--decode-tp",
    "cluster.prefill_instances": "--prefill-instances",
    "cluster.decode_instances": "--decode-instances",
    "decode.staging_pool_mb": "--pool-mb",
}
# The staging pool defaults to the scenario's own (None here).
DEFAULT_GRID: dict[str, str | None] = {
    "prefill.tp": "1,2,4,8",
    "decode.tp": "1,2,4,8",
    "cluster.prefill_instances": "1,2,4",
    "cluster.decode_instances": "1,2,4",
    "decode.staging_pool_mb": None,
}
DEFAULT_ATTAINMENT = 0.9
# Per simulated point: the figures kept (sweep metric names), then the verdict.
FIGURES = (
    "slo_attainment",
    "goodput_rps",
    "goodput_per_gpu_rps",
    "ttft_s.p90",
    "tpot_s.p90",
    "offered_load_rps",
    "requests_failed",
)
STATUS_SKIPPED, STATUS_NOT_RUN = "skipped", "not run"
COLUMNS = (
    *KEYS,
    "gpus",
    "status",
    "meets",
    "on_front",
    "winner",
    *FIGURES,
    "bottleneck",
    "bottleneck_why",
    "reason",
)


class PlanError(ExploreError):
    """Bad plan input: one line for a human (the CLI exits 2)."""


def gpus_of(settings: dict[str, Any]) -> int:
    """GPUs of a configuration: instances x TP on both sides."""
    return (
        settings["cluster.prefill_instances"] * settings["prefill.tp"]
        + settings["cluster.decode_instances"] * settings["decode.tp"]
    )


# --------------------------------------------------------------------------- candidates


@dataclass
class Candidates:
    varies: list[Vary]
    points: list[Point]  # valid, within --max-gpus: to search
    skipped: list[dict[str, Any]]  # rows: invalid or over --max-gpus, with the reason
    targets: dict[str, float]


def _option_error(message: str) -> str:
    """A sweep message about `--vary KEY...` told in the plan's option names."""
    for key, option in KEYS.items():
        message = re.sub(rf"--vary '?{re.escape(key)}(=[^' :]*)?'?", option, message)
    return message


def _targets(data: dict[str, Any], path: Path) -> dict[str, float]:
    slo = data.get("slo") if isinstance(data.get("slo"), dict) else {}
    targets = {k: slo[k] for k in SLO_METRICS if slo.get(k) is not None}
    if not targets:
        raise PlanError(
            f"{path} has no [slo] targets to plan for: add an [slo] table with ttft_s, tpot_s and/or "
            "e2e_s in seconds (e.g. [slo] ttft_s = 2, tpot_s = 0.05) or --set slo.ttft_s=2"
        )
    return targets


def plan_candidates(
    path: str | Path,
    grid: dict[str, str | None],
    sets: Sequence[str] = (),
    max_gpus: int | None = None,
) -> Candidates:
    """Every configuration of `grid` (key -> "v1,v2,..."; None for the pool: the
    scenario's own), validated by the scenario; PlanError for bad input."""
    path = Path(path)
    try:
        data = base_data(path, sets)
    except SweepError as exc:
        raise PlanError(str(exc)) from None
    targets = _targets(data, path)
    if max_gpus is not None and max_gpus < 2:
        raise PlanError(
            f"--max-gpus {max_gpus}: a plan needs at least 2 GPUs (one prefill, one decode)"
        )
    specs = dict(grid)
    if specs.get("decode.staging_pool_mb") is None:
        pool = (data.get("decode") or {}).get(
            "staging_pool_mb", DecodeConfig.model_fields["staging_pool_mb"].default
        )
        specs["decode.staging_pool_mb"] = str(pool)
    try:
        varies = [parse_vary(f"{key}={specs[key]}") for key in KEYS]
        points = plan_points(path, varies, list(sets))
    except SweepError as exc:
        raise PlanError(_option_error(str(exc))) from None
    keep, skipped = [], []
    for p in points:
        gpus = gpus_of(p.settings)
        if p.scenario is None:
            skipped.append(_row(p.settings, STATUS_SKIPPED, reason=p.reason))
        elif max_gpus is not None and gpus > max_gpus:
            skipped.append(
                _row(p.settings, STATUS_SKIPPED, reason=f"{gpus} GPUs: over --max-gpus {max_gpus}")
            )
        else:
            keep.append(p)
    if not keep:
        raise PlanError(
            f"no configuration to simulate: every one of the {len(points)} was skipped "
            f"(e.g. {shape(skipped[0])}: {skipped[0]['reason']})"
        )
    return Candidates(varies, keep, skipped, targets)


def _row(settings: dict[str, Any], status: str, **extra: Any) -> dict[str, Any]:
    row: dict[str, Any] = dict.fromkeys(COLUMNS)
    row.update(settings)
    row.update(gpus=gpus_of(settings), status=status, meets=False, on_front=False, winner=False)
    row.update(extra)
    return row


def skip_reasons(skipped: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The skipped configurations grouped by reason (numbers aside): count, an example
    configuration and its reason, the most frequent first."""
    groups: dict[str, dict[str, Any]] = {}
    for row in skipped:
        key = re.sub(r"\d+(\.\d+)?", "#", row["reason"] or "")
        g = groups.setdefault(key, {"count": 0, "example": shape(row), "reason": row["reason"]})
        g["count"] += 1
    return sorted(groups.values(), key=lambda g: -g["count"])


# --------------------------------------------------------------------------- search


@dataclass
class PlanResult:
    rows: list[dict[str, Any]]  # every candidate: simulated, skipped or not run
    targets: dict[str, float]
    attainment: float
    backend: str
    wall_s: float
    stopped_at: int | None  # the GPU count the search stopped after (None: it ran them all)
    winner: dict[str, Any] | None = None
    best: dict[str, Any] | None = None  # with no winner: the highest attainment
    front: list[dict[str, Any]] = field(default_factory=list)

    @property
    def simulated(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["status"] in (STATUS_OK, STATUS_ERROR)]

    def count(self, status: str) -> int:
        return sum(1 for r in self.rows if r["status"] == status)

    @property
    def max_gpus_run(self) -> int:
        return max((r["gpus"] for r in self.simulated), default=0)


def _levels(points: Sequence[Point]) -> list[list[Point]]:
    by: dict[int, list[Point]] = {}
    for p in points:
        by.setdefault(gpus_of(p.settings), []).append(p)
    return [by[g] for g in sorted(by)]


def _meets(row: dict[str, Any], attainment: float) -> bool:
    return row["status"] == STATUS_OK and (row["slo_attainment"] or 0.0) >= attainment - 1e-12


def _next_batch(levels: list[list[Point]], start: int, workers: int, found: bool) -> int:
    """The index after the last level of the next batch: whole GPU counts, several while
    there are fewer points than workers; once a count meets the SLO, only the next one."""
    end, size = start, 0
    while end < len(levels) and (size == 0 or (size < workers and not found)):
        size += len(levels[end])
        end += 1
    return end


def run_plan(
    path: str | Path,
    cands: Candidates,
    *,
    attainment: float = DEFAULT_ATTAINMENT,
    workers: int | None = None,
    ray_address: str | None = None,
    exhaustive: bool = False,
    on_point: Callable[[dict[str, Any]], None] | None = None,
) -> PlanResult:
    """Search `cands` (see the module docstring); `on_point(row)` as each point finishes."""
    if not 0 < attainment <= 1:
        raise PlanError(f"--attainment {attainment}: a share of the requests in (0, 1], e.g. 0.9")
    levels = _levels(cands.points)
    settings = {p.index: p.settings for p in cands.points}

    got: dict[int, dict[str, Any]] = {}  # point index -> its run_point row

    def on_row(index: int, row: dict[str, Any]) -> None:
        got[index] = row
        if on_point is not None:
            on_point(_point_row(settings[index], row, attainment))

    done: list[dict[str, Any]] = []
    found, stopped_at, i = None, None, 0
    t0 = time.perf_counter()
    # one executor for the whole search: its workers stay between the (many, small) batches
    with Executor(workers, ray_address) as runner:
        while i < len(levels):
            end = (
                len(levels)
                if exhaustive
                else _next_batch(levels, i, runner.nworkers, found is not None)
            )
            batch = [p for level in levels[i:end] for p in level]
            runner.run(run_point, [(p.index, (p.scenario,)) for p in batch], on_row)
            rows = [got[p.index] for p in batch]
            done += [
                _point_row(p.settings, row, attainment) for p, row in zip(batch, rows, strict=True)
            ]
            i = end
            meeting = [r["gpus"] for r in done if r["meets"]]
            found = min(meeting) if meeting else None
            if found is not None and any(r["gpus"] > found for r in done):
                stopped_at = max(r["gpus"] for r in done)
                break
    wall = time.perf_counter() - t0
    not_run = [
        _row(
            p.settings, STATUS_NOT_RUN, reason=f"above {stopped_at} GPUs, where the search stopped"
        )
        for level in levels[i:]
        for p in level
    ]
    result = PlanResult(
        done + not_run + cands.skipped,
        cands.targets,
        attainment,
        runner.backend,
        wall,
        stopped_at if not_run else None,
    )
    _judge(result)
    return result


def _point_row(settings: dict[str, Any], got: dict[str, Any], attainment: float) -> dict[str, Any]:
    row = _row(
        settings,
        got["status"],
        **{k: got.get(k) for k in (*FIGURES, "bottleneck", "bottleneck_why", "reason")},
    )
    row["meets"] = _meets(row, attainment)
    return row


def pareto_front(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows no other row beats: at least as much goodput per GPU and no more TTFT
    p90, better in one. Only simulated rows with both figures; sorted by TTFT p90."""
    pts = [
        r
        for r in rows
        if r["status"] == STATUS_OK
        and r["goodput_per_gpu_rps"] is not None
        and r["ttft_s.p90"] is not None
    ]

    def beats(a: dict[str, Any], b: dict[str, Any]) -> bool:
        ga, gb, ta, tb = (
            a["goodput_per_gpu_rps"],
            b["goodput_per_gpu_rps"],
            a["ttft_s.p90"],
            b["ttft_s.p90"],
        )
        return ga >= gb and ta <= tb and (ga > gb or ta < tb)

    front = [r for r in pts if not any(beats(o, r) for o in pts)]
    return sorted(front, key=lambda r: (r["ttft_s.p90"], -r["goodput_per_gpu_rps"]))


def _judge(result: PlanResult) -> None:
    """Mark the front and pick the winner (fewest GPUs that meets; ties: most goodput
    per GPU) or, without one, the best point (highest attainment, then fewest GPUs)."""
    result.front = pareto_front(result.rows)
    for r in result.front:
        r["on_front"] = True
    meeting = [r for r in result.rows if r["meets"]]
    if meeting:
        result.winner = min(meeting, key=lambda r: (r["gpus"], -(r["goodput_per_gpu_rps"] or 0.0)))
        result.winner["winner"] = True
        return
    ok = [r for r in result.rows if r["status"] == STATUS_OK]
    if ok:
        result.best = max(
            ok,
            key=lambda r: (r["slo_attainment"] or 0.0, -r["gpus"], r["goodput_per_gpu_rps"] or 0.0),
        )


def verdict(result: PlanResult) -> str:
    """One line: the winner with its bottleneck, or why none meets the SLO."""
    w = result.winner
    if w is not None:
        return (
            f"winner: {w['gpus']} GPUs, {shape(w)}: attainment {w['slo_attainment']:.0%}, "
            f"goodput {w['goodput_rps']:.3g} req/s ({w['goodput_per_gpu_rps']:.3g} per GPU), "
            f"TTFT p90 {_secs(w['ttft_s.p90'])}, TPOT p90 {_secs(w['tpot_s.p90'])}; "
            f"bottleneck: {w['bottleneck']} ({w['bottleneck_why']})"
        )
    b = result.best
    line = f"no configuration meets the SLO up to {result.max_gpus_run} GPUs"
    if b is None:
        return line + "; no configuration simulated successfully"
    return (
        f"{line}; the best was {b['gpus']} GPUs, {shape(b)} (attainment {b['slo_attainment'] or 0:.0%}), "
        f"limited by {b['bottleneck']}: {b['bottleneck_why']}"
    )


def _secs(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"


# --------------------------------------------------------------------------- files


def _csv_cell(v: Any) -> Any:
    if v is None:
        return ""
    return ("true" if v else "false") if isinstance(v, bool) else v


def write_plan(result: PlanResult, out_dir: Path, meta: dict[str, Any]) -> dict[str, Path]:
    """plan.csv (every candidate), plan.json (meta, verdict, front, winner, every row)
    and plan_front.png; returns them by name."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = sorted(result.rows, key=lambda r: (r["gpus"], [str(r[k]) for k in KEYS]))
    csv_path = out_dir / "plan.csv"
    with csv_path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(COLUMNS)
        for row in rows:
            w.writerow([_csv_cell(row[c]) for c in COLUMNS])
    doc = {
        **meta,
        "slo": result.targets,
        "attainment": result.attainment,
        "backend": result.backend,
        "wall_s": result.wall_s,
        "stopped_at_gpus": result.stopped_at,
        "counts": {
            s: result.count(s) for s in (STATUS_OK, STATUS_ERROR, STATUS_SKIPPED, STATUS_NOT_RUN)
        },
        "verdict": verdict(result),
        "winner": result.winner,
        "best": result.best,
        "front": result.front,
        "skipped": skip_reasons([r for r in rows if r["status"] == STATUS_SKIPPED]),
        "points": rows,
    }
    files = {"csv": csv_path, "json": write_json(out_dir / "plan.json", doc)}
    fig = front_figure(doc)
    fig.savefig(out_dir / "plan_front.png", dpi=110)
    files["png"] = out_dir / "plan_front.png"
    return files
