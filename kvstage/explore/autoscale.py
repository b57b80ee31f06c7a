"""Load over time: a trace's rate warped by a daily profile, served by instances an
autoscaling policy adds and removes on the simulated clock (`kvstage autoscale`).

The rate warp (`warp_arrivals`). A profile is K factors, one per equal segment of the
workload's span (24 for a day by the hour); normalized to mean 1, so the span and the
request count stay. Arrival times are mapped through the inverse of the cumulative
profile, Lambda(t) = integral of f from 0 to t: a request at t arrives at
Lambda^-1(t), so a process of rate r becomes one of rate r x f(t). Prompts, outputs and
their order are kept.

The policy (`Planner`), after Dynamo's planner ([C] ai-dynamo/dynamo
components/planner: it scales prefill and decode workers from observed load and
throughput per replica at the SLA, every adjustment interval, never below a minimum):
every `interval` simulated seconds it reads the arrival rate over the last interval
and the requests waiting for a prefill, and asks for

    instances = ceil(rate / capacity_rps) + ceil(waiting / queue_per_instance)

clamped to [floor, ceiling]: `capacity_rps` is what one instance serves within the
SLO (the caller's: by default the fixed plan's rate over its instances), the queue term
adds an instance per `queue_per_instance` requests waiting. More than running: new
instances, each taking requests `startup_s` later (model load; paid from the request).
Fewer: one instance drains per interval (no new requests; it goes when its last
finishes), and only after `cooldown_s` without a scale-up, so a brief dip does not
shed capacity it needs again.

What it serves with: the colocated engine (kvstage/sim/colocated.py), whose instances
can come and go on its clock. Prefill and decode scaled apart on the disaggregated
simulation: kvstage/explore/autoscale_disagg.py.

Output (`run_day`): per interval the instances asked for and serving, the arrival
rate, the waiting requests, and the SLO attainment of the requests that arrived in it;
GPU-hours used (each instance from its request to its end, x TP) against a fixed plan
of `fixed_instances` over the whole span; a figure (`day_figure`).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from itertools import accumulate
from typing import TYPE_CHECKING, Any

from kvstage.explore.executor import ExploreError

if TYPE_CHECKING:
    from kvstage.shared.scenario import Scenario
    from kvstage.shared.workload import Request

__all__ = [
    "DAY_PROFILE",
    "Planner",
    "attainment_by_interval",
    "parse_profile",
    "run_day",
    "warp_arrivals",
]

# [A] a diurnal shape for illustration, by the hour from midnight: a night trough at a
# fifth of the peak, a morning ramp, a daytime plateau and an evening peak. Not fitted
# to any published trace; pass --profile for a measured one.
DAY_PROFILE = (
    0.3, 0.25, 0.2, 0.2, 0.25, 0.35, 0.5, 0.7, 0.9, 1.0, 1.05, 1.1,
    1.1, 1.05, 1.05, 1.1, 1.15, 1.2, 1.3, 1.35, 1.25, 1.0, 0.7, 0.45,
)  # fmt: skip


def parse_profile(text: str | None) -> tuple[float, ...]:
    """`--profile 0.5,1,2` -> factors; "day" (or None) the built-in DAY_PROFILE."""
    if text is None or text == "day":
        return DAY_PROFILE
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        try:
            v = float(item)
        except ValueError:
            v = math.nan
        if not math.isfinite(v) or v <= 0:
            raise ExploreError(
                f"--profile {text!r}: {item!r} is not a factor > 0 (e.g. 0.5,1,2 or day)"
            )
        out.append(v)
    if not out:
        raise ExploreError(f"--profile {text!r}: no factor given (e.g. 0.5,1,2 or day)")
    return tuple(out)


def warp_arrivals(
    requests: list[Request], profile: tuple[float, ...], span_s: float | None = None
) -> list[Request]:
    """The requests with arrivals warped by `profile` over `span_s` (default: the last
    arrival), see the module docstring."""
    from dataclasses import replace

    if not requests:
        return []
    span = span_s or requests[-1].arrival_s or 1.0
    mean = sum(profile) / len(profile)
    f = [x / mean for x in profile]
    seg = span / len(f)
    cum = [0.0, *accumulate(x * seg for x in f)]  # Lambda at the segment boundaries

    def inverse(t: float) -> float:
        if t >= cum[-1]:
            return span + (t - cum[-1])
        i = min(bisect.bisect_right(cum, t) - 1, len(f) - 1)
        return i * seg + (t - cum[i]) / f[i]

    return [replace(r, arrival_s=inverse(r.arrival_s)) for r in requests]


@dataclass
class Planner:
    """The autoscaling policy (module docstring); `__call__(engine, now)` is the
    engine's control hook."""

    capacity_rps: float
    floor: int = 1
    ceiling: int = 64
    startup_s: float = 120.0
    interval_s: float = 60.0
    queue_per_instance: int = 8
    cooldown_s: float = 300.0
    arrivals: list[float] = field(default_factory=list)  # arrival times, sorted
    timeline: list[dict[str, Any]] = field(default_factory=list)
    _last_up: float = -math.inf

    def target(self, rate: float, waiting: int) -> int:
        want = math.ceil(rate / self.capacity_rps - 1e-9) if self.capacity_rps > 0 else 0
        want += math.ceil(waiting / self.queue_per_instance) if waiting else 0
        return max(self.floor, min(self.ceiling, want))

    def __call__(self, engine: Any, now: float) -> None:
        lo = bisect.bisect_left(self.arrivals, now - self.interval_s)
        hi = bisect.bisect_left(self.arrivals, now)
        rate = (hi - lo) / self.interval_s
        waiting = sum(len(x.waiting) for x in engine.instances if x.stopped is None)
        running = [x for x in engine.instances if not x.draining and x.stopped is None]
        want = self.target(rate, waiting)
        if want > len(running):
            for _ in range(want - len(running)):
                engine.add_instance(now, self.startup_s)
            self._last_up = now
        elif want < len(running) and now - self._last_up >= self.cooldown_s:
            engine.drain_instance(now)
        self.timeline.append(
            {
                "t_s": now,
                "rate_rps": rate,
                "waiting": waiting,
                "target": want,
                "instances": sum(
                    1 for x in engine.instances if not x.draining and x.stopped is None
                ),
                "serving": len(engine.serving(now)),
            }
        )


def attainment_by_interval(
    rooms: dict[int, dict[str, float]], targets: dict[str, float], interval: float, n: int
) -> list[float | None]:
    from kvstage.metrics.rooms import meets, request_figures

    hit, seen = [0] * n, [0] * n
    for info in rooms.values():
        k = min(n - 1, int(info["arrival"] // interval))
        seen[k] += 1
        hit[k] += meets(request_figures(info), targets)
    return [h / s if s else None for h, s in zip(hit, seen, strict=True)]


def gpu_hours(lives: list[tuple[float, float, float]], tp: int) -> float:
    """GPU-hours of instances living (asked for, ready, gone) at TP `tp`."""
    return sum(end - start for start, _, end in lives) * tp / 3600


def run_day(
    scenario: Scenario, requests: list[Request], planner: Planner, fixed_instances: int
) -> dict[str, Any]:
    """Serve `requests` on the colocated `scenario` (TP `decode.tp`, starting with
    `planner.floor` instances) under `planner`; the timeline, attainment and GPU-hours
    against `fixed_instances` held for the whole span."""
    from kvstage.metrics.rooms import meets, request_figures
    from kvstage.sim.colocated import simulate_colocated

    c = scenario.cluster.model_copy(
        update={
            "decode_instances": planner.floor,
            "prefill_instances": planner.floor,
            "router": "least-outstanding",
        }
    )
    s = scenario.model_copy(update={"cluster": c})
    planner.arrivals = [r.arrival_s for r in requests]
    r = simulate_colocated(s, requests, control=planner, interval=planner.interval_s)
    targets = scenario.slo.targets()
    n = max(1, len(planner.timeline))
    by = attainment_by_interval(r.rooms, targets, planner.interval_s, n)
    for row, att in zip(planner.timeline, by, strict=False):
        row["slo_attainment"] = att
    met = sum(meets(request_figures(i), targets) for i in r.rooms.values())
    tp = scenario.decode.tp
    return {
        "requests": len(requests),
        "slo_attainment": met / len(requests) if requests else 0.0,
        "gpu_hours": gpu_hours(r.lives, tp),
        "fixed_gpu_hours": fixed_instances * tp * r.sim_time_s / 3600,
        "fixed_instances": fixed_instances,
        "peak_instances": max((x["instances"] for x in planner.timeline), default=planner.floor),
        "span_s": r.sim_time_s,
        "timeline": planner.timeline,
        "lives": r.lives,
    }


def day_figure(day: dict[str, Any], title: str) -> Any:
    """Instances (asked for, serving) against the fixed plan -- per side when the day is
    disaggregated (kvstage/explore/autoscale_disagg.py) -- the arrival rate, and SLO
    attainment over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = day["timeline"]
    hours = [x["t_s"] / 3600 for x in tl]
    fig, (a, b) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    fixed = day["fixed_instances"]
    split = isinstance(fixed, dict)
    series = (
        [
            (f"{n}_", f"{n} ", fixed[n], c)
            for n, c in (("prefill", "tab:blue"), ("decode", "tab:green"))
        ]
        if split
        else [("", "", fixed, "tab:blue")]
    )
    for key, label, plan, color in series:
        a.step(hours, [x[f"{key}instances"] for x in tl], where="post", color=color,
               label=f"{label}instances (asked for)")  # fmt: skip
        a.step(hours, [x[f"{key}serving"] for x in tl], where="post", color=color, ls=":",
               label=f"{label}serving")  # fmt: skip
        a.axhline(plan, color=color, ls="--", alpha=0.5, label=f"{label}fixed plan")
    a.set_ylabel("instances")
    r = a.twinx()
    r.plot(hours, [x["rate_rps"] for x in tl], color="tab:red", alpha=0.5, lw=1)
    r.set_ylabel("arrivals / s", color="tab:red")
    a.legend(loc="upper left", fontsize=7, ncol=2 if split else 1)
    b.plot(hours, [x.get("slo_attainment") for x in tl], marker=".", lw=1)
    b.set_ylim(0, 1.05)
    b.set_ylabel("SLO attainment")
    b.set_xlabel("hours")
    a.set_title(
        f"{title}{', disaggregated' if split else ''}: {day['gpu_hours']:.1f} GPU-hours "
        f"autoscaled vs {day['fixed_gpu_hours']:.1f} fixed; attainment "
        f"{day['slo_attainment']:.1%}"
    )
    fig.tight_layout()
    return fig
