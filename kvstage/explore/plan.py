"""Capacity planning: the fewest GPUs that meet a scenario's SLOs at its load.

`kvstage plan SCENARIO` takes the scenario's model, links profile, workload (rate or
trace) and [slo] targets, and searches a grid of cluster shapes -- prefill TP, decode
TP, prefill and decode instance counts, staging pool per decode rank, chunked prefill
size, router, transfer path, expert-parallel size per side, the longest prompt
prefilled on its decode instance (conditional disaggregation,
`cluster.max_local_prefill_length`; "off": none) and the prefill's pipeline stages
(`prefill.pp`) (`KEYS`; the last eight default to the scenario's own; an EP above the
TP is DP attention, ep / tp instances sharing one expert group)
-- for the configuration with the fewest GPUs (instances x TP on both sides, x PP on
the prefill's) whose SLO
attainment over the steady window (`kvstage.metrics.steady`: share of requests that
finished and met every target) reaches a threshold, 0.9 by default: "TTFT p90 < 2 s"
is a 2 s TTFT target met by at least 90% of the requests. Ties at the same GPU count
go to the highest goodput per GPU, then the lowest TTFT (`winner_key`).

Candidates are the sweep's points (`kvstage.explore.sweep.plan_points`). Skipped before
anything runs, with the reason and what skipped it (`skipped_by`): a combination the
scenario's own validation rejects ("scenario": a TP pair the rank mapping cannot
express, a pool smaller than one chunk, decode memory that cannot hold the weights),
one above `--max-gpus` ("max-gpus"), with `screen` one whose offered load exceeds
a stage's capacity in the bottleneck model ("capacity": kvstage/explore/screen.py),
and one that passes all of those but that the simulator cannot run ("simulation":
prefill pipeline stages under the cpu-loop host model or an [engine]; `unsimulated`).

The search (`run_plan`) runs every simulation on one executor (kvstage/explore/
executor.py: local process pool or Ray) kept for the whole search:

* "halving": successive halving (kvstage/explore/halving.py): every configuration on a
  short window (its length from the utilization the screen gives its busiest stage),
  the best third on to a window three times longer, until the survivors run the whole
  workload; the others are "pruned" with their last window's figures;
* "levels": GPU counts in increasing order, a whole count at a time (several counts
  per batch while there are fewer points than workers), stopping once a count has a
  configuration that meets the SLO and the next count above it has been simulated
  too: the winner is exact (every smaller count was simulated in full), and the one
  count more puts on the front what one step up buys; counts above it are "not run";
* "exhaustive": every candidate on the whole workload.

The Pareto front is over the points simulated on the whole workload: GPUs, goodput per
GPU (higher is better) and TTFT at the target quantile (lower is better); a point is
on it when no other point beats it beyond the 95% intervals (`beats`). Costs
(kvstage/explore/costs.py) come from `gpu_costs`, a price per GPU-hour by GPU name.
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

from kvstage.explore.colocated import (
    ColocatedCandidates,
    compare,
    search_colocated,
    write_colocated_csv,
)
from kvstage.explore.costs import COST_COLUMNS, add_costs
from kvstage.explore.executor import Executor, ExploreError
from kvstage.explore.figures import front_figure, shape
from kvstage.explore.halving import first_length, schedule, successive_halving
from kvstage.explore.plan_point import figure_columns, gpus_of, run_plan_point
from kvstage.explore.screen import capacity, overload, workload_load
from kvstage.explore.sweep import (
    STATUS_ERROR,
    STATUS_OK,
    Point,
    SweepError,
    Vary,
    base_data,
    parse_vary,
    plan_points,
    write_json,
)
from kvstage.fmt import csv_cell, num, secs, share
from kvstage.metrics.steady import quantile_name
from kvstage.shared.cluster import simulated_pipeline_problem
from kvstage.shared.scenario import DecodeConfig
from kvstage.shared.scenario.cluster_table import ClusterConfig
from kvstage.shared.scenario.schema import PrefillConfig, TransferConfig
from kvstage.shared.scenario.slo_table import SLO_METRICS

__all__ = [
    "DEFAULT_ATTAINMENT",
    "DEFAULT_GRID",
    "KEYS",
    "PlanError",
    "PlanResult",
    "beats",
    "columns",
    "judge",
    "pareto_front",
    "plan_candidates",
    "run_plan",
    "skip_reasons",
    "verdict",
    "warnings",
    "write_plan",
]

# The searched scenario keys and their command-line options.
KEYS = {
    "prefill.tp": "--prefill-tp",
    "decode.tp": "--decode-tp",
    "cluster.prefill_instances": "--prefill-instances",
    "cluster.decode_instances": "--decode-instances",
    "decode.staging_pool_mb": "--pool-mb",
    "prefill.chunked_prefill_size": "--chunk",
    "cluster.router": "--router",
    "transfer.path": "--path",
    "prefill.ep": "--prefill-ep",
    "decode.ep": "--decode-ep",
    "cluster.max_local_prefill_length": "--max-local-prefill",
    "prefill.pp": "--prefill-pp",
}
# The axes that default to the scenario's own value (None here), and where that
# value's default lives when the scenario does not set it.
OWN_DEFAULT = {
    "decode.staging_pool_mb": (DecodeConfig, "staging_pool_mb"),
    "prefill.chunked_prefill_size": (PrefillConfig, "chunked_prefill_size"),
    "cluster.router": (ClusterConfig, "router"),
    "transfer.path": (TransferConfig, "path"),
    "prefill.ep": (PrefillConfig, "ep"),
    "decode.ep": (DecodeConfig, "ep"),
    "cluster.max_local_prefill_length": (ClusterConfig, "max_local_prefill_length"),
    "prefill.pp": (PrefillConfig, "pp"),
}
DEFAULT_GRID: dict[str, str | None] = {
    "prefill.tp": "1,2,4,8",
    "decode.tp": "1,2,4,8",
    "cluster.prefill_instances": "1,2,3,4,6",
    "cluster.decode_instances": "1,2,3,4,6",
    **dict.fromkeys(OWN_DEFAULT),
}
SEARCHES = ("halving", "levels", "exhaustive")
DEFAULT_ATTAINMENT = 0.9
STATUS_SKIPPED, STATUS_NOT_RUN, STATUS_PRUNED = "skipped", "not run", "pruned"
STATUSES = (STATUS_OK, STATUS_ERROR, STATUS_PRUNED, STATUS_SKIPPED, STATUS_NOT_RUN)
# A winner whose busiest stage runs above this share of its capacity is warned about:
# queueing delay grows as 1 / (1 - utilization), so 85% leaves little room for a burst.
BUSY_WARNING = 0.85
# Requests beyond the target quantile the steady window should hold for the quantile to
# mean something (10 beyond a p99: 1,000 requests).
MIN_TAIL = 10


def columns(attainment: float) -> tuple[str, ...]:
    """plan.csv's columns."""
    return (
        *KEYS,
        "gpus",
        "prefill_gpu",
        "decode_gpu",
        "status",
        "meets",
        "on_front",
        "winner",
        "rung",
        *figure_columns(attainment),
        *COST_COLUMNS,
        "bottleneck",
        "bottleneck_why",
        "skipped_by",
        "reason",
    )


class PlanError(ExploreError):
    """Bad plan input: one line for a human (the CLI exits 2)."""


# --------------------------------------------------------------------------- candidates


@dataclass
class Candidates:
    varies: list[Vary]
    points: list[Point]  # valid, within --max-gpus: to search
    skipped: list[dict[str, Any]]  # rows: invalid, over --max-gpus or overloaded, with the reason
    targets: dict[str, float]
    # per point index: the screen's busiest stage (utilization, servers) and the
    # requests of the whole workload (kvstage/explore/screen.py)
    busiest: dict[int, tuple[float | None, int]] = field(default_factory=dict)
    full: dict[int, int] = field(default_factory=dict)


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
    screen: bool = True,
) -> Candidates:
    """Every configuration of `grid` (key -> "v1,v2,..."; None for the pool, chunk,
    router and path: the scenario's own), validated by the scenario, and with `screen`
    those the bottleneck model's capacities show overloaded skipped
    (kvstage/explore/screen.py); PlanError for bad input."""
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
    specs = {**dict.fromkeys(KEYS), **grid}
    for key, (table, name) in OWN_DEFAULT.items():
        if specs.get(key) is None:
            section = data.get(key.split(".")[0]) or {}
            own = section.get(name, table.model_fields[name].default)
            specs[key] = "off" if own is None else str(own)  # None: the key's "off"
    try:
        varies = [parse_vary(f"{key}={specs[key]}") for key in KEYS]
        points = plan_points(path, varies, list(sets))
    except SweepError as exc:
        raise PlanError(_option_error(str(exc))) from None
    keep, skipped = [], []
    busiest: dict[int, tuple[float | None, int]] = {}
    full: dict[int, int] = {}
    for p in points:
        gpus = gpus_of(p.settings)
        why = p.reason if p.scenario is None else moe_problem(p.scenario)
        if why is not None:
            skipped.append(_row(p.settings, STATUS_SKIPPED, reason=why, skipped_by="scenario"))
            continue
        if max_gpus is not None and gpus > max_gpus:
            skipped.append(
                _row(
                    p.settings,
                    STATUS_SKIPPED,
                    reason=f"{gpus} GPUs: over --max-gpus {max_gpus}",
                    skipped_by="max-gpus",
                )
            )
            continue
        stages = capacity(p.scenario)
        why = overload(stages) if screen else None
        if why is not None:
            skipped.append(_row(p.settings, STATUS_SKIPPED, reason=why, skipped_by="capacity"))
            continue
        top = max(stages.values(), key=lambda v: v["utilization"], default=None)
        why = unsimulated(p.scenario, stages, top)
        if why is not None:
            skipped.append(_row(p.settings, STATUS_SKIPPED, reason=why, skipped_by="simulation"))
            continue
        busiest[p.index] = (None, 1) if top is None else (top["utilization"], top["servers"])
        full[p.index] = workload_load(p.scenario)["requests"]
        keep.append(p)
    if not keep:  # the example: one that fits but is not simulated, where there is one
        example = next((r for r in skipped if r["skipped_by"] == "simulation"), skipped[0])
        raise PlanError(
            f"no configuration to simulate: every one of the {len(points)} was skipped "
            f"(e.g. {shape(example)}: {example['reason']})"
        )
    return Candidates(varies, keep, skipped, targets, busiest, full)


def unsimulated(s: Any, stages: dict[str, Any], top: dict[str, Any] | None) -> str | None:
    """Why a configuration that fits and passes the screen is not simulated, with what
    the screen says of it, else None: prefill pipeline stages under the cpu-loop host
    model or an [engine], which do not run them (shared/cluster.py
    `simulated_pipeline_problem`)."""
    why = simulated_pipeline_problem(s)
    if why is None:
        return None
    busiest = next((k for k, v in stages.items() if v is top), None)
    screened = f"{busiest} at {share(top['utilization'])} of capacity" if top else "no rate"
    return f"fits and screens ({screened}) but is not simulated: {why}"


def moe_problem(s: Any) -> str | None:
    """Why a MoE layout (`prefill.ep`, `decode.ep`) does not apply, else None: expert
    parallelism on a model without experts, or DP attention (ep > tp: ep / tp instances
    share one expert group) over instances that do not fill whole groups."""
    c = s.cluster
    for side, count in (("prefill", c.prefill_instances), ("decode", c.decode_instances)):
        cfg = getattr(s, side)
        if cfg.ep > 1 and not s.model.experts:
            return f"{side}.ep {cfg.ep}: the model has no experts (model.experts = 0)"
        group = cfg.ep // cfg.tp if cfg.ep > cfg.tp else 1
        if count % group:
            return (
                f"{count} {side} instance(s) of TP{cfg.tp} do not fill whole expert groups "
                f"of {group} ({side}.ep {cfg.ep} / tp {cfg.tp})"
            )
    return None


def _row(settings: dict[str, Any], status: str, **extra: Any) -> dict[str, Any]:
    row: dict[str, Any] = {}
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
    search: str = "levels"
    rungs: list[tuple[int, int]] = field(default_factory=list)  # (simulations, requests in all)
    winner: dict[str, Any] | None = None
    best: dict[str, Any] | None = None  # with no winner: the highest attainment
    front: list[dict[str, Any]] = field(default_factory=list)
    # the colocated baseline (kvstage/explore/colocated.py): its rows, the best that
    # meets the SLO, and whether disaggregation pays against it (`compare`)
    colocated: list[dict[str, Any]] = field(default_factory=list)
    colocated_best: dict[str, Any] | None = None
    comparison: dict[str, Any] | None = None

    @property
    def qname(self) -> str:
        """The quantile the attainment names (0.99: p99)."""
        return quantile_name(self.attainment)

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


def _shortened(scenario: Any, requests: int) -> Any:
    """The scenario on its first `requests` requests (a trace's first rows). Arrivals
    from a trace replay its first `requests` rows and nothing else of it, so only those
    go with the copy to its worker (the whole hour of plan_speed's trace pickled to
    each short run cost about a second at each end)."""
    w = scenario.workload.model_copy(update={"requests": requests})
    if w.arrival == "trace" and w.rows is not None:
        w.keep_rows(w.rows[:requests])
    return scenario.model_copy(update={"workload": w})


class _Search:
    """One executor's runs for a plan: `simulate({index: requests})` -> rows."""

    def __init__(
        self,
        runner: Executor,
        cands: Candidates,
        attainment: float,
        on_point: Callable[[dict[str, Any]], None] | None,
    ) -> None:
        self.runner, self.cands, self.attainment, self.on_point = (
            runner,
            cands,
            attainment,
            on_point,
        )
        self.points = {p.index: p for p in cands.points}
        self.rungs: list[tuple[int, int]] = []  # (simulations, requests simulated in all)

    def simulate(self, lengths: dict[int, int]) -> dict[int, dict[str, Any]]:
        got: dict[int, dict[str, Any]] = {}

        def on_row(index: int, row: dict[str, Any]) -> None:
            got[index] = _point_row(self.points[index].settings, row, self.attainment)
            if self.on_point is not None:
                self.on_point(got[index])

        jobs = []
        for i, n in lengths.items():
            s = self.points[i].scenario
            if n < self.cands.full.get(i, n):
                s = _shortened(s, n)
            jobs.append((i, (s, self.attainment)))
        self.rungs.append((len(jobs), sum(lengths.values())))
        self.runner.run(run_plan_point, jobs, on_row)
        return got

    def full_lengths(self, points: Sequence[Point]) -> dict[int, int]:
        return {p.index: self.cands.full.get(p.index, 0) for p in points}


def first_lengths(cands: Candidates, attainment: float) -> dict[int, int]:
    """Each configuration's first window under successive halving, from its screened
    utilization (`kvstage.explore.halving.first_length`)."""
    out = {}
    for p in cands.points:
        util, servers = cands.busiest.get(p.index, (None, 1))
        full = cands.full.get(p.index, 0)
        out[p.index] = first_length(attainment, util, servers, full) if full else full
    return out


def planned_work(cands: Candidates, attainment: float, search: str) -> tuple[int, int]:
    """(simulations, requests simulated) the search is expected to take, for progress."""
    if search == "halving":
        firsts = first_lengths(cands, attainment)
        rungs = schedule(
            [firsts[p.index] for p in cands.points],
            [cands.full.get(p.index, 0) for p in cands.points],
        )
        return sum(n for n, _ in rungs), sum(r for _, r in rungs)
    return len(cands.points), sum(cands.full.get(p.index, 0) for p in cands.points)


def _levels_search(
    search: _Search, levels: list[list[Point]], exhaustive: bool
) -> tuple[list[dict[str, Any]], int, int | None]:
    """Whole GPU counts, smallest first (module docstring); (rows, levels run, stop)."""
    done: list[dict[str, Any]] = []
    found, stopped_at, i = None, None, 0
    while i < len(levels):
        end = (
            len(levels)
            if exhaustive
            else _next_batch(levels, i, search.runner.nworkers, found is not None)
        )
        batch = [p for level in levels[i:end] for p in level]
        got = search.simulate(search.full_lengths(batch))
        done += [got[p.index] for p in batch]
        i = end
        meeting = [r["gpus"] for r in done if r["meets"]]
        found = min(meeting) if meeting else None
        if found is not None and any(r["gpus"] > found for r in done):
            stopped_at = max(r["gpus"] for r in done)
            break
    return done, i, stopped_at


def run_plan(
    path: str | Path,
    cands: Candidates,
    *,
    attainment: float = DEFAULT_ATTAINMENT,
    workers: int | None = None,
    ray_address: str | None = None,
    exhaustive: bool = False,
    search: str = "levels",
    on_point: Callable[[dict[str, Any]], None] | None = None,
    gpu_costs: dict[str, float] | None = None,
    colocated: ColocatedCandidates | None = None,
) -> PlanResult:
    """Search `cands` (see the module docstring): `search` "levels" (GPU counts
    smallest first, stopping one count above the first that meets the SLO),
    "halving" (kvstage/explore/halving.py) or "exhaustive" (every candidate on the
    whole workload; `exhaustive=True` says the same). `on_point(row)` as each
    simulation finishes; `gpu_costs` (GPU name -> cost per GPU-hour) adds the costs;
    `colocated` candidates are searched on the same executor and weighed against the
    disaggregated winner (kvstage/explore/colocated.py)."""
    if not 0 < attainment <= 1:
        raise PlanError(f"--attainment {attainment}: a share of the requests in (0, 1], e.g. 0.9")
    search = "exhaustive" if exhaustive else search
    if search not in SEARCHES:
        raise PlanError(f"--search {search!r}: one of {', '.join(SEARCHES)}")
    levels = _levels(cands.points)
    stopped_at, pruned, i = None, [], len(levels)
    t0 = time.perf_counter()
    # one executor for the whole search: its workers stay between the (many, small) batches
    with Executor(workers, ray_address) as runner:
        run = _Search(runner, cands, attainment, on_point)
        if search == "halving":
            final, cut = successive_halving(
                first_lengths(cands, attainment),
                cands.full,
                run.simulate,
                attainment,
                quantile_name(attainment),
            )
            done = [final[p.index] for p in cands.points if p.index in final]
            pruned = [_pruned(cut[p.index]) for p in cands.points if p.index in cut]
        else:
            done, i, stopped_at = _levels_search(run, levels, search == "exhaustive")
        colo_rows, colo_best = (
            search_colocated(colocated, runner, attainment, quantile_name(attainment))
            if colocated is not None
            else ([], None)
        )
    wall = time.perf_counter() - t0
    not_run = [
        _row(
            p.settings, STATUS_NOT_RUN, reason=f"above {stopped_at} GPUs, where the search stopped"
        )
        for level in levels[i:]
        for p in level
    ]
    result = PlanResult(
        done + pruned + not_run + cands.skipped,
        cands.targets,
        attainment,
        runner.backend,
        wall,
        stopped_at if not_run else None,
        search=search,
        rungs=run.rungs,
    )
    add_costs(result.rows, gpu_costs)
    judge(result)
    if colocated is not None:
        result.colocated, result.colocated_best = colo_rows, colo_best
        result.comparison = compare(result.winner, colo_best, gpu_costs)
    return result


def _pruned(row: dict[str, Any]) -> dict[str, Any]:
    row = dict(row)
    row.update(status=STATUS_PRUNED, meets=False)
    return row


def _point_row(settings: dict[str, Any], got: dict[str, Any], attainment: float) -> dict[str, Any]:
    row = _row(
        settings,
        got["status"],
        **{
            k: got.get(k)
            for k in (
                *figure_columns(attainment),
                "prefill_gpu",
                "decode_gpu",
                "bottleneck",
                "bottleneck_why",
                "reason",
            )
        },
    )
    row["meets"] = _meets(row, attainment)
    return row


def _span(row: dict[str, Any], key: str, scale: float = 1.0) -> tuple[float, float]:
    """A figure's 95% interval (`key_lo`, `key_hi`; the value itself where missing)."""
    v = row[key]
    lo, hi = row.get(f"{key}_lo"), row.get(f"{key}_hi")
    return (v if lo is None else lo) / scale, (v if hi is None else hi) / scale


def beats(a: dict[str, Any], b: dict[str, Any], qname: str = "p90") -> bool:
    """`a` beats `b` (a decision the intervals support): `a` meets the SLO if `b` does,
    uses no more GPUs, is not clearly worse in goodput per GPU or TTFT `qname`, and is
    clearly better (fewer GPUs, or an interval entirely beyond the other's) in one.
    Differences inside the intervals are ties."""
    if b["meets"] and not a["meets"]:
        return False
    if a["gpus"] > b["gpus"]:
        return False
    ttft = f"ttft_s.{qname}"
    ga, gb = _span(a, "goodput_rps", a["gpus"]), _span(b, "goodput_rps", b["gpus"])
    ta, tb = _span(a, ttft), _span(b, ttft)
    if ga[1] < gb[0] or ta[0] > tb[1]:  # clearly worse in one
        return False
    return a["gpus"] < b["gpus"] or ga[0] > gb[1] or ta[1] < tb[0]


def pareto_front(rows: Sequence[dict[str, Any]], qname: str = "p90") -> list[dict[str, Any]]:
    """The simulated rows no other row beats (`beats`: GPUs, goodput per GPU and TTFT
    `qname`, meeting the SLO first, within the intervals); sorted by GPUs, then TTFT."""
    ttft = f"ttft_s.{qname}"
    pts = [
        r
        for r in rows
        if r["status"] == STATUS_OK and r["goodput_rps"] is not None and r.get(ttft) is not None
    ]
    front = [r for r in pts if not any(beats(o, r, qname) for o in pts if o is not r)]
    return sorted(front, key=lambda r: (r["gpus"], r[ttft], -r["goodput_per_gpu_rps"]))


def winner_key(row: dict[str, Any], qname: str) -> tuple:
    """The winner's order among the front's points that meet the SLO: fewest GPUs,
    most goodput per GPU, lowest TTFT at the target quantile, then the configuration
    itself, so that two searches that simulate the same points pick the same one."""
    ttft = row.get(f"ttft_s.{qname}")
    return (
        row["gpus"],
        -(row["goodput_per_gpu_rps"] or 0.0),
        math.inf if ttft is None else ttft,
        [str(row.get(k)) for k in KEYS],
    )


def judge(result: PlanResult) -> None:
    """Mark the front and pick the winner -- the front's point that meets the SLO with
    the fewest GPUs (ties: most goodput per GPU), so it is on the front by construction
    -- or, without one, the best point (highest attainment, then fewest GPUs)."""
    result.front = pareto_front(result.rows, result.qname)
    for r in result.front:
        r["on_front"] = True
    meeting = [r for r in result.front if r["meets"]]
    if meeting:
        result.winner = min(meeting, key=lambda r: winner_key(r, result.qname))
        result.winner["winner"] = True
        return
    ok = [r for r in result.rows if r["status"] == STATUS_OK]
    if ok:
        result.best = max(
            ok,
            key=lambda r: (r["slo_attainment"] or 0.0, -r["gpus"], r["goodput_per_gpu_rps"] or 0.0),
        )


def _interval_text(row: dict[str, Any], key: str, fmt: Callable[[float | None], str]) -> str:
    lo, hi = row.get(f"{key}_lo"), row.get(f"{key}_hi")
    if lo is None and hi is None:
        return fmt(row[key])
    return f"{fmt(row[key])} [{fmt(lo)}, {fmt(hi)}]"


def verdict(result: PlanResult) -> str:
    """One line: the winner (steady-state figures with their 95% intervals) and its
    bottleneck, or why none meets the SLO."""
    w, q = result.winner, result.qname
    if w is not None:
        return (
            f"winner: {w['gpus']} GPUs, {shape(w)}: attainment "
            f"{_interval_text(w, 'slo_attainment', share)}, goodput "
            f"{_interval_text(w, 'goodput_rps', num)} req/s ({w['goodput_per_gpu_rps']:.3g} per GPU), "
            f"TTFT {q} {_interval_text(w, f'ttft_s.{q}', secs)}, "
            f"TPOT {q} {_interval_text(w, f'tpot_s.{q}', secs)}, "
            f"ITL {q} {secs(w.get(f'itl_s.{q}'))}; "
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


def warnings(result: PlanResult) -> list[str]:
    """What the planner should know before acting on the winner: its busiest stage above
    `BUSY_WARNING`, a steady window too short for the target quantile."""
    w = result.winner
    out = []
    if w is None:
        return out
    u = w.get("busiest_utilization")
    if u is not None and u > BUSY_WARNING:
        out.append(
            f"the winner's {w['busiest_stage']} runs at {u:.0%} of its capacity (above "
            f"{BUSY_WARNING:.0%}): queues grow fast with any burst; the next GPU count up is safer"
        )
    n = w.get("window_requests") or 0
    tail = n * (1 - result.attainment)
    if result.attainment < 1 and tail < MIN_TAIL:
        out.append(
            f"the steady window holds {n} requests, {tail:.1f} beyond the {result.qname}: too few "
            f"for the quantile (at least {MIN_TAIL} wanted, {math.ceil(MIN_TAIL / (1 - result.attainment) - 1e-9)}"
            " requests); raise workload.requests"
        )
    return out


# --------------------------------------------------------------------------- files


def _public(row: dict[str, Any] | None, cols: Sequence[str]) -> dict[str, Any] | None:
    return None if row is None else {c: row.get(c) for c in cols}


def _skipped_by(rows: Sequence[dict[str, Any]]) -> dict[str, int]:
    """Skipped configurations counted by what skipped them (scenario, max-gpus, capacity)."""
    out: dict[str, int] = {}
    for r in rows:
        if r["status"] == STATUS_SKIPPED:
            out[r.get("skipped_by") or "scenario"] = (
                out.get(r.get("skipped_by") or "scenario", 0) + 1
            )
    return out


def write_plan(result: PlanResult, out_dir: Path, meta: dict[str, Any]) -> dict[str, Path]:
    """plan.csv (every candidate), plan.json (meta, verdict, front, winner, every row)
    and plan_front.png; returns them by name."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cols = columns(result.attainment)
    rows = [
        {c: r.get(c) for c in cols}
        for r in sorted(result.rows, key=lambda r: (r["gpus"], [str(r[k]) for k in KEYS]))
    ]
    csv_path = out_dir / "plan.csv"
    with csv_path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(cols)
        for row in rows:
            w.writerow([csv_cell(row[c]) for c in cols])
    doc = {
        **meta,
        "slo": result.targets,
        "attainment": result.attainment,
        "quantile": result.qname,
        "backend": result.backend,
        "wall_s": result.wall_s,
        "stopped_at_gpus": result.stopped_at,
        "search": result.search,
        "rungs": [{"simulations": n, "requests": r} for n, r in result.rungs],
        "counts": {s: result.count(s) for s in STATUSES},
        "skipped_by": _skipped_by(rows),
        "verdict": verdict(result),
        "warnings": warnings(result),
        "winner": _public(result.winner, cols),
        "best": _public(result.best, cols),
        "front": [_public(r, cols) for r in result.front],
        "skipped": skip_reasons([r for r in rows if r["status"] == STATUS_SKIPPED]),
        "points": rows,
    }
    files = {"csv": csv_path}
    if result.comparison is not None:
        doc["colocated"] = {
            "best": result.colocated_best,
            "comparison": result.comparison,
            "points": result.colocated,
        }
        files["colocated"] = write_colocated_csv(result.colocated, out_dir, result.attainment)
    files["json"] = write_json(out_dir / "plan.json", doc)
    fig = front_figure(doc)
    fig.savefig(out_dir / "plan_front.png", dpi=110)
    files["png"] = out_dir / "plan_front.png"
    return files
