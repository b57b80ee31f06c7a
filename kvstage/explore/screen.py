"""Screening a plan's configurations before simulating: offered load against capacity.

A configuration whose offered load exceeds a stage's capacity cannot meet an SLO over
a long run: its queue grows without bound, so every later request waits longer. The
capacities are shared/serving/capacity.py's, the ones the bottleneck verdict
(kvstage/metrics/bottleneck.py) reports after a run; those it can give without a
simulation are screened here, from the scenario and its requests alone:

* prefill compute: offered computed prompt tokens/s against `prefill_capacity`;
* decode compute: offered output tokens/s against `decode_capacity` at the TPOT
  target; only with a TPOT target and output tokens;
* NIC: offered KV bytes/s (rate x computed prompt x KV bytes per token on a decode
  rank x decode TP: every decode rank receives its share, replicated heads included)
  against `nic_capacity`, the payload estimated from the geometry where the bottleneck
  verdict measures it.

`screen(scenario)` gives the reason a configuration is skipped (the stage, the
numbers and the utilization) or None. `SCREEN_LIMIT` is 1.0: only a configuration
that is overloaded on average is skipped, never one that is merely busy (a busy one
is simulated; the plan warns when the winner runs above 85%).

The offered load is `offered_load` of the scenario's requests (the whole workload:
rate over the arrival span), generated once per distinct workload. The prefill's work
on them (`prefill_work`: every prompt's forwards on one instance) is computed once per
workload and scenario up to its instance counts: one instance's forwards do not depend
on how many there are (shared/serving/compute.py reads no count), and a plan's grid
varies the counts most.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstage.fmt import share
from kvstage.metrics.bottleneck import DECODE, NIC, PREFILL
from kvstage.shared.serving.capacity import (
    Stage,
    decode_stage,
    nic_stage,
    offered_load,
    prefill_stage,
    prefill_work,
    remote_requests,
)
from kvstage.shared.serving.decode_model import DecodeModel
from kvstage.shared.workload import Request, generate_requests

if TYPE_CHECKING:
    from kvstage.shared.scenario import Scenario

__all__ = ["SCREEN_LIMIT", "Capacity", "capacity", "overload", "screen", "workload_load"]

# A configuration is skipped when a stage's offered load exceeds this share of its
# capacity: above 1 the queue grows for as long as the load lasts.
SCREEN_LIMIT = 1.0

_WORKLOADS: dict[str, tuple[list[Request], dict[str, Any]]] = {}
_PREFILL_WORK: dict[str, tuple[float, float]] = {}
_COUNTS = {"cluster": {"prefill_instances", "decode_instances"}}  # what the work ignores


def _workload_key(scenario: Scenario) -> str:
    return f"{scenario.workload.model_dump_json()}|{scenario.decode.prefix_tokens}"


def _workload(scenario: Scenario) -> tuple[list[Request], dict[str, Any]]:
    """The scenario's requests and their `offered_load` (cached per workload and prefix)."""
    key = _workload_key(scenario)
    if key not in _WORKLOADS:
        requests = generate_requests(scenario)
        _WORKLOADS[key] = requests, offered_load(requests)
    return _WORKLOADS[key]


def _prefill_work(scenario: Scenario, requests: list[Request]) -> tuple[float, float]:
    """`prefill_work` of the scenario's requests (cached: the module docstring)."""
    key = f"{_workload_key(scenario)}|{scenario.model_dump_json(exclude=_COUNTS)}"
    if key not in _PREFILL_WORK:
        _PREFILL_WORK[key] = prefill_work(scenario, requests)
    return _PREFILL_WORK[key]


def workload_load(scenario: Scenario) -> dict[str, Any]:
    """`offered_load` of the scenario's requests (cached per workload and prefix)."""
    return _workload(scenario)[1]


# per stage: {"offered", "capacity", "utilization", "why", "servers"}
Capacity = dict[str, dict[str, Any]]


def _row(stage: Stage) -> dict[str, Any]:
    return {
        "offered": stage.offered,
        "capacity": stage.capacity,
        "utilization": stage.utilization,
        "why": stage.why,
        "servers": stage.servers,
    }


def _remote(s: Scenario, requests: list[Request], load: dict[str, Any]):
    """The requests a prefill instance serves and their load (`remote_requests`)."""
    remote = remote_requests(s, requests)
    return (requests, load) if remote is requests else (remote, offered_load(remote))


def capacity(scenario: Scenario) -> Capacity:
    """The stages' offered load, capacity and utilization, without simulating. With
    conditional disaggregation the prefill and NIC stages carry the prompts prefilled on
    a prefill instance only; the decode stage does not count the prompts it prefills
    itself (a lower bound on its load: the screen skips nothing that could fit)."""
    s = scenario
    requests, load = _workload(s)
    rate = load["requests_per_s"]
    out: Capacity = {}
    if rate is None:  # every request at once: no rate to compare
        return out
    remote, remote_load = _remote(s, requests, load)
    if remote_load["requests_per_s"] is not None:
        work = _prefill_work(s, remote)
        out[PREFILL] = _row(prefill_stage(s, remote, remote_load, work))
    model = DecodeModel(s)
    if s.slo.tpot_s is not None and load["output_tokens"]:
        out[DECODE] = _row(decode_stage(s, load, model))
    per_request = remote_load["computed_tokens"] * model.kv_bytes_per_token * s.decode.tp
    if per_request and remote_load["requests_per_s"] is not None:
        if s.links.resolved().link.bandwidth_bytes_s > 0:
            out[NIC] = _row(nic_stage(s, remote_load["requests_per_s"], per_request))
    return out


def overload(stages: Capacity, limit: float = SCREEN_LIMIT) -> str | None:
    """Why a configuration with these `capacity` figures is skipped ("<stage>
    overloaded: ...: 136% of capacity"), or None when every stage's offered load fits."""
    over = {k: v for k, v in stages.items() if v["utilization"] > limit}
    if not over:
        return None
    stage = max(over, key=lambda k: over[k]["utilization"])
    return (
        f"{stage} overloaded: {over[stage]['why']}: {share(over[stage]['utilization'])} of capacity"
    )


def screen(scenario: Scenario, limit: float = SCREEN_LIMIT) -> str | None:
    """`overload` of the scenario's `capacity`."""
    return overload(capacity(scenario), limit)
