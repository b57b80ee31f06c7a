"""Colocated serving in simulated time: the same GPUs prefill and decode, no KV transfer.

The baseline a disaggregated plan is weighed against (`kvstage plan`, the colocated row):
`instances` engine instances of TP `tp` on the decode side's GPU, each one scheduler
loop that runs one forward at a time. A forward (a "step") carries every running
request's next token (the decode batch) and, in the token budget left, chunks of the
prompts being prefilled, mixed into the same forward:

- budget: `prefill.chunked_prefill_size` tokens a step, the running decodes' one token
  each counted first. [C] vLLM v1 `Scheduler.schedule`
  (vllm-project/vllm vllm/v1/core/sched/scheduler.py at 00024d31: `token_budget =
  self.max_num_scheduled_tokens`, RUNNING requests scheduled before WAITING ones);
  [C] SGLang with `--enable-mixed-chunk` (sgl-project/sglang
  python/sglang/srt/managers/scheduler.py at d51c1c21, `get_new_batch_prefill`:
  `PrefillAdder(..., chunked_prefill_size, running_bs if self.is_mixed_chunk else 0)`,
  the running batch's tokens taken off the chunk budget, and the prefill batch then
  mixed with the running decode batch);
- order: prompts already being prefilled first, then new requests in arrival order
  (first come, first served, as both engines' default policy); a prompt larger than
  what is left of the budget is cut (chunked prefill) and continues next step;
- admission: a new request starts its prefill only when its KV, prompt plus output
  tokens, fits in the instance's KV pool (`shared.serving.decode_model.DecodeModel`'s
  capacity, the rule the disaggregated decode admits by) and fewer than
  `decode.max_running_requests` are running; the queue waits behind its head;
- prefix cache: one per instance (`shared.serving.prefix_cache.PrefixCache`, capacity from
  the same GPU's KV memory, as the disaggregated prefill's): cached tokens are not
  computed;
- a request's first token comes out of the step that computes its prompt's last
  chunk (`done`, `first_token`: its TTFT); it then joins the decode batch and gets
  one token per step for the other `output_tokens - 1`, every gap an inter-token
  latency (`itls`), the client's figures of kvstage/metrics/rooms.py;
- the per-request cost of an `[engine]` preset (`request_us`: HTTP, tokenizer,
  streaming; shared/scenario/engines.py) delays its arrival at the scheduler, as the
  disaggregated simulation delays its room.

A step's time: shared/serving/mixed.py `mixed_step_s` (one forward of the running
decodes and the prompt chunks the token budget admits).

Decode-only steps in one event (`jump`). While an instance has no prompt to prefill,
its batch changes only when a room finishes (at a step known since it joined) or a
request arrives (it is admitted at the next step boundary): between two such moments
each step's time is known beforehand. `_plan` computes the steps up to the next finish
or to the first step end at or after the next arrival at the scheduler (known: the
arrivals are the workload's), whichever comes first -- the same `step_time_s` calls
and the same sums, in the same order, as the step-by-step loop -- and puts one event
at the last end; the ends between are the batch's steps for the inter-token gaps. No
request can reach the instance inside a plan, so no plan is ever cut. `jump = False`
steps one event a step (tests/test_colocated_jump.py compares the two).

Routing: round-robin (request i to instance i mod N) or, for every other router,
least-outstanding (fewest requests routed and not yet finished; ties to the lowest
index): there is no staging ring to be aware of.

Scaling (kvstage/explore/autoscale.py drives it): `run(control, interval)` calls
control(engine, now) every `interval` simulated seconds while requests remain;
`add_instance` starts one that takes requests after a start-up delay, `drain_instance`
stops routing to the serving instance with the fewest requests, which goes (`lives`)
when its last one finishes. Requests route only to serving instances.

Left out: preemption (admission reserves the output's KV up front, so none is needed),
speculative decoding, CUDA-graph padding, the retraction SGLang does on KV pressure.

The result is per-request records in `kvstage.metrics.rooms.room_latencies` terms
(`arrival`, `admitted`, `forward_start`, `forward_end`, `done`, `first_token`,
`last_token`, `generate_start`, `generate_end`, `output_tokens`, `itls`; and the
`instance` it was routed to), so a plan takes the same figures
(`kvstage.metrics.steady`) from a colocated run as from a disaggregated one.
"""

from __future__ import annotations

import bisect
import heapq
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstage.shared.admission import Limits, refusal
from kvstage.shared.serving.decode_model import DecodeModel
from kvstage.shared.serving.mixed import mixed_step_s
from kvstage.shared.serving.prefix_cache import BLOCK_TOKENS, PrefixCache
from kvstage.shared.workload import Request, generate_requests

if TYPE_CHECKING:
    from kvstage.shared.scenario import Scenario

__all__ = [
    "ColocatedResult",
    "colocated_scenario",
    "simulate_colocated",
]


def colocated_scenario(scenario: Scenario, tp: int, instances: int, ep: int = 1) -> Scenario:
    """`scenario` served colocated: `instances` instances of TP `tp` (EP `ep`) on the
    decode side's GPU, both sides of the model set alike (the prefill formulas then
    describe a chunk on these GPUs). The scenario's own validation is not run again:
    `colocated_problem` says what does not fit."""
    d = scenario.decode.model_copy(update={"tp": tp, "ep": ep})
    p = scenario.prefill.model_copy(
        update={
            "tp": tp,
            "ep": ep,
            "gpu": d.gpu,
            "memory_utilization": d.memory_utilization,
        }
    )
    c = scenario.cluster.model_copy(
        update={"prefill_instances": instances, "decode_instances": instances}
    )
    return scenario.model_copy(update={"decode": d, "prefill": p, "cluster": c})


def colocated_problem(scenario: Scenario) -> str | None:
    """Why a colocated scenario cannot serve (weights or one chunk do not fit), else None."""
    from kvstage.shared.serving.memory import side_memory

    return side_memory(scenario, "decode").problem() or None


# --------------------------------------------------------------------------- the engine


Control = Callable[["_Engine", float], None]


@dataclass(slots=True)
class _Req:
    req: Request
    arrival: float  # at the scheduler (after the engine's per-request cost)
    computed: int = 0  # prompt tokens done (cached ones included)
    kv: int = 0  # KV tokens reserved: prompt + output


@dataclass(slots=True)
class _Instance:
    index: int
    cache: PrefixCache
    waiting: deque[_Req] = field(default_factory=deque)
    prefilling: list[_Req] = field(default_factory=list)
    # (finish step, room, KV tokens at the end, reserved KV)
    finishing: list[tuple[int, int, int, int]] = field(default_factory=list)
    steps: int = 0
    batch: int = 0  # decoding requests
    kv_tokens: int = 0  # their KV now
    reserved: int = 0  # KV tokens reserved by every admitted request
    outstanding: int = 0  # routed, not finished
    stepping: bool = False
    busy_s: float = 0.0
    step_ends: list[float] = field(default_factory=list)  # when each forward ended
    # the step in flight: its prompt pieces (request, tokens), the decode batch it carries
    pieces: list[tuple[_Req, int]] = field(default_factory=list)
    # decode-only steps in one event (`_Engine._plan`): the ends of the steps planned
    planned: list[float] = field(default_factory=list)
    # scaling (`_Engine.add_instance`, `drain_instance`): asked for at `started`, takes
    # requests from `ready` on, none once draining, gone at `stopped` (its last finished)
    started: float = 0.0
    ready: float = 0.0
    draining: bool = False
    stopped: float | None = None


@dataclass
class ColocatedResult:
    """A colocated run: per-request records (room -> `room_latencies`-style dict)."""

    scenario: Scenario
    requests: list[Request]
    rooms: dict[int, dict[str, float]]
    sim_time_s: float
    wall_s: float
    steps: int
    busy_s: float  # GPU-group seconds of forwards, summed over the instances
    peak_batch: int
    rooms_failed: int = 0
    failed_reason: str = ""
    # per instance: (asked for, taking requests from, gone at) in simulated seconds
    lives: list[tuple[float, float, float]] = field(default_factory=list)

    @property
    def utilization(self) -> float:
        """The instances' share of the run they spent in forwards."""
        n = self.scenario.cluster.decode_instances
        return self.busy_s / (n * self.sim_time_s) if self.sim_time_s > 0 else 0.0


class _Engine:
    def __init__(self, s: Scenario, requests: list[Request]) -> None:
        self.s = s
        self.model = DecodeModel(s)
        self.budget = s.prefill.chunked_prefill_size
        mem = self.model.memory  # the instance's KV memory holds the prefix cache too
        blocks = max(0, int(mem.kv_bytes // (mem.kv_bytes_per_token * BLOCK_TOKENS)))
        n = s.cluster.decode_instances
        self.instances = [_Instance(i, PrefixCache(blocks)) for i in range(n)]
        self.rooms: dict[int, dict[str, float]] = {}
        self.events: list[tuple[float, int, int]] = []  # (time, order, instance)
        self.order = 0
        self.steps = self.peak = self.failed = 0
        self.rr = s.cluster.router == "round-robin"
        preset = s.engine.resolved()
        self.delay = preset.request_us * 1e-6 if preset is not None else 0.0
        self.requests = requests
        self.why = ""
        self.jump = True  # decode-only steps in one event (module docstring)
        self.horizon = math.inf  # the next arrival at the scheduler (`run` keeps it)
        # the instance's whole KV memory holds a room's prompt and output
        self.limits = Limits(
            page_size=self.model.page_size,
            context_tokens=s.model.context_tokens,
            decode_pages=self.model.capacity_pages,
            output_in_pages=True,
        )

    def run(self, control: Control | None = None, interval: float = math.inf) -> float:
        """Serve every request; with `control`, call control(engine, now) every
        `interval` simulated seconds while requests remain (it may add or drain
        instances)."""
        pending = deque(self.requests)
        now, tick = 0.0, interval if control is not None else math.inf
        while pending or self.events:
            next_step = self.events[0][0] if self.events else math.inf
            next_arrival = pending[0].arrival_s + self.delay if pending else math.inf
            if tick <= min(next_step, next_arrival) and pending:
                now = tick
                control(self, now)  # type: ignore[misc]
                tick += interval
                continue
            if next_arrival <= next_step:
                r = pending.popleft()
                now = next_arrival
                self.horizon = pending[0].arrival_s + self.delay if pending else math.inf
                self._arrive(r, now)
                continue
            self.horizon = next_arrival
            now, _, i = heapq.heappop(self.events)
            self._stepped(self.instances[i], now)
        return now

    def serving(self, now: float) -> list[_Instance]:
        """The instances that take new requests now."""
        return [x for x in self.instances if x.ready <= now and not x.draining]

    def add_instance(self, now: float, startup_s: float) -> None:
        """One more instance, taking requests `startup_s` from now."""
        mem = self.model.memory
        blocks = max(0, int(mem.kv_bytes // (mem.kv_bytes_per_token * BLOCK_TOKENS)))
        inst = _Instance(len(self.instances), PrefixCache(blocks), started=now)
        inst.ready = now + startup_s
        self.instances.append(inst)

    def drain_instance(self, now: float) -> bool:
        """Stop routing to the serving instance with the fewest requests; it goes once
        they finish. False when one or none serves."""
        live = self.serving(now)
        if len(live) <= 1:
            return False
        inst = min(live, key=lambda x: (x.outstanding, -x.index))
        inst.draining = True
        if not inst.outstanding:
            inst.stopped = now
        return True

    def _arrive(self, r: Request, now: float) -> None:
        self.rooms[r.room] = {"arrival": r.arrival_s}
        live = self.serving(now) or [min(self.instances, key=lambda x: x.ready)]
        inst = (
            live[r.room % len(live)]
            if self.rr
            else min(live, key=lambda x: (x.outstanding, x.index))
        )
        why = refusal(r, self.limits)  # what an engine refuses (shared/admission.py)
        if why is not None:
            self.rooms[r.room]["failed"] = 1.0
            self.failed += 1
            self.why = f"room {r.room}: {why}"
            return
        inst.outstanding += 1
        self.rooms[r.room]["instance"] = float(inst.index)
        inst.waiting.append(_Req(r, now))
        if not inst.stepping:
            self._step(inst, now)

    def _admit(self, inst: _Instance, now: float) -> None:
        cap, most = self.model.capacity_tokens, self.model.max_batch
        while inst.waiting:
            q = inst.waiting[0]
            need = q.req.prompt_tokens + q.req.output_tokens
            running = inst.batch + len(inst.prefilling)
            if inst.reserved + need > cap or running >= most:
                return
            inst.waiting.popleft()
            q.kv = need
            inst.reserved += need
            q.computed = inst.cache.admit(q.req.hash_ids, q.req.prompt_tokens)
            self.rooms[q.req.room]["admitted"] = now
            inst.prefilling.append(q)

    def _step(self, inst: _Instance, now: float) -> None:
        if inst.waiting:
            self._admit(inst, now)
        if not inst.prefilling:  # the common step: decode only
            inst.pieces = []
            if not inst.batch:
                inst.stepping = False
                return
            inst.stepping = True
            self.peak = max(self.peak, inst.batch)
            if self.jump:
                self._plan(inst, now)
                return
            self._schedule(inst, now, self.model.step_time_s(inst.kv_tokens, inst.batch))
            return
        left = self.budget - inst.batch
        pieces: list[tuple[_Req, int]] = []
        for q in inst.prefilling:
            if left <= 0:
                break
            take = min(left, q.req.prompt_tokens - q.computed)
            pieces.append((q, take))
            left -= take
            info = self.rooms[q.req.room]
            info.setdefault("forward_start", now)
        inst.pieces = pieces
        if not pieces and not inst.batch:
            inst.stepping = False
            return
        inst.stepping = True
        self.peak = max(self.peak, inst.batch)
        dt = mixed_step_s(
            self.s, self.model, inst.batch, inst.kv_tokens, [(t, q.computed) for q, t in pieces]
        )
        self._schedule(inst, now, dt)

    def _schedule(self, inst: _Instance, now: float, dt: float) -> None:
        inst.busy_s += dt
        self.steps += 1
        self.order += 1
        heapq.heappush(self.events, (now + dt, self.order, inst.index))

    def _plan(self, inst: _Instance, now: float) -> None:
        """Decode-only steps in one event: up to the batch's next finish, or to the first
        step end at or after the next arrival, whichever comes first (module docstring).
        Each step's time and end are the step-by-step loop's: the same calls, the same
        sums in the same order."""
        size, kv, t = inst.batch, inst.kv_tokens, now
        step_time_s, horizon, ends = self.model.step_time_s, self.horizon, inst.planned
        for _ in range(inst.finishing[0][0] - inst.steps):
            dt = step_time_s(kv, size)
            inst.busy_s += dt
            t += dt  # as `_schedule` adds a step's time to its start
            ends.append(t)
            kv += size
            if t >= horizon:
                break
        self.steps += len(ends)
        self.order += 1
        heapq.heappush(self.events, (t, self.order, inst.index))

    def _stepped(self, inst: _Instance, now: float) -> None:
        if inst.planned:  # the planned steps before this one: nothing changed at their ends
            k = len(inst.planned) - 1
            inst.step_ends += inst.planned[:k]
            inst.steps += k
            inst.kv_tokens += k * inst.batch
            inst.planned = []
        inst.step_ends.append(now)
        if inst.batch:
            inst.steps += 1
            inst.kv_tokens += inst.batch
            while inst.finishing and inst.finishing[0][0] <= inst.steps:
                _, room, kv_end, reserved = heapq.heappop(inst.finishing)
                inst.batch -= 1
                inst.kv_tokens -= kv_end
                inst.reserved -= reserved
                self._left(inst, now)
                self._finished(inst, room, now)
        if inst.pieces:
            for q, take in inst.pieces:
                q.computed += take
                if q.computed >= q.req.prompt_tokens:
                    self._prefilled(inst, q, now)
            inst.prefilling = [q for q in inst.prefilling if q.computed < q.req.prompt_tokens]
        self._step(inst, now)

    def _prefilled(self, inst: _Instance, q: _Req, now: float) -> None:
        r = q.req
        info = self.rooms[r.room]
        info.update(forward_end=now, done=now, first_token=now, last_token=now)
        if r.output_tokens <= 0:
            inst.reserved -= q.kv
            self._left(inst, now)
            return
        # the prefill's forward made the first token; N - 1 decode steps make the rest
        info.update(generate_start=now, generate_end=now, output_tokens=float(r.output_tokens))
        info["itls"] = []  # type: ignore[assignment]
        if r.output_tokens == 1:
            inst.reserved -= q.kv
            self._left(inst, now)
            return
        heapq.heappush(
            inst.finishing,
            (inst.steps + r.output_tokens - 1, r.room, r.prompt_tokens + r.output_tokens - 1, q.kv),
        )
        inst.batch += 1
        inst.kv_tokens += r.prompt_tokens

    def _left(self, inst: _Instance, now: float) -> None:
        """A request of `inst` is over; a draining instance with none left stops."""
        inst.outstanding -= 1
        if inst.draining and not inst.outstanding:
            inst.stopped = now

    def _finished(self, inst: _Instance, room: int, now: float) -> None:
        """A room's last token: its end and its inter-token gaps (every step since its
        first token carried it)."""
        info = self.rooms[room]
        first = info["first_token"]
        lo = bisect.bisect_right(inst.step_ends, first)
        times = [first, *inst.step_ends[lo:]]
        info.update(generate_end=now, last_token=now)
        info["itls"] = [b - a for a, b in zip(times, times[1:], strict=False)]  # type: ignore[assignment]


def simulate_colocated(
    scenario: Scenario,
    requests: list[Request] | None = None,
    *,
    control: Control | None = None,
    interval: float = math.inf,
    jump: bool = True,
) -> ColocatedResult:
    """Simulate `scenario` served colocated (make it with `colocated_scenario`): its
    workload (`generate_requests`, or `requests`) on `cluster.decode_instances`
    instances of TP `decode.tp`; `control(engine, now)` every `interval` simulated
    seconds may add or drain instances (kvstage/explore/autoscale.py). `jump` False:
    one event a decode step (tests/test_colocated_jump.py compares the two)."""
    wall = time.perf_counter()
    reqs = generate_requests(scenario) if requests is None else requests
    engine = _Engine(scenario, reqs)
    engine.jump = jump
    end = engine.run(control, interval)
    return ColocatedResult(
        scenario=scenario,
        requests=reqs,
        rooms=engine.rooms,
        sim_time_s=end,
        wall_s=time.perf_counter() - wall,
        steps=engine.steps,
        busy_s=sum(i.busy_s for i in engine.instances),
        peak_batch=engine.peak,
        rooms_failed=engine.failed,
        failed_reason=engine.why,
        lives=[
            (x.started, x.ready, end if x.stopped is None else x.stopped) for x in engine.instances
        ],
    )
