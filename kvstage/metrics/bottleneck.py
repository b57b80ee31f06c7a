"""What limits a run: summary.json's `bottleneck` verdict, with the numbers behind it.

Pure functions of the scenario, its requests, the per-room spans of the trace
(`kvstage.metrics.rooms.room_latencies`) and the trace metrics (`summarize`).

The offered load and the capacities of prefill compute, decode compute and the NIC
are shared/serving/capacity.py's (the plan's screen and the benchmarks take the same);
each stage has a utilization (offered / capacity) where a capacity exists:

* prefill compute: computed prompt tokens/s offered over what the prefill instances
  forward, the simulator's chunks of the workload's prompts (`prefill_capacity`);
* NIC: KV bytes per request (measured payload per finished request) and work requests
  per request over the NICs of the tighter side (`nic_stage`: bandwidth and message
  rate);
* decode KV capacity: the KV the load keeps resident, rate x mean(tokens x time
  resident: admitted -> last token), over `DecodeModel.capacity_tokens` x instances;
* decode compute: output tokens/s offered over what the decode instances generate at
  the TPOT target (`decode_capacity`).

* staging ring: the bytes the load keeps in each decode rank's ring over what the
  ring can hold at once. A chunk's region (its writer blocks back to back, the same
  size on every decode rank of the instance) holds data from the first write into it
  to its free after the scatter; before the first write its bytes may still hold the
  previous round's data (the watermark decides when the prefill may overwrite them),
  so that time is the previous region's, not this one's. Per request, the trace gives
  B = sum over its chunks of region bytes x (free - first write start) on one decode
  rank (`room_latencies`' `ring_byte_s`, the mean over the instance's ranks). By
  Little's law one decode rank then holds rate x mean(B) / decode instances bytes on
  average (a request lands on one instance, on every rank of it). The ring holds
  whole regions: a region that does not fit before the end of the pool wraps to 0 and
  leaves the rest of the round unused, so with regions of the largest size r in the
  trace it holds floor(S / r) x r of a pool of S bytes (smaller regions, a room's
  last chunk, may use more: the figure is the conservative one). Utilization =
  rate x mean(B) / decode instances / (floor(S / r) x r). Where regions are freed
  out of order, the watermark waits for the oldest, so the ring stalls somewhat below
  100%: the wait shows as the ring's share of TTFT (staging wait).

Prefill queueing has no capacity of its own; it shows as time. Every finished
request's TTFT is split into disjoint parts: queueing (arrival ->
first forward), prefill compute (-> last forward end), then decode admission (waiting
for KV pages after the forward), staging wait (behind the watermark) and the rest of
the transfer (the NIC).

The verdict: a stage at or above 100% utilization (the highest) is "overloaded";
else a TPOT target the p90 misses names decode compute; else the stage holding the
largest share of TTFT limits the latency.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvstage.fmt import share
from kvstage.metrics.rooms import percentiles
from kvstage.shared.serving.capacity import (
    decode_stage,
    nic_capacity,
    nic_stage,
    offered_load,
    prefill_capacity,
    prefill_stage,
    prefill_work,
    remote_requests,
)
from kvstage.shared.serving.decode_model import DecodeModel

if TYPE_CHECKING:
    from kvstage.shared.scenario import Scenario
    from kvstage.shared.workload import Request

__all__ = ["STAGES", "bottleneck", "ttft_parts"]

PREFILL, QUEUE, NIC, RING, KV, DECODE = STAGES = (
    "prefill compute",
    "prefill queueing",
    "NIC",
    "staging ring",
    "decode KV capacity",
    "decode compute",
)
GIB = 1 << 30


def ttft_parts(info: dict[str, float]) -> dict[str, float] | None:
    """A finished request's TTFT split over the stages (disjoint, summing to TTFT)."""
    keys = ("arrival", "forward_start", "forward_end", "done")
    if info.get("failed") or any(k not in info for k in keys):
        return None
    after = max(0.0, info["done"] - info["forward_end"])
    admission = min(after, max(0.0, info.get("admitted", 0.0) - info["forward_end"]))
    staging = min(after - admission, info.get("staging_wait", 0.0))
    return {
        QUEUE: max(0.0, info["forward_start"] - info["arrival"]),
        PREFILL: info["forward_end"] - info["forward_start"],
        KV: admission,
        RING: staging,
        NIC: after - admission - staging,
    }


def _util(offered: float, capacity: float) -> float | None:
    return offered / capacity if capacity > 0 else None


def _prefill(
    s: Scenario, requests: Sequence[Request], load: dict, rate: float | None
) -> dict[str, Any]:
    work = prefill_work(s, requests)  # once: the capacity and the stage take it
    seconds = work[1]
    capacity = prefill_capacity(s, requests, work)
    out: dict[str, Any] = {
        "capacity_tokens_per_s": capacity,
        "forward_per_request_s": seconds / len(requests) if requests else 0.0,
    }
    if rate is not None:
        stage = prefill_stage(s, requests, load, work)
        out |= {
            "offered_tokens_per_s": stage.offered,
            "utilization": _util(stage.offered, capacity),
            "why": stage.why,
        }
    return out


def _nic(s: Scenario, summary: dict, rate: float | None) -> dict[str, Any]:
    done = summary.get("requests_done") or 0
    per_request = summary.get("payload_bytes", 0) / done if done else 0.0
    wrs = (summary.get("transfer_requests") or {}).get("per_request", 0.0)
    nics, capacity = nic_capacity(s)
    out: dict[str, Any] = {
        "bytes_per_request": per_request,
        "nics": nics,
        "capacity_bytes_per_s": capacity,
    }
    if rate is not None and per_request:
        stage = nic_stage(s, rate, per_request, wrs)
        util = _util(stage.offered, capacity)
        if util is not None:
            util = max(util, stage.other)
        out |= {"offered_bytes_per_s": stage.offered, "utilization": util, "why": stage.why}
    return out


def _decode_kv(
    s: Scenario, requests: Sequence[Request], rooms: dict, rate: float | None
) -> dict[str, Any]:
    model = DecodeModel(s)
    capacity = model.capacity_tokens * s.cluster.decode_instances
    by_room = {r.room: r for r in requests}
    held = []
    for room, info in rooms.items():
        req = by_room.get(room)
        if req is not None and "admitted" in info and ("generate_end" in info or "done" in info):
            tokens = max(0, req.prompt_tokens - req.prefix_tokens) + req.output_tokens
            held.append(
                tokens * (info.get("generate_end", info.get("done", 0.0)) - info["admitted"])
            )
    out: dict[str, Any] = {"capacity_tokens": capacity}
    if rate is not None and held:
        resident = rate * sum(held) / len(held)
        out |= {"resident_tokens": resident, "utilization": _util(resident, capacity)}
        out["why"] = (
            f"the load keeps {resident:,.0f} tokens of KV resident ({rate:.2f} req/s x tokens x time "
            f"held) vs {capacity:,.0f} tokens of decode KV capacity ({s.cluster.decode_instances} instance(s))"
        )
    return out


def _decode_compute(s: Scenario, load: dict, rooms: dict, rate: float | None) -> dict[str, Any]:
    if not load["output_tokens"]:
        return {}
    model = DecodeModel(s)
    context = (
        load["computed_tokens"] + load["output_tokens"] / 2
    )  # mean KV of a request in the batch
    gens = [i["generate_end"] - i["generate_start"] for i in rooms.values() if "generate_end" in i]
    out: dict[str, Any] = {"step_time_empty_s": model.step_time_s(0)}
    if rate is not None and gens:
        batch = (
            rate * sum(gens) / len(gens) / s.cluster.decode_instances
        )  # Little's law, per instance
        running = max(1, min(model.max_batch, round(batch)))
        out |= {
            "batch": batch,
            "step_time_s": model.step_time_s(round(running * context), running),
        }
    target = s.slo.tpot_s
    if target is not None and rate is not None:
        stage = decode_stage(s, load, model)
        out |= {
            "offered_tokens_per_s": stage.offered,
            "capacity_tokens_per_s": stage.capacity,
            "utilization": _util(stage.offered, stage.capacity),
        }
        if stage.capacity <= 0:  # one request's step alone takes longer than the target
            out["infeasible"] = True
        out["why"] = stage.why
    return out


def _ring(
    s: Scenario, requests: Sequence[Request], rooms: dict, summary: dict, rate: float | None
) -> dict[str, Any]:
    waits = [
        i.get("staging_wait", 0.0) for i in rooms.values() if "done" in i and not i.get("failed")
    ]
    out: dict[str, Any] = {
        "staging_wait_s": {
            k: v for k, v in percentiles(waits).items() if k in ("p50", "p99", "max")
        }
        if waits
        else {},
        "watermark_stall_total_s": (summary.get("watermark_stall_s") or {}).get("total", 0.0),
        "ring_live_peak_fraction": summary.get("ring_live_peak_fraction", 0.0),
    }
    held = [i["ring_byte_s"] for i in rooms.values() if "ring_byte_s" in i]
    if not held or not requests:
        return out  # the slice path, or no region was ever written: no ring in use
    pool = s.pool_bytes
    region = int(max(i["ring_region_bytes"] for i in rooms.values() if "ring_region_bytes" in i))
    fit = pool // region if region else 0
    usable = fit * region
    per_request = sum(held) / len(requests)  # requests whose chunks took no region count 0
    out |= {
        "pool_bytes": pool,
        "region_bytes": region,
        "regions_that_fit": fit,
        "usable_bytes": usable,
        "byte_s_per_request": per_request,
        "hold_s": sum(held) / sum(i["ring_bytes"] for i in rooms.values() if "ring_byte_s" in i),
    }  # byte-weighted
    if rate is not None and usable:
        resident = rate * per_request / s.cluster.decode_instances
        out |= {"resident_bytes": resident, "utilization": _util(resident, usable)}
        out["why"] = (
            f"{rate:.2f} req/s x {per_request / GIB:,.3f} GiB-s of staging per request "
            f"/ {s.cluster.decode_instances} decode instance(s) = {resident / GIB:,.2f} GiB held in each "
            f"decode rank's ring vs {usable / GIB:,.2f} GiB it holds at once ({fit} region(s) of "
            f"{region / GIB:,.2f} GiB in a {pool / GIB:,.2f} GiB pool)"
        )
    return out


def _shares(rooms: dict) -> dict[str, float]:
    parts = [p for p in map(ttft_parts, rooms.values()) if p is not None]
    total = sum(sum(p.values()) for p in parts)
    return {
        k: (sum(p[k] for p in parts) / total if total > 0 else 0.0)
        for k in (QUEUE, PREFILL, KV, RING, NIC)
    }


def _verdict(
    stages: dict[str, dict], shares: dict[str, float], summary: dict, s: Scenario
) -> tuple[str, str, str]:
    utils = {
        k: math.inf if v.get("infeasible") else v["utilization"]
        for k, v in stages.items()
        if v.get("utilization") is not None or v.get("infeasible")
    }
    over = {k: u for k, u in utils.items() if u >= 1}
    top = max(utils, key=utils.get) if utils else None
    if over:
        stage = max(over, key=over.get)
        u = over[stage]
        return (
            stage,
            "overloaded",
            f"{stage}: {stages[stage].get('why', '')}: {share(u)} of capacity",
        )
    tpot = (summary.get("tpot_s") or {}).get("p90")
    if s.slo.tpot_s is not None and tpot is not None and tpot > s.slo.tpot_s:
        return (
            DECODE,
            "TPOT target missed",
            (f"decode compute: TPOT p90 {tpot * 1e3:.2f} ms > target {s.slo.tpot_s * 1e3:g} ms"),
        )
    stage = max(shares, key=shares.get)
    ttft = summary.get("ttft_s") or {}
    tail = f"; highest utilization: {top} {share(utils[top])}" if top else ""
    return (
        stage,
        "largest share of TTFT",
        (
            f"{stage} holds {shares[stage]:.0%} of TTFT (mean TTFT {ttft.get('mean', math.nan):.3f} s){tail}"
        ),
    )


def bottleneck(
    scenario: Scenario,
    requests: Sequence[Request],
    rooms: dict[int, dict[str, float]],
    summary: dict,
) -> dict[str, Any]:
    """The verdict (`stage`, `reason`, a one-line `explanation`), the offered load, each
    stage's numbers and the TTFT shares. `summary`: the trace metrics (`summarize`)."""
    load = offered_load(requests)
    rate = load["requests_per_s"]
    remote = remote_requests(scenario, requests)  # those a prefill instance serves
    rload = load if remote is requests else offered_load(remote)
    stages = {
        PREFILL: _prefill(scenario, remote, rload, rload["requests_per_s"]),
        QUEUE: {"queueing_s": _p(summary, "queueing_s")},
        NIC: _nic(scenario, summary, rate),
        RING: _ring(scenario, requests, rooms, summary, rate),
        KV: _decode_kv(scenario, requests, rooms, rate),
        DECODE: _decode_compute(scenario, load, rooms, rate),
    }
    shares = _shares(rooms)
    for k, part in shares.items():
        stages[k]["ttft_share"] = part
    stage, reason, explanation = _verdict(stages, shares, summary, scenario)
    return {
        "stage": stage,
        "reason": reason,
        "explanation": explanation,
        "offered": {
            "requests_per_s": rate,
            "prompt_tokens_per_s": rate * load["prompt_tokens"] if rate is not None else None,
            "output_tokens_per_s": rate * load["output_tokens"] if rate is not None else None,
        },
        "stages": stages,
    }


def _p(summary: dict, key: str) -> dict[str, float]:
    node = summary.get(key) or {}
    return {k: node[k] for k in ("p50", "p99") if k in node}
