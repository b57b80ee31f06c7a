"""The measuring of `kvstage calibrate` on this machine: the probes' raw points
(kvstage.hw.probes), the state machine's CPU per event, hardware mode's rank-loop
constants and the in-run hardware runs whose step times the in-run factors are fitted
to (kvstage/calibrate/inrun.py). Everything a profile is fitted from is in the dict
`measure` returns (the sidecar's [raw]).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvstage.calibrate.inrun import CAL_SCENARIO, CAL_SMALL, copy_bytes_mean, kind_means
from kvstage.hw.probes import engine as probe
from kvstage.hw.probes.engine import CalibrationPlan
from kvstage.hw.probes.harness import ProgressFn
from kvstage.hw.probes.hosts import ProbeHost, inter_host
from kvstage.hw.probes.posting import PostingPlan, measure_posting

__all__ = [
    "measure",
    "measure_handle_cost",
    "measure_inrun",
    "measured_where",
    "rank_loop_constants",
]


def measure(
    backend: str,
    device: str = "cpu",
    plan: CalibrationPlan | None = None,
    progress: ProgressFn | None = None,
    hosts: dict[str, ProbeHost] | None = None,
) -> dict[str, Any]:
    """The probe's raw points (kvstage.hw.probes.engine.measure) with the state-machine event
    cost ("handle") measured in the sender process after the kernels, and the posting
    probe's (kvstage.hw.probes.posting, host memory) under "posting". `hosts`: where the
    sender and the receiver run (hw/probes/hosts.py); "where" says, per measurement,
    whether it was taken between two hosts or on one (`measured_where`)."""
    from kvstage.run import conditions

    before = conditions.sample()
    raw = probe.measure(
        backend, device, plan, progress, extras=(("handle", measure_handle_cost),), hosts=hosts
    )
    raw["where"] = measured_where(hosts, raw.get("transport_used"))
    quick = plan is not None and plan.quick
    raw["posting"] = measure_posting(
        backend, PostingPlan.quick_plan() if quick else PostingPlan(), progress
    )
    raw["conditions"] = conditions.measure(before)  # how busy other processes kept the host
    raw["rank_loop"] = rank_loop_constants(device)
    raw["inrun"] = measure_inrun(backend, device, progress)  # kvstage/calibrate/inrun.py
    return raw


SAME_HOST = "same-host"


def measured_where(
    hosts: dict[str, ProbeHost] | None, used: dict[str, Any] | None
) -> dict[str, str]:
    """Per measurement, where it was taken: "inter-host" only for the sender's writes,
    batches and control pings between two hosts whose writes really left the host (the
    engine's transports, hw/transport/used.py: not CMA or CUDA IPC); everything else
    (kernels, the event cost, posting, the in-run runs) runs on one host."""
    apart = inter_host((hosts or {}).get("sender"), (hosts or {}).get("receiver"))
    over = (used or {}).get("over")
    link = "inter-host" if apart and over not in (None, SAME_HOST) else SAME_HOST
    out = dict.fromkeys(("write", "batch"), link)
    out["control"] = "inter-host" if apart else SAME_HOST  # ZMQ over TCP between the two
    out.update(dict.fromkeys(("kernels", "handle", "posting", "inrun"), SAME_HOST))
    if apart:
        out["hosts"] = f"{hosts['sender'].describe()} -> {hosts['receiver'].describe()}"
        out["writes_over"] = str(over)
    return out


def rank_loop_constants(device: str) -> dict[str, float]:
    """How hardware mode's rank processes run their work (set in hw/, not measured):
    how long a thread's finished job waits for the loop to notice it, as a poll period
    (0: the loop wakes at once), and the forward thread's nice level (on a CPU device; a
    GPU forward is not reniced).

    A worker thread that finishes a fill, gather or scatter sets the control plane's
    waker, and the loop blocks on it (hw/rank/process.py): it notices at once, and so do the
    write lanes of both engines (hw/transport/base.py), so the poll period is 0."""
    from kvstage.hw.rank.prefill import FORWARD_NICE

    return {
        "busy_poll_s": 0.0,
        "forward_nice": 0 if str(device).startswith("cuda") else FORWARD_NICE,
    }


def measure_handle_cost(progress: Callable[[str, int, int], None]) -> dict[str, Any]:
    """CPU cost of one protocol event in a rank's loop: time every machine.handle() call
    of a small simulated fan-in run (in-process; no I/O, so this is the state machine's
    own Python cost, without the codec and ZMQ that the control round trip holds)."""
    from kvstage.shared.scenario import scenario_from_dict
    from kvstage.sim.driver import Simulation

    scenario = scenario_from_dict(
        {
            "name": "calibrate-handle-cost",
            "model": {"layers": 4, "kv_heads": 8, "head_dim": 64, "params_b": 0.5},
            "prefill": {"tp": 2, "chunked_prefill_size": 256},
            "decode": {"tp": 1, "page_size": 16, "staging_pool_mb": 16},
            "links": {"profile": "loopback-cpu", "placement": "intra"},
            "workload": {
                "requests": 16,
                "arrival": "fixed",
                "rate_per_s": 50.0,
                "prompt": "uniform",
                "prompt_min": 512,
                "prompt_max": 2048,
                "seed": 1,
            },
        }
    )
    sim = Simulation(scenario, check=False)
    times: list[float] = []
    clock = time.perf_counter

    def timed(handle: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(event: Any, now: float) -> Any:
            t0 = clock()
            out = handle(event, now)
            times.append(clock() - t0)
            return out

        return wrapper

    for m in [*sim.prefill, *sim.decode]:
        m.handle = timed(m.handle)
    progress("events", 0, 1)
    sim.run()
    progress("events", 1, 1)
    xs = sorted(times)
    return {
        "events": len(xs),
        "mean_s": float(statistics.fmean(xs)) if xs else 0.0,
        "median_s": float(statistics.median(xs)) if xs else 0.0,
        "p90_s": float(xs[int(0.9 * (len(xs) - 1))]) if xs else 0.0,
    }


def _inrun_run(data: dict, backend: str, device: str) -> dict:
    """One in-run scenario on the real engine: its mean step times and the host's conditions."""
    from kvstage.run.hwrun import launch_run
    from kvstage.run.result import judge
    from kvstage.shared.scenario import scenario_from_dict

    data = {**data, "hardware": {**data["hardware"], "backend": backend, "device": device}}
    scenario = scenario_from_dict(data, source="kvstage calibrate in-run scenario")
    with tempfile.TemporaryDirectory(prefix="kvstage-inrun-") as tmp:  # the ranks' logs
        result = launch_run(scenario, Path(tmp), timeout_s=120.0)
    summary, records = result.summary, result.records
    return {
        "ok": judge(result).code == 0,
        "errors": summary.get("errors", [])[:3],
        "steps": kind_means(records),
        "copy_bytes": copy_bytes_mean(records),
        "job_cpu": summary.get("job_cpu") or {},
        "conditions": summary.get("conditions"),
        "requests_done": summary.get("requests_done"),
        "loop_sched": summary.get("loop_sched") or {},
        "engine_sched": summary.get("engine_sched") or {},
    }


def measure_inrun(
    backend: str, device: str, progress: Callable[[str, int, int], None] | None = None
) -> dict:
    """Run CAL_SCENARIO, then CAL_SMALL, on the real engine: the first's mean step times
    and the host's conditions, with the second's under "small"."""
    if progress:
        progress("in-run", 0, 2)
    out = _inrun_run(CAL_SCENARIO, backend, device)
    if progress:
        progress("in-run", 1, 2)
    out["small"] = _inrun_run(CAL_SMALL, backend, device)
    if progress:
        progress("in-run", 2, 2)
    return out
