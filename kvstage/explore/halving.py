"""Successive halving over a plan's configurations: short windows first, the best third on.

Every configuration is simulated on a short window of its workload (the first
requests), ranked, and only the best third (`ETA` = 3; at least `MIN_KEEP`) is
simulated again on a window `ETA` times longer; and so on until the survivors run the
whole workload (Jamieson and Talwalkar, "Non-stochastic best arm identification and
hyperparameter optimization", AISTATS 2016; Li et al., "Hyperband", JMLR 18, 2018).
Once no more than `MIN_KEEP` survive, they go straight to the whole workload.

Run length. A configuration's first window is chosen from the utilization the
bottleneck model gives its busiest stage (kvstage/explore/screen.py): a queue near
saturation takes long to reach its steady state, so a short window would show it
better than it is. The relaxation time of an M/M/1 queue at utilization rho is
1 / (mu (1 - sqrt(rho))^2) ([P] Morse, "Stochastic properties of waiting lines",
J. Oper. Res. Soc. Am. 3(3), 1955; Odoni and Roth, "An empirical investigation of the
transient behavior of stationary queueing systems", Oper. Res. 31(3), 1983): in
arrivals, c rho / (1 - sqrt(rho))^2 for c servers. The first window holds
`RELAX_TIMES` of those (the warm-up MSER-5 cuts, and the steady state after it), and
at least `MIN_TAIL` requests beyond the target quantile twice over (`first_length`).

Ranking (`rank_key`), best first: a configuration whose attainment interval reaches
the target (it cannot be ruled out) before one that clearly misses; among those that
may meet it, fewer GPUs, then more goodput per GPU, then a lower TTFT at the target
quantile -- the order the plan's winner is chosen in; among those that miss, the
higher attainment. Errors last.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

__all__ = [
    "ETA",
    "MIN_KEEP",
    "MIN_RUNG",
    "RELAX_TIMES",
    "first_length",
    "keep_count",
    "rank_key",
    "relaxation_requests",
    "schedule",
    "successive_halving",
]

ETA = 3  # keep the best 1/ETA, lengthen the window ETA times
MIN_KEEP = 3  # never prune below this many survivors
MIN_RUNG = 200  # requests of the shortest window at all
RELAX_TIMES = 3  # relaxation times in the first window
MIN_TAIL = 10  # requests beyond the target quantile (as kvstage/explore/plan.py)
MAX_RHO = 0.99  # utilizations above this are taken as this (the screen drops > 1)

Row = dict[str, Any]


def relaxation_requests(utilization: float | None, servers: int = 1) -> float:
    """Arrivals during one relaxation time of a queue at `utilization` (see above)."""
    if not utilization or utilization <= 0:
        return 0.0
    rho = min(utilization, MAX_RHO)
    return servers * rho / (1 - math.sqrt(rho)) ** 2


def first_length(attainment: float, utilization: float | None, servers: int, full: int) -> int:
    """Requests in a configuration's first window (at most the whole workload)."""
    tail = math.ceil(2 * MIN_TAIL / (1 - attainment) - 1e-9) if attainment < 1 else MIN_RUNG
    n = max(MIN_RUNG, tail, math.ceil(RELAX_TIMES * relaxation_requests(utilization, servers)))
    return min(full, n)


def keep_count(n: int) -> int:
    """Survivors of a rung of `n` configurations."""
    return min(n, max(MIN_KEEP, math.ceil(n / ETA)))


def rank_key(row: Row, attainment: float, qname: str) -> tuple:
    """Sort key of a rung's row, best first (see the module docstring)."""
    if row.get("status") != "ok":
        return (2, 0.0, 0.0, 0.0)
    att = row.get("slo_attainment") or 0.0
    hi = row.get("slo_attainment_hi")
    hi = att if hi is None else hi
    if hi >= attainment - 1e-12:
        ttft = row.get(f"ttft_s.{qname}")
        return (
            0,
            row["gpus"],
            -(row.get("goodput_per_gpu_rps") or 0.0),
            math.inf if ttft is None else ttft,
        )
    return (1, -att, row["gpus"], 0.0)


def schedule(firsts: list[int], fulls: list[int]) -> list[tuple[int, int]]:
    """The planned rungs as (configurations, requests simulated in all), for progress
    and an ETA: survivors are assumed to be the ones with the longest windows."""
    alive = sorted(zip(firsts, fulls, strict=True), key=lambda x: -x[1])
    out, rung = [], 0
    while alive:
        last = len(alive) <= MIN_KEEP
        lengths = [full if last else min(full, first * ETA**rung) for first, full in alive]
        out.append((len(alive), sum(lengths)))
        if last or all(n >= full for n, (_, full) in zip(lengths, alive, strict=True)):
            break
        alive = [a for a, n in zip(alive, lengths, strict=True) if n < a[1]][
            : keep_count(len(alive))
        ]
        rung += 1
    return out


def successive_halving(
    firsts: dict[int, int],
    fulls: dict[int, int],
    simulate: Callable[[dict[int, int]], dict[int, Row]],
    attainment: float,
    qname: str,
) -> tuple[dict[int, Row], dict[int, Row]]:
    """Run the rungs: `simulate({index: requests})` gives each configuration's row on
    its first `requests`. Returns (final rows: the whole workload, by index; pruned
    rows: their last rung's figures, with `rung` and the pruning `reason`)."""
    alive = sorted(firsts)
    final: dict[int, Row] = {}
    pruned: dict[int, Row] = {}
    rung = 0
    while alive:
        last = len(alive) <= MIN_KEEP
        lengths = {i: fulls[i] if last else min(fulls[i], firsts[i] * ETA**rung) for i in alive}
        rows = simulate(lengths)
        for i in alive:
            rows[i]["rung"] = rung
            if lengths[i] >= fulls[i]:
                final[i] = rows[i]
        if last:
            break
        ranked = sorted(alive, key=lambda i: (rank_key(rows[i], attainment, qname), i))
        k = keep_count(len(ranked))
        for pos, i in enumerate(ranked[k:], start=k + 1):
            if i in final:
                continue
            row = rows[i]
            att = row.get("slo_attainment")
            att_text = "-" if att is None else f"{att:.0%}"
            row["reason"] = (
                f"pruned after rung {rung + 1} ({lengths[i]:,} requests): rank {pos} of "
                f"{len(ranked)} (attainment {att_text}, {row['gpus']} GPUs); the best {k} went on"
            )
            pruned[i] = row
        alive = [i for i in ranked[:k] if i not in final]
        rung += 1
    return final, pruned
