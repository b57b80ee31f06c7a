"""In-run factors of the host model, fitted from a short hardware run (`kvstage calibrate`).

The probe (hw/probes/engine.py) times each kind of work alone: one fill, one gather, one
ping-pong. Among busy rank processes a step takes longer than that, beyond what the
simulator's shared cores (sim/host.py) explain: on this 2-core host fills took 5-8x,
gathers and scatters 8-10x and control messages 10-40x their lone cost while the host
was not saturated on average. (A rank's Python threads share one interpreter lock, a
loop notices finished work at its next poll, a wake-up waits for a core.) So
calibrate also runs one small hardware scenario of its own (`CAL_SCENARIO`, P1 -> D1:
not a case of benchmarks/fidelity.py's suite) and fits five host-model factors so
that the simulation of that scenario gives its mean step times:

  fill_scale     the forward (prefill compute span)
  copy_scale     gather and scatter spans
  event_scale    a loop's time per event (STAGING_REQ delays: a room's requests arrive
                 at the decode in a burst and wait for its loop, one event at a time)
  control_scale  the control latency (STAGING_RSP and CHUNK_READY delays)
  write_scale    bulk writes (posting and copy; NIXL copies inside the loop's write())

by damped fixed-point iteration, factor *= (hw mean / simulated mean) ** 0.8, keeping
the round closest to the hw run (`fit_factors`, pure: tests give it a model).

Two more runs' worth of numbers go with them:
- the same run with a quarter of the KV heads (`CAL_SMALL`: every gather and scatter a
  quarter of the bytes) took 0.72-0.81 ms per copy against 0.99-1.52 ms, where the
  copies alone differ 3.3x: each copy also costs its rank a fixed part (the hand-off to
  the copy thread, the index glue, the completion that wakes the loop), copy_op_us.
  The factors are fitted to both runs at once (joint_steps);
- the ranks measure what each fill, gather, scatter and NIXL lane copy costs in CPU
  (summary.json job_cpu, hw/transport/jobcpu.py): fills took 1.0-1.2 ms of CPU of 2.5-2.9 ms in
  their thread, NIXL's copies 1.1x their time alone where write_scale had charged
  2.3-4.1x. copy_op_us comes from the two runs' copy CPU (t = s * (op + alone),
  closed form, copy_op_from_runs: the cores' sharing does not stretch CPU seconds, and
  the copies' wall times had once given the small run's copies longer than the big
  one's). `cpu_factors` also gives fill_cpu_scale, copy_cpu_scale and write_cpu_scale,
  which the profile notes without setting them (why: its docstring). Without job_cpu
  (older sidecars), copy_op comes from the two runs' copy times, corrected against
  their simulation.
The factors then hold for every scenario simulated with the profile; the shared cores
still change with each scenario's load over time.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from functools import partial
from typing import Any

from kvstage.metrics.steps import phase_samples, step_mean

# kind of step -> the profile field that scales it, and the steps (kvstage/metrics/steps.py) it is
FACTORS: dict[str, tuple[str, tuple[str, ...]]] = {
    "fill": ("fill_scale", ("forward",)),
    "copy": ("copy_scale", ("gather", "scatter")),
    "event": ("event_scale", ("ctrl STAGING_REQ",)),  # a burst queued at the decode's loop
    "control": ("control_scale", ("ctrl STAGING_RSP", "ctrl CHUNK_READY")),
    "write": ("write_scale", ("write",)),
}
FACTOR_RANGE = (0.2, 100.0)  # a factor outside this is a broken run, not a host
FLOOR = {"event_scale": 1.0}  # a loop's time per event is at least its CPU
ROUNDS = 8
DAMPING = 0.8

CAL_SCENARIO: dict[str, Any] = {
    "name": "calibrate-inrun",
    "description": "kvstage calibrate: in-run step times of P1 -> D1 (kvstage/calibrate/inrun.py)",
    "model": {"layers": 4, "kv_heads": 8, "head_dim": 64, "params_b": 0.5},
    "prefill": {"tp": 1, "chunked_prefill_size": 256},
    "decode": {"tp": 1, "page_size": 16, "staging_pool_mb": 32},
    "transfer": {"path": "staging", "room_timeout_s": 60},
    "links": {"profile": "loopback-cpu", "placement": "intra"},
    "workload": {
        "requests": 8,
        "arrival": "fixed",
        "rate_per_s": 6.0,
        "prompt": "uniform",
        "prompt_min": 512,
        "prompt_max": 2048,
        "seed": 5,
    },
    "hardware": {"device": "cpu", "verify": "sample"},
}
# The same run with a quarter of the KV bytes per copy (copy_op_from_runs)
CAL_SMALL: dict[str, Any] = {
    **CAL_SCENARIO,
    "name": "calibrate-inrun-small",
    "description": "kvstage calibrate: in-run copies of a quarter the bytes (kvstage/calibrate/inrun.py)",
    "model": {**CAL_SCENARIO["model"], "kv_heads": 2},
}
COPY_OP_MAX_S = 2e-3  # a fixed part above this is a broken run, not a host
OP_ROUNDS = 4  # corrections of copy_op against the simulated CAL_SMALL run
CPU_FIELDS = ("fill_cpu_scale", "copy_cpu_scale", "write_cpu_scale")  # cpu_factors


def kind_means(records: list) -> dict[str, float]:
    """Mean seconds of each kind of step (FACTORS) in a trace."""
    samples = phase_samples(records)
    return {kind: step_mean(samples, *steps) for kind, (_, steps) in FACTORS.items()}


def copy_bytes_mean(records: list) -> float:
    """Mean bytes of the copies `kind_means` times (prefill gathers, decode scatters)."""
    xs = [
        r.bytes
        for r in records
        if (r.phase, r.role) in (("gather", "prefill"), ("scatter", "decode"))
    ]
    return statistics.fmean(xs) if xs else math.nan


def copy_op_from_runs(big: tuple[float, float], small: tuple[float, float]) -> float:
    """The fixed CPU part of a copy, `op`, from two runs' (mean copy seconds in the run,
    mean copy seconds alone) with the same slowdown s: t = s * (op + alone) for both,
    so op = (t_small * alone_big - t_big * alone_small) / (t_big - t_small), kept within
    [0, COPY_OP_MAX_S]. 0 when the runs cannot tell (the bigger copies not slower)."""
    (tb, ab), (ts, as_) = big, small
    if not all(x == x and x > 0 for x in (tb, ab, ts, as_)) or tb <= ts or ab <= as_:
        return 0.0
    return min(COPY_OP_MAX_S, max(0.0, (ts * ab - tb * as_) / (tb - ts)))


def loop_is_realtime(inrun: dict | None, key: str = "loop_sched") -> bool:
    """Whether every rank of the in-run hardware run got a real-time class for its loop
    (summary.json loop_sched, hw/rank/priority.py LoopPriority: the host model's loop_rt), or with
    key="engine_sched" for its transfer engine's threads (WritePriority: write_rt)."""
    from kvstage.run.conditions import all_realtime

    return all_realtime(((inrun or {}).get(key) or {}).values())


def _worst(target: dict[str, float], got: dict[str, float]) -> float:
    errs = [
        abs(got[k] - t) / t
        for k, t in target.items()
        if t == t and t > 0 and got.get(k, math.nan) == got.get(k)
    ]
    return max(errs, default=math.inf)


def fit_factors(
    target: dict[str, float],
    simulate: Callable[[dict[str, float]], dict[str, float]],
    rounds: int = ROUNDS,
) -> tuple[dict[str, float], list[dict]]:
    """Factors (FACTORS' fields) such that simulate(factors) ~ target, per kind of step,
    by factor *= (target / simulated) ** DAMPING (the factors act on each other's steps:
    a slower loop also delays writes, so a full step can overshoot); returns the round
    whose worst relative step error is least, and the history of every round."""
    factors = {name: 1.0 for name, _ in FACTORS.values()}
    history: list[dict] = []
    lo, hi = FACTOR_RANGE
    for _ in range(rounds):
        got = simulate(dict(factors))
        history.append({"factors": dict(factors), "simulated": got, "worst": _worst(target, got)})
        for kind, (name, _) in FACTORS.items():
            t, g = target.get(kind, math.nan), got.get(kind, math.nan)
            if t == t and g == g and t > 0 and g > 0:
                factors[name] = min(
                    hi, max(FLOOR.get(name, lo), factors[name] * (t / g) ** DAMPING)
                )
    best = min(history, key=lambda h: h["worst"])
    return best["factors"], history


def fit_profile(fields: dict[str, Any], inrun: dict | None) -> dict[str, Any]:
    """The factors for a profile's `fields` (kvstage/calibrate/profile.py's profile_fields) from
    the in-run measurement, and copy_op_us where it has a CAL_SMALL run; {} when there is
    none or its run failed.

    The factors are fitted to both runs at once (joint_steps), so each rests on twice
    the samples: fitted to one 8-request run, NIXL's fill_scale came out anywhere from
    3.4 to 7.7 on this host. copy_op comes from the two runs' copy CPU (cpu_factors);
    where the runs did not measure it, it starts at the closed form on their copy times
    (copy_op_from_runs) and is corrected against the simulation of CAL_SMALL: with the
    factors fitted, op moves by the small run's copy error over its current slowdown
    (the two runs share their cores differently, so the closed form alone is off by a
    third on a simulated pair)."""
    if not inrun or not inrun.get("ok"):
        return {}
    from kvstage.shared.scenario import scenario_from_dict
    from kvstage.sim.driver import Simulation

    links = {
        k: v
        for k, v in fields.items()
        if k not in {name for name, _ in FACTORS.values()} | {"copy_op_us", *CPU_FIELDS}
    }
    # the factors are what the shared cores do not explain: fit them with the load other
    # processes put on the host during that run
    cond = inrun.get("conditions") or {}
    if cond.get("other_cpu_share") is not None:
        links["background_cores"] = cond["other_cpu_share"] * (cond.get("cores") or 1)

    def simulate(data: dict, factors: dict[str, float], op_s: float) -> dict[str, float]:
        extra = {"copy_op_us": op_s * 1e6} if op_s > 0 else {}
        data = {**data, "links": {**data["links"], **links, **factors, **extra}}
        return kind_means(Simulation(scenario_from_dict(data), check=False).run().records)

    small = inrun.get("small") if (inrun.get("small") or {}).get("ok") else None
    target = joint_steps(inrun["steps"], small["steps"] if small else None)

    def simulate_both(factors: dict[str, float], op_s: float) -> dict[str, float]:
        big = simulate(CAL_SCENARIO, factors, op_s)
        return joint_steps(big, simulate(CAL_SMALL, factors, op_s) if small else None)

    # the steps' CPU (job_cpu): copy_op is CPU by definition, so it comes from there; the
    # *_cpu_scale are recorded but not set (fidelity with them set: see cpu_factors)
    cpu = cpu_factors(fields, [inrun, *([small] if small else [])])
    if "copy_op_us" in cpu:  # measured: the copies' CPU in the two runs (cpu_factors)
        op_s, rounds = cpu["copy_op_us"] / 1e6, 0
    else:  # from the two runs' copy times, corrected against their simulation
        op_s = _copy_op(fields, inrun)
        rounds = OP_ROUNDS if op_s > 0 else 0
    for _ in range(rounds):
        factors, _ = fit_factors(target, partial(simulate_both, op_s=op_s))
        got, want = simulate(CAL_SMALL, factors, op_s)["copy"], small["steps"]["copy"]
        slowdown = got / (op_s + _copy_alone(fields, small))  # span per CPU second of a copy
        op_s = min(COPY_OP_MAX_S, max(0.0, op_s + (want - got) / slowdown))
    factors, history = fit_factors(target, partial(simulate_both, op_s=op_s))
    return {
        "factors": factors,
        "target": target,
        "history": history,
        "copy_op_us": op_s * 1e6,
        "cpu": {k: v for k, v in cpu.items() if k != "copy_op_us"},
    }


def cpu_factors(fields: dict[str, Any], runs: list[dict]) -> dict[str, float]:
    """fill_cpu_scale, copy_cpu_scale with copy_op_us, and write_cpu_scale (NIXL: its lane
    copies) from the in-run runs' job CPU (summary.json job_cpu, hw/transport/jobcpu.py) over what
    the probe's numbers give those jobs alone; {} for runs that did not measure it. The
    copy's fixed part is the closed form of copy_op_from_runs on CPU seconds, which the
    cores' sharing does not stretch.

    calibrate writes the *_cpu_scale into the profile as comments, not as fields: set
    (sim/host.py split_work: a step's CPU is alone x that, the rest of its *_scale a
    wait without a core), they brought Mooncake's room error from 11.5% to 8.4% and
    NIXL's from 31.9% to 26.5% on one set of hw runs, but NIXL's from 16.6% to 35.2% on
    the next (benchmarks/fidelity.py, 2026-12-01): a wait that is fixed per step does
    not grow with a busier host as waiting for a core does."""

    def per_run(
        kinds: tuple[str, ...], alone: Callable[[float], float]
    ) -> list[tuple[float, float]]:
        out = []
        for run in runs:
            jobs = [(run.get("job_cpu") or {}).get(k) for k in kinds]
            n = sum(j["n"] for j in jobs if j)
            if not all(jobs) or not n:
                return []
            out.append(
                (sum(j["cpu_s"] for j in jobs) / n, alone(sum(j["bytes"] for j in jobs) / n))
            )
        return out

    out: dict[str, float] = {}
    fill = per_run(
        ("fill",),
        lambda b: fields["fill_latency_us"] / 1e6 + b / (fields["fill_bandwidth_gbs"] * 1e9),
    )
    if fill:
        out["fill_cpu_scale"] = sum(c for c, _ in fill) / sum(a for _, a in fill)
    copy = per_run(("gather", "scatter"), lambda b: _copy_alone(fields, {"copy_bytes": b}))
    if len(copy) == 2:
        out["copy_op_us"] = copy_op_from_runs(copy[0], copy[1]) * 1e6
    if copy:
        c, a = copy[0]
        out["copy_cpu_scale"] = c / (a + out.get("copy_op_us", 0.0) / 1e6)
    lat = (fields.get("intra_latency_us", 0.0) + fields.get("intra_per_batch_us", 0.0)) / 1e6
    write = per_run(
        ("write",), lambda b: lat + b / (fields.get("intra_bandwidth_gbps", math.inf) * 1e9 / 8)
    )
    if write and fields.get("write_on_cpu"):
        out["write_cpu_scale"] = sum(c for c, _ in write) / sum(a for _, a in write)
    return {k: round(v, 4) for k, v in out.items()}


def joint_steps(big: dict[str, float], small: dict[str, float] | None) -> dict[str, float]:
    """What the factors are fitted to with both in-run runs: per kind of step the
    geometric mean of the two runs' means (twice the samples, two geometries), but the
    copy: CAL_SCENARIO's alone (CAL_SMALL's copy fits copy_op instead)."""
    if small is None:
        return dict(big)
    out = {
        k: math.sqrt(v * small[k]) if v > 0 and small.get(k, 0) > 0 else math.nan
        for k, v in big.items()
    }
    out["copy"] = big["copy"]
    return out


def _copy_alone(fields: dict[str, Any], run: dict) -> float:
    """What the simulator charges a copy alone (sim/gpu.py copy_time: launch + read and
    write of its bytes) at the run's mean copy size."""
    launch, bw = fields.get("kernel_launch_us", 0.0) / 1e6, fields["mem_bandwidth_gbs"] * 1e9
    return launch + 2.0 * run.get("copy_bytes", math.nan) / bw


def _copy_op(fields: dict[str, Any], inrun: dict) -> float:
    """copy_op_from_runs for the in-run measurement (0 without a good CAL_SMALL run)."""
    small = inrun.get("small") or {}
    if not small.get("ok") or not fields.get("mem_bandwidth_gbs"):
        return 0.0
    return copy_op_from_runs(
        (inrun["steps"].get("copy", math.nan), _copy_alone(fields, inrun)),
        (small["steps"].get("copy", math.nan), _copy_alone(fields, small)),
    )
