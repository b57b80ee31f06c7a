"""Capacity per stage: what a configuration serves per second, the load offered to it.

One home for the figures the bottleneck verdict (kvstage/metrics/bottleneck.py), the
plan's screen (kvstage/explore/screen.py) and the benchmarks compare; each `Stage` says
in one line why (`why`). Pure functions of the scenario and its requests.

Offered load (`offered_load`): requests per second over the arrival span ((n - 1) /
(last arrival - first arrival); none when every request arrives at once), and the mean
prompt, computed prompt (less the decode's cached prefix) and output tokens a request.

- prefill compute (`prefill_capacity`): the prompt tokens per second the prefill
  instances compute, as the simulator computes them when kept busy. Each request's
  prompt, from the decode's cached prefix on, is forwarded in chunks of whole pages
  (`Geometry.chunk_tokens`), each attending to the tokens before it: the chunks the
  rank runtime schedules (shared/runtime.py `_schedule_forwards`, the same
  `Geometry.chunks`: `prompt_chunks`). An instance with chunks waiting packs them into
  one forward while their computed tokens fit chunk_tokens, as SGLang's scheduler
  packs prompts up to chunked_prefill_size (shared/serving/prefill_batch.py, the rule
  sim/forward.py applies too), each forward priced by shared/serving/compute.py
  `packed_forward_s`. So it computes sum(computed tokens) / sum(forward times) over
  the workload's requests packed in their order (`prefill_work`), times the instances:
  the capacity at saturation, where the queue always holds the next chunks; a lightly
  loaded instance forwards its prompts one by one, more slowly a token. With pipeline
  stages (`prefill.pp` > 1) one packed forward a stage-step. [A]
  The prefill prefix cache's hits (Mooncake hash ids) are not subtracted: the
  capacity of a cold cache.

  Three answers existed before, up to 30% apart: bottleneck and the screen took one
  full chunk at context 0 (chunk / forward(chunk)), i.e. one chunk-long prompt, whose
  attention is quadratic in the chunk (DeepSeek-V3, prefill TP1 EP32, 16,384-token
  chunks, 1K prompts: 3,858 tokens/s a GPU against the simulator's 4,834); the
  benchmark packed 16,384 / prompt prompts into one forward (5,510: the simulator was
  12% below it, forwarding one prompt at a time). Now all three pack as above.
- decode compute (`decode_capacity`): the output tokens per second the decode
  instances generate within a TPOT target: the largest batch (at most
  `decode.max_running_requests`) whose step, each request holding the mean context,
  fits the target times the tokens a step yields (`decode.tokens_per_step`, speculative
  decoding), over the target, times the instances.
- NIC (`nic_counts`, `nic_capacity`): the NICs of the tighter side (ranks packed on
  nodes, rail-aligned, as sim/cluster.py places them) times the link's bandwidth, and
  its message rate for the work requests.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstage.shared.layout import LayoutError, room_pages
from kvstage.shared.serving.compute import chunk_forward_s, packed_forward_s
from kvstage.shared.serving.decode_model import DecodeModel
from kvstage.shared.serving.pipeline import pipeline_latency_s, stage_step_s
from kvstage.shared.serving.prefill_batch import pack
from kvstage.shared.serving.prefix_cache import cached_in_chunk

if TYPE_CHECKING:
    from kvstage.shared.scenario import Scenario
    from kvstage.shared.workload import Request

__all__ = [
    "Stage",
    "batch_within",
    "decode_capacity",
    "gpus",
    "nic_capacity",
    "nic_counts",
    "offered_load",
    "prefill_capacity",
    "prefill_work",
    "prompt_chunks",
    "prompt_forward_s",
    "prompt_latency_s",
    "prompt_steps",
    "remote_requests",
    "scenario_gpus",
]

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class Stage:
    """One stage's capacity and the load offered to it, per second, in its unit."""

    offered: float
    capacity: float
    servers: int  # instances (compute) or NICs
    why: str
    other: float = 0.0  # the utilization a second limit of the stage gives (NIC message rate)

    @property
    def utilization(self) -> float:
        own = self.offered / self.capacity if self.capacity > 0 else math.inf
        return max(own, self.other)


def gpus(
    prefill_instances: int,
    prefill_tp: int,
    decode_instances: int,
    decode_tp: int,
    prefill_pp: int = 1,
) -> tuple[int, int]:
    """(prefill, decode) GPUs of a configuration: one per rank, instances x TP a side,
    x the prefill's pipeline stages (`prefill.pp`). DP attention's instances are
    instances here (an expert group of ep / tp of them)."""
    return prefill_instances * prefill_tp * prefill_pp, decode_instances * decode_tp


def scenario_gpus(s: Scenario) -> tuple[int, int]:
    """(prefill, decode) GPUs of scenario `s` (`gpus`)."""
    c = s.cluster
    return gpus(c.prefill_instances, s.prefill.tp, c.decode_instances, s.decode.tp, s.prefill.pp)


def offered_load(requests: Sequence[Request]) -> dict[str, Any]:
    """Offered rate (None when the arrivals span no time) and mean tokens per request."""
    n = len(requests)
    arrivals = [r.arrival_s for r in requests]
    span = (max(arrivals) - min(arrivals)) if n else 0.0

    def mean(xs: list[int]) -> float:
        return sum(xs) / n if n else 0.0

    return {
        "requests": n,
        "requests_per_s": (n - 1) / span if n > 1 and span > 0 else None,
        "prompt_tokens": mean([r.prompt_tokens for r in requests]),
        "computed_tokens": mean([max(0, r.prompt_tokens - r.prefix_tokens) for r in requests]),
        "output_tokens": mean([r.output_tokens for r in requests]),
    }


# --------------------------------------------------------------------------- prefill


def prompt_forward_s(
    s: Scenario, prompt_tokens: int, prefix_tokens: int = 0, cached_tokens: int = 0
) -> float:
    """Seconds of one prompt's forwards on its prefill instance, as the simulator runs
    them: the chunks (whole pages) after the decode's `prefix_tokens`, one after the
    other, less the `cached_tokens` the prefill's prefix cache holds. With pipeline
    stages (`prefill.pp`) the seconds the instance spends on it with other prompts'
    chunks in flight: one stage-step a chunk (shared/serving/pipeline.py)."""
    total = 0.0
    for step in prompt_steps(s, prompt_tokens, prefix_tokens, cached_tokens):
        total += step
    return total


def prompt_latency_s(
    s: Scenario, prompt_tokens: int, prefix_tokens: int = 0, cached_tokens: int = 0
) -> float:
    """Seconds from a prompt's first chunk starting to its last chunk's forward ending,
    on an idle instance: its forwards one after the other, or through `prefill.pp`
    stages, n + pp - 1 stage-steps (pipeline.py `pipeline_latency_s`)."""
    steps = prompt_steps(s, prompt_tokens, prefix_tokens, cached_tokens)
    return pipeline_latency_s(steps, s.prefill.pp)


def prompt_steps(
    s: Scenario, prompt_tokens: int, prefix_tokens: int = 0, cached_tokens: int = 0
) -> list[float]:
    """Each chunk's forward seconds (with pipeline stages: its stage-step), in order."""
    g = s.geometry()
    steps = []
    for tokens, cached, page in prompt_chunks(s, prompt_tokens, prefix_tokens, cached_tokens):
        forward = chunk_forward_s(s, tokens, cached, page, g.page_size)
        steps.append(stage_step_s(s, forward, tokens - cached))
    return steps


def prompt_chunks(
    s: Scenario, prompt_tokens: int, prefix_tokens: int = 0, cached_tokens: int = 0
) -> list[tuple[int, int, int]]:
    """The chunks the rank runtime schedules for a prompt (shared/runtime.py
    `_schedule_forwards`): each (tokens, of them cached in the prefill's prefix cache,
    its first page within the prompt); none when the room fails at open."""
    g = s.geometry()
    try:
        chunks = g.chunks(room_pages(prompt_tokens, prefix_tokens, g.page_size))
    except LayoutError:
        return []  # the room fails at open: nothing is forwarded
    first = prefix_tokens // g.page_size
    out = []
    for c in chunks:
        tokens = c.num_pages * g.page_size
        start = (first + c.page_start) * g.page_size
        out.append((tokens, cached_in_chunk(cached_tokens, start, tokens), first + c.page_start))
    return out


def remote_requests(s: Scenario, requests: Sequence[Request]) -> Sequence[Request]:
    """The requests a prefill instance serves: with conditional disaggregation
    (`cluster.max_local_prefill_length`) the prompts too long to prefill on the decode
    side; else all of them (the same sequence)."""
    if s.cluster.max_local_prefill_length is None:
        return requests
    local = s.cluster.prefills_locally
    return [r for r in requests if not local(r.prompt_tokens, r.prefix_tokens)]


def prefill_work(s: Scenario, requests: Sequence[Request]) -> tuple[float, float]:
    """(computed prompt tokens, seconds of forwards) of these requests on one instance
    kept busy: their chunks in order, packed into forwards as the simulator packs the
    chunks waiting for it (shared/serving/prefill_batch.py `pack`); with pipeline stages
    one stage-step a forward (shared/serving/pipeline.py `stage_step_s`)."""
    tokens = float(sum(max(0, r.prompt_tokens - r.prefix_tokens) for r in requests))
    g = s.geometry()
    chunks: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    queue = []
    for i, r in enumerate(requests):
        key = (r.prompt_tokens, r.prefix_tokens)
        if key not in chunks:
            chunks[key] = prompt_chunks(s, *key)
        for t, cached, page in chunks[key]:
            queue.append((i, t - cached, page * g.page_size + cached))
    priced: dict[tuple[tuple[int, int], ...], float] = {}
    total = 0.0
    for forward in pack(queue, g.chunk_tokens):
        key = tuple(forward)
        if key not in priced:
            computed = sum(t for t, _ in forward)
            priced[key] = stage_step_s(s, packed_forward_s(s, forward), computed)
        total += priced[key]
    return tokens, total


def prefill_capacity(
    s: Scenario, requests: Sequence[Request], work: tuple[float, float] | None = None
) -> float:
    """Computed prompt tokens per second of the prefill instances on these requests
    (0 when they compute nothing); `work`: their `prefill_work` when known."""
    tokens, seconds = prefill_work(s, requests) if work is None else work
    return tokens / seconds * s.cluster.prefill_instances if seconds > 0 else 0.0


def prefill_stage(
    s: Scenario,
    requests: Sequence[Request],
    load: dict[str, Any],
    work: tuple[float, float] | None = None,
) -> Stage:
    """Offered computed prompt tokens/s against `prefill_capacity` (needs a rate)."""
    rate, computed = load["requests_per_s"], load["computed_tokens"]
    capacity = prefill_capacity(s, requests, work)
    offered = rate * computed
    why = (
        f"{rate:.2f} req/s x {computed:,.0f} prompt tokens = {offered:,.0f} tokens/s offered vs "
        f"{capacity:,.0f} tokens/s of prefill compute ({s.cluster.prefill_instances} "
        f"instance(s) of TP{s.prefill.tp}{f' PP{s.prefill.pp}' if s.prefill.pp > 1 else ''})"
    )
    return Stage(offered, capacity, s.cluster.prefill_instances, why)


# --------------------------------------------------------------------------- decode


def batch_within(model: DecodeModel, context: float, target: float) -> int:
    """The largest batch (at most decode.max_running_requests) whose step, each request
    holding `context` tokens of KV, fits `target` seconds; 0 when not even one does.
    The step time grows with the batch (more KV, more FLOPs), so bisect."""
    lo, hi = 0, model.max_batch
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if model.step_time_s(mid * context, mid) <= target:
            lo = mid
        else:
            hi = mid - 1
    return lo


def decode_capacity(
    s: Scenario, context: float, target: float, model: DecodeModel | None = None
) -> float:
    """Output tokens per second the decode instances generate within TPOT `target`, each
    request holding `context` tokens of KV (0: not even one request's step fits)."""
    model = model or DecodeModel(s)
    # a step yields decode.tokens_per_step tokens a request (decode.speculative): the TPOT
    # target allows a step that many times as long
    fit = batch_within(model, context, target * s.decode.tokens_per_step)
    return fit / target * s.cluster.decode_instances


def decode_stage(s: Scenario, load: dict[str, Any], model: DecodeModel | None = None) -> Stage:
    """Offered output tokens/s against `decode_capacity` at the TPOT target (needs a
    rate, a target and output tokens); the context is the mean KV of a request in the
    batch, its computed prompt plus half its output."""
    model = model or DecodeModel(s)
    target = s.slo.tpot_s
    context = load["computed_tokens"] + load["output_tokens"] / 2
    capacity = decode_capacity(s, context, target, model)
    offered = load["requests_per_s"] * load["output_tokens"]
    why = (
        f"{offered:,.0f} output tokens/s offered vs {capacity:,.0f} tokens/s the decode instances "
        f"generate within TPOT {target * 1e3:g} ms (a step of one request with no KV is "
        f"{model.step_time_s(0) * 1e3:.2f} ms)"
    )
    return Stage(offered, capacity, s.cluster.decode_instances, why)


# --------------------------------------------------------------------------- NIC


def nic_counts(s: Scenario) -> tuple[int, int]:
    """(prefill-side, decode-side) NICs: ranks packed on nodes, rail-aligned (sim/cluster.py)."""
    c, links = s.cluster, s.links.resolved()
    gpn = c.gpus_per_node
    nics = c.nics_per_node or max(1, gpn // links.gpus_per_nic)

    def count(ranks: int) -> int:
        if links.placement == "intra":
            return ranks
        return len({(r // gpn, (r % gpn) * nics // gpn) for r in range(ranks)})

    prefill, decode = scenario_gpus(s)
    return count(prefill), count(decode)


def nic_capacity(s: Scenario) -> tuple[int, float]:
    """(NICs of the tighter side, their bytes per second)."""
    nics = min(nic_counts(s))
    return nics, nics * s.links.resolved().link.bandwidth_bytes_s


def nic_stage(s: Scenario, rate: float, bytes_per_request: float, wrs: float = 0.0) -> Stage:
    """Offered KV bytes/s against `nic_capacity`; the utilization is the larger of the
    bytes' and the work requests' (`wrs` a request) against the link's message rate."""
    link = s.links.resolved().link
    nics, capacity = nic_capacity(s)
    offered = rate * bytes_per_request
    other = 0.0
    if math.isfinite(link.message_rate) and wrs:
        other = rate * wrs / (nics * link.message_rate)
    why = (
        f"{rate:.2f} req/s x {bytes_per_request / GIB:,.2f} GiB of KV = {offered / 1e9:,.1f} GB/s "
        f"offered vs {nics} NIC(s) x {link.bandwidth_bytes_s / 1e9:,.1f} GB/s on the tighter side"
    )
    return Stage(offered, capacity, nics, why, other)
