"""Expert-parallel load imbalance: a MoE layer waits for its busiest EP rank.

With experts placed on R expert-parallel ranks, the tokens a batch routes (k copies of
each, one per chosen expert) do not split evenly: the layer's expert matmuls and its
dispatch and combine end when the rank with the most copies is done. kvstage prices
that rank, `busiest_rank` times the mean load (imbalance ratio = busiest / mean - 1,
[P] TensorRT-LLM's metric, below).

A rank's copies in one forward are the mean mu plus two deviations:

- a systematic one, from real routing's skew: some experts are hot, and a rank's load
  is the sum of its expert slots' loads, so its relative spread c is a slot's relative
  spread (cv) over sqrt(slots a rank); with EPLB the hot experts are replicated and
  placed to even the ranks out, leaving a much smaller residual cv;
- a random one, from which experts this batch's tokens happen to pick: mu copies
  spread multinomially, sd sqrt(mu (1 - 1/R)) [A] binomial, each copy independent.

Their sum taken normal, the busiest of R ranks holds mu + m_R sqrt((c mu)^2 + mu (1 -
1/R)), m_R the expected largest of R standard normals (integrated numerically) [A] the
normal approximation of both parts, and of the binomial at small mu.

The systematic cv is not fitted here: it comes out of [P] a published measurement,
TensorRT-LLM's wide-EP load balancer example (DeepSeek-R1, per-iteration routed token
counts per rank, averaged over iterations and layers,
https://github.com/NVIDIA/TensorRT-LLM/tree/main/examples/wide_ep/ep_load_balancer):

    EP32, 256 experts (8 a rank), no EPLB:   mean 1,024 a rank, imbalance ratio 1.564
    EP36, 288 slots (8 a rank), offline EPLB: mean 1,024 a rank, imbalance ratio 0.115

Solving the formula above for c at those points, less their own random part, and
scaling by sqrt(8) gives each slot's cv (2.14 without EPLB, 0.13 with it). [A] The
same skew for every MoE model and workload (the EPLB one is in-distribution: its
statistics came from the same dataset, as LMSYS's large-scale EP runs did, "the
experiments in this blog utilizes in-distribution data for EPLB",
https://lmsys.org/blog/2025-05-05-large-scale-ep/). [A] With EPLB, 32 redundant
slots over the model's experts (LMSYS's and TensorRT-LLM's 288 for DeepSeek's 256);
without it, the experts alone.

`prefill.eplb` / `decode.eplb` (true by default: [A] the expert-parallel deployments
kvstage is checked against all run EPLB: LMSYS, Ant Group's H20 decode, DeepSeek's own
(https://github.com/deepseek-ai/EPLB)) choose between the two. Experts split by tensor
parallelism (ep = 1) have no imbalance: every rank holds a slice of every expert.
"""

from __future__ import annotations

import math
from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstage.shared.scenario import Scenario

__all__ = ["busiest_rank", "expected_max_normal", "imbalance", "slot_cv"]

# [P] TensorRT-LLM wide-EP load balancer README (see above): (EP, slots a rank, mean
# copies a rank, imbalance ratio), without and with EPLB
_MEASURED = {False: (32, 8, 1024.0, 1.564), True: (36, 8, 1024.0, 0.115)}
REDUNDANT_SLOTS = 32  # [A] EPLB's redundant experts (LMSYS, TensorRT-LLM: 256 + 32)


@cache
def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normals] (0 for one): the integral of
    x n phi(x) Phi(x)^(n-1), by the midpoint rule over [-9, 9]."""
    if n <= 1:
        return 0.0
    step, total = 1e-3, 0.0
    for i in range(18_000):
        x = -9.0 + (i + 0.5) * step
        phi = math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
        cdf = 0.5 * (1.0 + math.erf(x / math.sqrt(2)))
        total += x * n * phi * cdf ** (n - 1) * step
    return total


def imbalance(mean: float, ranks: int, c: float) -> float:
    """Busiest / mean - 1 of `ranks` ranks holding `mean` copies each on average, the
    systematic relative spread `c` and the multinomial one (see above)."""
    if ranks <= 1 or mean <= 0:
        return 0.0
    spread = math.sqrt(c * c + (1.0 - 1.0 / ranks) / mean)
    return min(ranks - 1.0, expected_max_normal(ranks) * spread)  # all on one at most


@cache
def slot_cv(eplb: bool) -> float:
    """One expert slot's relative spread of load, from the published measurement: its
    rank-level c (the ratio less the random part), times sqrt(slots a rank)."""
    ranks, slots, mean, ratio = _MEASURED[eplb]
    c2 = (ratio / expected_max_normal(ranks)) ** 2 - (1.0 - 1.0 / ranks) / mean
    return math.sqrt(max(0.0, c2) * slots)


def _side(s: Scenario, side: str):
    return s.prefill if side == "prefill" else s.decode


def busiest_rank(s: Scenario, side: str, tokens: float, *, skew: bool = True) -> float:
    """The busiest EP rank's load over the mean (>= 1) in a forward of `tokens` tokens
    on each GPU of `side`; `skew=False`: the random part alone (uniform routing, as
    DeepEP's own benchmark draws it)."""
    cfg, m = _side(s, side), s.model
    ranks = cfg.ep
    if ranks <= 1 or not m.experts or tokens <= 0:
        return 1.0
    group = tokens * ranks / cfg.tp  # DP attention: each of ep / tp groups has its own
    mean = group * m.experts_per_token / ranks
    c = 0.0
    if skew:
        slots = m.experts + (REDUNDANT_SLOTS if cfg.eplb else 0)
        c = slot_cv(cfg.eplb) / math.sqrt(max(1.0, slots / ranks))
    return 1.0 + imbalance(mean, ranks, c)
