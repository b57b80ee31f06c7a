"""The colocated side of a plan: the same GPUs serving prefill and decode together.

Beside its disaggregated search, `kvstage plan` searches colocated configurations --
`instances` engine instances of TP `tp` (and EP: the plan's prefill and decode EP
values) on the decode side's GPU, each mixing chunked
prefill into its decode batches (kvstage/sim/colocated.py simulates them; the chunk is
the step's token budget) -- over the axes `COLOCATED_KEYS`, and says whether
disaggregation pays (`compare`): the fewest GPUs that meet the SLO each way, goodput
per GPU, and with prices the cost of a thousand requests that met the SLO.

The search: GPU counts smallest first, every configuration of a count at once, stopping
one count above the first that meets the SLO (the disaggregated "levels" search), so
the best colocated configuration is exact: every smaller count was simulated in full.
Each configuration is simulated on the whole workload and measured over its steady
window exactly as a disaggregated one (`kvstage.metrics.steady.steady_figures`).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstage.explore.executor import Executor, ExploreError, error_row
from kvstage.explore.plan_point import figure_columns, gpus_of
from kvstage.explore.sweep import STATUS_ERROR, STATUS_OK

if TYPE_CHECKING:
    from kvstage.shared.scenario import Scenario

__all__ = [
    "COLOCATED_KEYS",
    "DEFAULT_COLOCATED_INSTANCES",
    "ColocatedCandidates",
    "colocated_candidates",
    "colocated_from_plan",
    "colocated_shape",
    "compare",
    "parse_instances",
    "run_colocated_point",
    "search_colocated",
    "write_colocated_csv",
]

COLOCATED_KEYS = (
    "colocated.instances",
    "colocated.tp",
    "colocated.ep",
    "prefill.chunked_prefill_size",
)
DEFAULT_COLOCATED_INSTANCES = "1,2,3,4,6,8,12,16"


def colocated_shape(row: dict[str, Any]) -> str:
    """`C 4xTP4, chunk 2048`: a colocated configuration in a few words."""
    ep = f" EP{row['colocated.ep']}" if (row.get("colocated.ep") or 1) > 1 else ""
    return (
        f"C {row['colocated.instances']}xTP{row['colocated.tp']}{ep}, "
        f"chunk {row['prefill.chunked_prefill_size']}"
    )


@dataclass
class ColocatedCandidates:
    scenarios: dict[int, Scenario]  # index -> the colocated scenario to simulate
    settings: dict[int, dict[str, Any]]  # index -> its COLOCATED_KEYS values
    skipped: list[dict[str, Any]] = field(default_factory=list)  # rows, with the reason


def _gpus(settings: dict[str, Any]) -> int:
    return settings["colocated.instances"] * settings["colocated.tp"]


def _layout_problem(base: Scenario, tp: int, ep: int, n: int) -> str | None:
    """Why TP `tp` with EP `ep` over `n` instances is no colocated layout, else None."""
    if ep > 1 and not base.model.experts:
        return f"ep {ep}: the model has no experts (model.experts = 0)"
    if ep > 1 and ep % tp:
        return f"ep {ep} is not a multiple of tp {tp}"
    group = ep // tp if ep > tp else 1
    if n % group:
        return f"{n} instance(s) of TP{tp} do not fill whole expert groups of {group} (ep {ep})"
    return None


def prefill_overload(s: Scenario) -> str | None:
    """Why the colocated instances cannot keep up with the prompts alone, else None: the
    offered prompt tokens/s against their prefill capacity at full chunks
    (kvstage/explore/screen.py). A lower bound on the load: decode steps and smaller
    chunks mixed into them only take more of the GPUs' time."""
    from kvstage.explore.screen import PREFILL, capacity, overload

    stage = capacity(s).get(PREFILL)
    return None if stage is None else overload({PREFILL: stage})


def colocated_candidates(
    base: Scenario,
    tps: Sequence[int],
    instances: Sequence[int],
    chunks: Sequence[int],
    max_gpus: int | None,
    eps: Sequence[int] = (1,),
    screen: bool = True,
) -> ColocatedCandidates:
    """Every (instances, TP, EP, chunk) of the grid on `base`'s decode GPU; those whose
    weights or one chunk do not fit a GPU, whose EP does not apply, above `max_gpus`, or
    (`screen`) whose prompts alone overload the instances, skipped with why."""
    from kvstage.sim.colocated import colocated_problem, colocated_scenario

    out = ColocatedCandidates({}, {})
    for tp in sorted(set(tps)):
        for ep in sorted(set(eps)):
            for chunk in sorted(set(chunks)):
                s = colocated_scenario(base, tp, 1, ep)
                p = s.prefill.model_copy(update={"chunked_prefill_size": chunk})
                s = s.model_copy(update={"prefill": p})
                for n in sorted(set(instances)):
                    settings = {
                        "colocated.instances": n,
                        "colocated.tp": tp,
                        "colocated.ep": ep,
                        "prefill.chunked_prefill_size": chunk,
                    }
                    why = _layout_problem(base, tp, ep, n) or colocated_problem(s)
                    if why is None and max_gpus is not None and n * tp > max_gpus:
                        why = f"{n * tp} GPUs: over the plan's {max_gpus}"
                    one = colocated_scenario(s, tp, n, ep)
                    if why is None and screen:
                        why = prefill_overload(one)
                    if why is not None:
                        out.skipped.append(_row(settings, "skipped", reason=why))
                        continue
                    index = len(out.settings)
                    out.scenarios[index] = one
                    out.settings[index] = settings
    return out


def _row(settings: dict[str, Any], status: str, **extra: Any) -> dict[str, Any]:
    return {
        **settings,
        "gpus": _gpus(settings),
        "status": status,
        "meets": False,
        "best": False,
        **extra,
    }


def run_colocated_point(scenario: Scenario, attainment: float) -> dict[str, Any]:
    """Simulate one colocated configuration; its steady-state row (or status "error")."""
    try:
        from kvstage.metrics.steady import steady_figures
        from kvstage.shared.serving.capacity import scenario_gpus
        from kvstage.sim.colocated import simulate_colocated

        r = simulate_colocated(scenario)
        gpus = scenario_gpus(scenario)[1]  # colocated: the decode side's instances serve it all
        row = steady_figures(r.rooms, r.requests, scenario.slo.targets(), attainment, gpus=gpus)
        util = r.utilization
        row |= {
            "status": STATUS_OK,
            "requests": len(r.requests),
            "gpu": scenario.decode.gpu,
            "requests_failed": r.rooms_failed,
            "busiest_stage": "forward",
            "busiest_utilization": util,
            "peak_batch": r.peak_batch,
            "sim_time_s": r.sim_time_s,
            "wall_s": r.wall_s,
        }
        if r.failed_reason:
            row["reason"] = r.failed_reason
        return row
    except Exception as exc:  # a simulator bug: report it as the point's row
        return error_row(exc)


def _meets(row: dict[str, Any], attainment: float) -> bool:
    return row["status"] == STATUS_OK and (row.get("slo_attainment") or 0.0) >= attainment - 1e-12


def _order(row: dict[str, Any], qname: str) -> tuple:
    ttft = row.get(f"ttft_s.{qname}")
    return (
        row["gpus"],
        -(row.get("goodput_per_gpu_rps") or 0.0),
        math.inf if ttft is None else ttft,
        [row[k] for k in COLOCATED_KEYS],
    )


def search_colocated(
    cands: ColocatedCandidates,
    runner: Executor,
    attainment: float,
    qname: str,
    on_point: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """GPU counts smallest first (module docstring): (every row, the best one that meets
    the SLO, or None). Rows not simulated are "not run"."""
    counts = sorted({_gpus(s) for s in cands.settings.values()})
    rows: dict[int, dict[str, Any]] = {}
    found: int | None = None
    for gpus in counts:
        if found is not None and gpus > found and any(r["gpus"] > found for r in rows.values()):
            break
        batch = [i for i, s in cands.settings.items() if _gpus(s) == gpus]

        def done(index: int, got: dict[str, Any]) -> None:
            got = dict(got)
            row = _row(cands.settings[index], got.pop("status", STATUS_ERROR), **got)
            row["meets"] = _meets(row, attainment)
            rows[index] = row
            if on_point is not None:
                on_point(row)

        runner.run(
            run_colocated_point, [(i, (cands.scenarios[i], attainment)) for i in batch], done
        )
        meeting = [r["gpus"] for r in rows.values() if r["meets"]]
        found = min(meeting) if meeting else None
    not_run = [
        _row(s, "not run", reason="above the GPU count where the colocated search stopped")
        for i, s in cands.settings.items()
        if i not in rows
    ]
    meeting = [r for r in rows.values() if r["meets"]]
    best = min(meeting, key=lambda r: _order(r, qname)) if meeting else None
    if best is not None:
        best["best"] = True
    return [*rows.values(), *not_run, *cands.skipped], best


def _cost_per_k(row: dict[str, Any], price_per_gpu_hour: float | None) -> float | None:
    """Cost of a thousand requests that met the SLO: GPUs x price / goodput."""
    good = row.get("goodput_rps")
    if price_per_gpu_hour is None or not good:
        return None
    return row["gpus"] * price_per_gpu_hour / (good * 3600) * 1000


def _hourly(row: dict[str, Any], prices: dict[str, float] | None, colocated: bool) -> float | None:
    if not prices:
        return None
    if colocated:
        p = prices.get(row.get("gpu") or "")
        return None if p is None else p
    pg, dg = prices.get(row.get("prefill_gpu") or ""), prices.get(row.get("decode_gpu") or "")
    if pg is None or dg is None:
        return None
    spent = row["cluster.prefill_instances"] * row["prefill.tp"] * pg
    spent += row["cluster.decode_instances"] * row["decode.tp"] * dg
    return spent / row["gpus"]


def _fewer(n: int) -> str:
    return "as many" if n == 0 else f"{abs(n)} {'fewer' if n > 0 else 'more'}"


def compare(
    disagg: dict[str, Any] | None,
    colocated: dict[str, Any] | None,
    prices: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Whether disaggregation pays: the two best configurations that meet the SLO side
    by side (GPUs, goodput per GPU, cost per thousand good requests with prices) and
    one line (`text`). `pays`: True (fewer GPUs, or as many with more goodput per GPU),
    False, or None when one side has nothing that meets the SLO."""
    out: dict[str, Any] = {"pays": None}
    for name, row, colo in (("disaggregated", disagg, False), ("colocated", colocated, True)):
        if row is None:
            out[name] = None
            continue
        price = _hourly(row, prices, colo)
        out[name] = {
            "gpus": row["gpus"],
            "goodput_per_gpu_rps": row.get("goodput_per_gpu_rps"),
            "cost_per_k_good_requests": _cost_per_k(row, price),
        }
    d, c = out["disaggregated"], out["colocated"]
    if d is None and c is None:
        out["text"] = "neither disaggregated nor colocated serving meets the SLO in the grid"
        return out
    if d is None or c is None:
        side = "colocated" if d is None else "disaggregated"
        out["pays"] = d is not None
        out["text"] = f"only {side} serving meets the SLO in the grid"
        return out
    dg, cg = d["goodput_per_gpu_rps"] or 0.0, c["goodput_per_gpu_rps"] or 0.0
    out["pays"] = d["gpus"] < c["gpus"] or (d["gpus"] == c["gpus"] and dg > cg)
    verb = "pays" if out["pays"] else "does not pay"
    text = (
        f"disaggregation {verb} here: {d['gpus']} GPUs against {c['gpus']} colocated "
        f"({_fewer(c['gpus'] - d['gpus'])}), goodput per GPU {dg:.3g} against {cg:.3g} req/s"
    )
    if cg:
        text += f" ({dg / cg - 1:+.0%})"
    dk, ck = d["cost_per_k_good_requests"], c["cost_per_k_good_requests"]
    if dk is not None and ck is not None:
        text += f", {dk:.3g} against {ck:.3g} per thousand requests that met the SLO"
        if ck:
            text += f" ({dk / ck - 1:+.0%})"
    out["text"] = text
    return out


def write_colocated_csv(rows: Sequence[dict[str, Any]], out_dir: Path, attainment: float) -> Path:
    """colocated.csv: every colocated configuration, simulated, skipped or not run."""
    cols = (
        *COLOCATED_KEYS,
        "gpus",
        "gpu",
        "status",
        "meets",
        "best",
        *figure_columns(attainment),
        "peak_batch",
        "reason",
    )
    path = out_dir / "colocated.csv"
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(cols)
        for r in sorted(rows, key=lambda r: (r["gpus"], [r[k] for k in COLOCATED_KEYS])):
            w.writerow(["" if r.get(c) is None else r.get(c) for c in cols])
    return path


def parse_instances(text: str) -> list[int]:
    """`--colocated-instances 1,2,4` -> [1, 2, 4]; ExploreError naming what is allowed."""
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        if not item.isdigit() or int(item) < 1:
            raise ExploreError(
                f"--colocated-instances {text!r}: {item!r} is not a whole number >= 1 "
                "(e.g. 1,2,4,8)"
            )
        out.append(int(item))
    if not out:
        raise ExploreError(f"--colocated-instances {text!r}: no instance count given (e.g. 1,2,4)")
    return out


def colocated_from_plan(
    cands: Any, instances: str, max_gpus: int | None, screen: bool = True
) -> ColocatedCandidates:
    """The colocated candidates of a disaggregated plan's grid (`plan_candidates`): its
    prefill and decode TPs and chunk sizes, `instances`, on its first configuration's
    scenario, up to `max_gpus` or the largest GPU count of the disaggregated grid."""
    values = {v.key: list(v.values) for v in cands.varies}
    tps = [*values["prefill.tp"], *values["decode.tp"]]
    eps = [*values["prefill.ep"], *values["decode.ep"]]
    chunks = values["prefill.chunked_prefill_size"]
    if max_gpus is None:
        rows = [p.settings for p in cands.points] + list(cands.skipped)
        max_gpus = max(gpus_of(r) for r in rows)
    base = cands.points[0].scenario
    return colocated_candidates(
        base, tps, parse_instances(instances), chunks, max_gpus, eps, screen
    )
