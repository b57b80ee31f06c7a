"""Screening a plan's configurations before simulating: offered load against capacity.

A configuration whose offered load exceeds a stage's capacity cannot meet an SLO over
a long run: its queue grows without bound, so every later request waits longer. The
bottleneck model (kvstage/metrics/bottleneck.py) gives the capacities; the ones it can
give without a simulation are screened here, from the scenario and its requests alone:

* prefill compute: offered prompt tokens/s (rate x mean computed prompt) against
  what the prefill instances forward per second (a full chunk's tokens over its
  forward time, x instances) -- [C] the same formula as bottleneck.py `_prefill`;
* decode compute: offered output tokens/s against what the decode instances
  generate within the TPOT target (the largest batch whose step fits the target,
  over the target, x instances) -- [C] bottleneck.py `_decode_compute`; only with a
  TPOT target and output tokens;
* NIC: offered KV bytes/s (rate x computed prompt x KV bytes per token on a decode
  rank x decode TP: every decode rank receives its share, replicated heads included)
  against the tighter side's NICs x link bandwidth -- [C] bottleneck.py `_nic`, with
  the payload estimated from the geometry instead of measured.

`screen(scenario)` gives the reason a configuration is skipped (the stage, the
numbers and the utilization) or None. `SCREEN_LIMIT` is 1.0: only a configuration
that is overloaded on average is skipped, never one that is merely busy (a busy one
is simulated; the plan warns when the winner runs above 85%).

The offered load is `offered_load` of the scenario's requests (the whole workload:
rate over the arrival span), read once per distinct workload.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from kvstage.metrics.bottleneck import (
    DECODE,
    NIC,
    PREFILL,
    batch_within,
    nic_counts,
    offered_load,
)
from kvstage.shared.serving.compute import prefill_forward_s

if TYPE_CHECKING:
    from kvstage.shared.scenario import Scenario

__all__ = ["SCREEN_LIMIT", "Capacity", "capacity", "overload", "screen", "workload_load"]

# A configuration is skipped when a stage's offered load exceeds this share of its
# capacity: above 1 the queue grows for as long as the load lasts.
SCREEN_LIMIT = 1.0

_LOADS: dict[str, dict[str, Any]] = {}


def workload_load(scenario: Scenario) -> dict[str, Any]:
    """`offered_load` of the scenario's requests (cached per workload and prefix)."""
    from kvstage.shared.workload import generate_requests

    key = f"{scenario.workload.model_dump_json()}|{scenario.decode.prefix_tokens}"
    if key not in _LOADS:
        _LOADS[key] = offered_load(generate_requests(scenario))
    return _LOADS[key]


# per stage: {"offered", "capacity", "utilization", "why", "servers"}
Capacity = dict[str, dict[str, Any]]


def _stage(offered: float, capacity: float, why: str, servers: int) -> dict[str, Any]:
    util = offered / capacity if capacity > 0 else math.inf
    return {
        "offered": offered,
        "capacity": capacity,
        "utilization": util,
        "why": why,
        "servers": servers,
    }


def capacity(scenario: Scenario) -> Capacity:
    """The stages' offered load, capacity and utilization, without simulating."""
    from kvstage.shared.serving.decode_model import DecodeModel

    s, load = scenario, workload_load(scenario)
    rate = load["requests_per_s"]
    out: Capacity = {}
    if rate is None:  # every request at once: no rate to compare
        return out
    c = s.cluster
    chunk = s.prefill.chunked_prefill_size
    prefill_cap = chunk / prefill_forward_s(s, chunk) * c.prefill_instances
    offered = rate * load["computed_tokens"]
    out[PREFILL] = _stage(
        offered,
        prefill_cap,
        f"{rate:.2f} req/s x {load['computed_tokens']:,.0f} prompt tokens = {offered:,.0f} tokens/s "
        f"vs {prefill_cap:,.0f} tokens/s of {c.prefill_instances} prefill instance(s) of TP{s.prefill.tp}",
        c.prefill_instances,
    )
    model = DecodeModel(s)
    target = s.slo.tpot_s
    if target is not None and load["output_tokens"]:
        context = load["computed_tokens"] + load["output_tokens"] / 2
        per_step = target * s.decode.tokens_per_step  # decode.speculative: tokens a step
        cap = batch_within(model, context, per_step) / target * c.decode_instances
        offered = rate * load["output_tokens"]
        out[DECODE] = _stage(
            offered,
            cap,
            f"{offered:,.0f} output tokens/s vs {cap:,.0f} tokens/s that {c.decode_instances} decode "
            f"instance(s) of TP{s.decode.tp} generate within TPOT {target * 1e3:g} ms",
            c.decode_instances,
        )
    link = s.links.resolved().link
    nics = min(nic_counts(s))
    per_request = load["computed_tokens"] * model.kv_bytes_per_token * s.decode.tp
    if per_request and link.bandwidth_bytes_s > 0:
        offered = rate * per_request
        cap = nics * link.bandwidth_bytes_s
        out[NIC] = _stage(
            offered,
            cap,
            f"{rate:.2f} req/s x {per_request / 2**30:,.2f} GiB of KV = {offered / 1e9:,.1f} GB/s vs "
            f"{nics} NIC(s) x {link.bandwidth_bytes_s / 1e9:,.1f} GB/s",
            nics,
        )
    return out


def overload(stages: Capacity, limit: float = SCREEN_LIMIT) -> str | None:
    """Why a configuration with these `capacity` figures is skipped ("<stage>
    overloaded: ...: 136% of capacity"), or None when every stage's offered load fits."""
    over = {k: v for k, v in stages.items() if v["utilization"] > limit}
    if not over:
        return None
    stage = max(over, key=lambda k: over[k]["utilization"])
    u = over[stage]["utilization"]
    pct = "infinite" if math.isinf(u) else f"{u:.0%}"
    return f"{stage} overloaded: {over[stage]['why']}: {pct} of capacity"


def screen(scenario: Scenario, limit: float = SCREEN_LIMIT) -> str | None:
    """`overload` of the scenario's `capacity`."""
    return overload(capacity(scenario), limit)
