"""An autoscaled day on the disaggregated simulation: prefill and decode instances
scaled separately (`kvstage autoscale --disaggregated`).

The policy (`SidePlanner`) is Dynamo's SLA planner's rule ([C] ai-dynamo/dynamo at
e20adb44366fff2154c4b9cc0abe3a8bc8071446 components/src/dynamo/planner/utils/
planner_core.py `_compute_replica_requirements`): every adjustment interval

    prefill replicas = ceil(prompt tokens/s / one prefill engine's prompt tokens/s)
    decode replicas  = ceil(output tokens/s / one decode engine's output tokens/s)

each at least the floor (`min_endpoint` there). Dynamo predicts the next interval's
load and reads an engine's throughput from profiled sweeps; here the load is the last
interval's arrivals (their prompt and output tokens) and an engine's throughput is
the caller's (by default the fixed plan's: the warped trace's peak-segment tokens/s
over the fixed plan's instances of that side, a fixed plan sized for the peak). The
rest is the colocated planner's (kvstage/explore/autoscale.py): a ceiling, a new
instance takes requests `startup_s` after it is asked for, one instance per side
drains per interval and only `cooldown_s` after that side's last scale-up.

What it serves with: the disaggregated simulation (sim/driver.py) built with each
side's ceiling of instances, their GPUs and NICs in place (a cluster's nodes are there
whether or not an instance runs on them); the router (least-outstanding, as the
colocated day's) sends new requests only to the instances the planner has open
(sim/cluster.py `LiveLoads.closed`). An instance draining takes no new room and is gone
at the first decision after its last room ended there (so its GPU time is counted up
to one interval long). Its rooms finish where they are: a drained decode instance
keeps generating until its batch is empty.

Output: per interval the rate, the prompt and output tokens/s, each side's target,
instances asked for and serving, and the SLO attainment of the requests that arrived
in it; GPU-hours (each instance's life x its side's TP) against the fixed plan's
instances held all day.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvstage.explore.autoscale import attainment_by_interval

if TYPE_CHECKING:
    from kvstage.shared.scenario import Scenario
    from kvstage.shared.workload import Request
    from kvstage.sim.driver import Simulation

__all__ = [
    "SIDES",
    "DisaggPlanner",
    "SidePlanner",
    "peak_capacities",
    "run_disagg_day",
]

SIDES = ("prefill", "decode")


@dataclass
class SidePlanner:
    """One side's instances: targets from tokens/s over one engine's, bounds, lives.

    The simulation has `ceiling` instance slots; a life is one instance in one slot:
    [slot, asked for, ready, drained (None unless draining), gone (None while it
    lives)]."""

    capacity_tps: float  # tokens/s one instance serves within the SLO
    floor: int = 1
    ceiling: int = 8
    lives: list[list[Any]] = field(default_factory=list)
    current: dict[int, int] = field(default_factory=dict)  # slot -> its life in `lives`
    draining: set[int] = field(default_factory=set)  # slots
    last_up: float = -math.inf

    def target(self, tps: float) -> int:
        want = math.ceil(tps / self.capacity_tps - 1e-9) if self.capacity_tps > 0 else 0
        return max(self.floor, min(self.ceiling, want))

    def running(self) -> list[int]:
        """Slots with an instance asked for, not draining."""
        return [s for s in self.current if s not in self.draining]

    def serving(self, now: float) -> list[int]:
        return [s for s in self.running() if self.lives[self.current[s]][2] <= now]

    def closed(self, now: float) -> set[int]:
        return set(range(self.ceiling)) - set(self.serving(now))

    def add(self, now: float, ready: float) -> bool:
        """An instance in a free slot (False when none is free)."""
        free = sorted(set(range(self.ceiling)) - set(self.current))
        if not free:
            return False
        self.current[free[0]] = len(self.lives)
        self.lives.append([free[0], now, ready, None, None])
        return True

    def drain(self, slot: int, now: float) -> None:
        self.draining.add(slot)
        self.lives[self.current[slot]][3] = now

    def gone(self, slot: int, now: float) -> None:
        self.lives[self.current.pop(slot)][4] = now
        self.draining.discard(slot)


@dataclass
class DisaggPlanner:
    """Both sides' planners and the shared policy settings; `__call__(sim, now)` is the
    simulation's control hook."""

    prefill: SidePlanner
    decode: SidePlanner
    startup_s: float = 120.0
    interval_s: float = 60.0
    cooldown_s: float = 300.0
    arrivals: list[float] = field(default_factory=list)
    prompt: list[int] = field(default_factory=list)  # prompt tokens, in arrival order
    output: list[int] = field(default_factory=list)
    timeline: list[dict[str, Any]] = field(default_factory=list)

    def side(self, name: str) -> SidePlanner:
        return self.prefill if name == "prefill" else self.decode

    def start(self, requests: list[Request]) -> None:
        """The arrivals to read rates from; each side's floor serving at time 0."""
        reqs = sorted(requests, key=lambda r: r.arrival_s)
        self.arrivals = [r.arrival_s for r in reqs]
        self.prompt = [r.prompt_tokens for r in reqs]
        self.output = [r.output_tokens for r in reqs]
        for p in (self.prefill, self.decode):
            p.lives, p.current, p.draining = [], {}, set()
            for _ in range(p.floor):
                p.add(0.0, 0.0)

    def __call__(self, sim: Simulation, now: float) -> None:
        lo = bisect.bisect_left(self.arrivals, now - self.interval_s)
        hi = bisect.bisect_left(self.arrivals, now)
        row: dict[str, Any] = {"t_s": now, "rate_rps": (hi - lo) / self.interval_s}
        tps = {
            "prefill": sum(self.prompt[lo:hi]) / self.interval_s,
            "decode": sum(self.output[lo:hi]) / self.interval_s,
        }
        for name in SIDES:
            want = self._decide(sim, name, tps[name], now)
            p = self.side(name)
            row |= {
                f"{name}_tps": tps[name],
                f"{name}_target": want,
                f"{name}_instances": len(p.running()),
                f"{name}_serving": len(p.serving(now)),
            }
        self.timeline.append(row)

    def _decide(self, sim: Simulation, name: str, tps: float, now: float) -> int:
        p, loads = self.side(name), sim.loads
        outstanding = loads.outstanding(name) if loads is not None else [0] * p.ceiling
        for slot in sorted(p.draining):  # a drained instance with no room left is gone
            if outstanding[slot] == 0:
                p.gone(slot, now)
        want, running = p.target(tps), p.running()
        if want > len(running):
            added = sum(p.add(now, now + self.startup_s) for _ in range(want - len(running)))
            if added:
                p.last_up = now
                ev = sim.env.timeout(self.startup_s)  # open them when their start-up ends
                ev.callbacks.append(lambda _ev: self._open(sim, name))
        elif want < len(running) and now - p.last_up >= self.cooldown_s:
            live = p.serving(now)
            if len(live) > 1:  # the emptiest serving instance drains
                p.drain(min(live, key=lambda s: (outstanding[s], -s)), now)
        self._open(sim, name)
        return want

    def _open(self, sim: Simulation, name: str) -> None:
        if sim.loads is not None:
            sim.loads.closed[name] = self.side(name).closed(sim.env.now)


def peak_capacities(
    requests: list[Request], profile: tuple[float, ...], prefill: int, decode: int
) -> tuple[float, float]:
    """One instance's share of the peak, per side: the warped trace's mean prompt and
    output tokens/s scaled to its busiest segment, over the fixed plan's instances."""
    span = max(r.arrival_s for r in requests) or 1.0
    peak = max(profile) / (sum(profile) / len(profile))
    prompt = sum(r.prompt_tokens for r in requests) / span * peak
    output = sum(r.output_tokens for r in requests) / span * peak
    return prompt / prefill, output / decode


def run_disagg_day(
    scenario: Scenario, requests: list[Request], planner: DisaggPlanner
) -> dict[str, Any]:
    """Serve `requests` on the disaggregated `scenario` (its TPs; its prefill and decode
    instances the fixed plan) with `planner` opening and closing instances."""
    from kvstage.metrics.rooms import meets, request_figures, room_latencies
    from kvstage.shared.cluster import cluster_sessions
    from kvstage.sim.driver import Simulation

    fixed = scenario.cluster
    c = fixed.model_copy(
        update={
            "prefill_instances": planner.prefill.ceiling,
            "decode_instances": planner.decode.ceiling,
            "router": "least-outstanding",
            "shard": False,
        }
    )
    s = scenario.model_copy(update={"cluster": c})
    planner.start(requests)
    sim = Simulation(
        s,
        workload=(requests, *cluster_sessions(s, requests)),
        control=planner,
        interval=planner.interval_s,
    )
    if sim.loads is not None:
        for name in SIDES:
            sim.loads.closed[name] = planner.side(name).closed(0.0)
    result = sim.run()
    rooms = room_latencies(result.records)
    targets = scenario.slo.targets()
    n = max(1, len(planner.timeline))
    by = attainment_by_interval(rooms, targets, planner.interval_s, n)
    for row, att in zip(planner.timeline, by, strict=False):
        row["slo_attainment"] = att
    met = sum(meets(request_figures(i), targets) for i in rooms.values())
    end = result.sim_time_s
    tp = {"prefill": scenario.prefill.tp, "decode": scenario.decode.tp}
    lives = {name: [(*x[:4], end if x[4] is None else x[4]) for x in planner.side(name).lives]
             for name in SIDES}  # fmt: skip
    hours = sum((x[4] - x[1]) * tp[name] for name in SIDES for x in lives[name]) / 3600
    fixed_gpus = fixed.prefill_instances * tp["prefill"] + fixed.decode_instances * tp["decode"]
    return {
        "requests": len(requests),
        "slo_attainment": met / len(requests) if requests else 0.0,
        "gpu_hours": hours,
        "fixed_gpu_hours": fixed_gpus * end / 3600,
        "fixed_instances": {"prefill": fixed.prefill_instances, "decode": fixed.decode_instances},
        "peak_instances": {
            name: max((x[f"{name}_instances"] for x in planner.timeline), default=0)
            for name in SIDES
        },
        "span_s": end,
        "timeline": planner.timeline,
        "lives": lives,
        "routes": dict(sim.sessions.routes),
        "violations": len(result.violations),
    }
