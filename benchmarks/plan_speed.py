"""How fast does `kvstage plan` answer on an hour of traffic, and is its answer right?

Plans one hour of a Mooncake-format trace over a grid of more than 100 configurations
twice, on the same executor (local processes, `--workers`):

* the method: the bottleneck model's capacity screen, then successive halving
  (kvstage/explore/halving.py) -- `kvstage plan`'s default;
* the reference: no screen, every configuration simulated on the whole hour
  (`--search exhaustive`), or (`--reference bounded`) every configuration with at most
  as many GPUs as the method's winner, likewise on the whole hour. The bounded
  reference has the exhaustive plan's winner whenever the method's winner meets the
  SLO on the whole hour (it ran it, and the simulation is deterministic): the
  exhaustive winner is the configuration with the fewest GPUs that meets the SLO
  (ties: goodput per GPU, then TTFT), and no configuration with more GPUs than a
  meeting one can be it. Its wall time is then not the exhaustive plan's: that one is
  estimated from the reference's own pace (requests simulated per second) x the
  2.95 M requests an exhaustive plan simulates, and printed as an estimate.

and prints both wall times, their ratio, both winners (they must be the same
configuration), the simulations and requests each ran, and `uptime` before and after
(the machine may be shared: the load says how much of it the plans had). The goal of
issue 24: the method under 10 minutes on a 2-core machine with the exhaustive winner.

The trace. The public Mooncake traces are not in this repository, so a synthetic
hour is generated in their format (JSON Lines: timestamp in ms, input_length,
output_length, hash_ids of 512-token blocks) with a seeded generator: Poisson
arrivals at `--rate` requests/s; input lengths lognormal, median 4,000 tokens,
sigma 0.8, clipped to [64, 32,768]; output lengths lognormal, median 150, sigma 0.6,
clipped to [1, 1,024] -- [A] shapes chosen to resemble Mooncake's published
conversation trace (long prompts, short answers; Qin et al., "Mooncake", FAST 2025,
report an average input of 7,590 and output of 182 tokens for their trace), not
fitted to it. The hash ids are consecutive per request (no cross-request reuse:
kvstage does not model a prefill-side prefix cache).

The method also searches colocated serving (`--colocated`, the default, as `kvstage
plan` runs): its simulations are in the method's wall time and printed apart; the
reference plans the disaggregated side alone (the colocated search is exact already:
GPU counts smallest first, each in full).

    .venv/bin/python benchmarks/plan_speed.py                      # both plans
    .venv/bin/python benchmarks/plan_speed.py --reference bounded   # the winner check
    .venv/bin/python benchmarks/plan_speed.py --reference none      # the method only
    .venv/bin/python benchmarks/plan_speed.py --ttft 0.2            # a tighter TTFT target
    .venv/bin/python benchmarks/plan_speed.py --rate 6 --hours 0.1  # a quick look

Measured figures: docs/results/2026-12-03-plan-speed.md.

Results (JSON) go to --out (default runs/plan_speed/).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCENARIO = """\
# benchmarks/plan_speed.py: Llama-3-8B on H100s, one hour of a Mooncake-format trace
[model]
preset = "llama-3-8b"

[prefill]
tp = 1

[decode]
tp = 1
staging_pool_mb = 1024

[links]
profile = "rdma-400g"

[workload]
arrival = "trace"
prompt = "trace"
trace = "{trace}"

[slo]
ttft_s = {ttft}
tpot_s = {tpot}
"""

GRID = {
    "prefill.tp": "1,2,4",
    "decode.tp": "1,2,4",
    "cluster.prefill_instances": "1,2,3,4,6",
    "cluster.decode_instances": "1,2,3",
    "decode.staging_pool_mb": None,
    "prefill.chunked_prefill_size": None,
    "cluster.router": None,
    "transfer.path": None,
}


def write_trace(path: Path, rate: float, hours: float, seed: int) -> int:
    """A seeded synthetic trace in Mooncake's format (see the module docstring)."""
    rng = random.Random(seed)
    t, n = 0.0, 0
    with path.open("w") as fh:
        while True:
            t += rng.expovariate(rate)
            if t >= hours * 3600:
                break
            inp = max(64, min(32768, int(rng.lognormvariate(math.log(4000), 0.8))))
            out = max(1, min(1024, int(rng.lognormvariate(math.log(150), 0.6))))
            blocks = list(range(n * 64, n * 64 + math.ceil(inp / 512)))
            row = {"timestamp": int(t * 1000), "input_length": inp, "output_length": out}
            fh.write(json.dumps({**row, "hash_ids": blocks}) + "\n")
            n += 1
    return n


def _cpu() -> tuple[float, float]:
    """CPU seconds (user + system) of this process and of its ended child processes (the
    plan's worker pool, counted once it has shut down)."""
    me, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "uptime unavailable"


def plan_once(
    path: Path, method: bool, workers: int, max_gpus: int | None = None, colocated: bool = False
) -> dict:
    from kvstage.explore.colocated import (
        DEFAULT_COLOCATED_INSTANCES,
        colocated_from_plan,
        colocated_shape,
    )
    from kvstage.explore.figures import shape
    from kvstage.explore.plan import plan_candidates, planned_work, run_plan
    from kvstage.explore.progress import ProgressLog

    name = "method" if method else "exhaustive"
    t0, cpu0 = time.perf_counter(), _cpu()
    cands = plan_candidates(path, GRID, max_gpus=max_gpus, screen=method)
    colo = (
        colocated_from_plan(cands, DEFAULT_COLOCATED_INSTANCES, max_gpus, method)
        if colocated
        else None
    )
    candidates_s = time.perf_counter() - t0  # loading every configuration, the screen
    search = "halving" if method else "exhaustive"
    jobs, work = planned_work(cands, 0.9, search)
    log = ProgressLog(jobs, work, lambda s: print(f"  {s}", flush=True), what=name)
    result = run_plan(
        path,
        cands,
        workers=workers,
        search=search,
        on_point=lambda row: log.advance(row.get("requests") or 0),
        colocated=colo,
    )
    wall = time.perf_counter() - t0  # screening (reading the trace) included
    cpu = tuple(b - a for a, b in zip(cpu0, _cpu(), strict=True))  # the pool has exited
    w = result.winner
    ran = [r for r in result.colocated if r["status"] in ("ok", "error")]
    colo_out = None
    if colo is not None:
        best = result.colocated_best
        colo_out = {
            "simulations": len(ran),
            "requests_simulated": sum(r.get("requests") or 0 for r in ran),
            "worker_s": sum(r.get("wall_s") or 0.0 for r in ran),  # each simulation's own
            "best": None if best is None else colocated_shape(best),
            "best_gpus": None if best is None else best["gpus"],
            "comparison": (result.comparison or {}).get("text"),
        }
    return {
        "search": search,
        "configurations": len(cands.points) + len(cands.skipped),
        "screened_out": sum(1 for r in cands.skipped if r.get("skipped_by") == "capacity"),
        "simulations": sum(n for n, _ in result.rungs),
        "requests_simulated": sum(r for _, r in result.rungs),
        "rungs": result.rungs,
        "wall_s": wall,
        "candidates_s": candidates_s,
        "cpu_s": {"this_process": cpu[0], "workers": cpu[1]},
        "winner": None if w is None else shape(w),
        "colocated": colo_out,
        "winner_gpus": None if w is None else w["gpus"],
        "winner_figures": None
        if w is None
        else {
            k: w.get(k)
            for k in (
                "slo_attainment",
                "slo_attainment_lo",
                "ttft_s.p90",
                "ttft_s.p90_lo",
                "ttft_s.p90_hi",
                "tpot_s.p90",
                "busiest_stage",
                "busiest_utilization",
            )
        },  # fmt: skip
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=6.0, help="requests/s of the trace")
    ap.add_argument("--hours", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--ttft", type=float, default=0.5, help="TTFT target, s (p90)")
    ap.add_argument("--tpot", type=float, default=0.015, help="TPOT target, s (p90)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument(
        "--colocated",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the method also searches colocated serving, as `kvstage plan` does by default "
        "(its time is in the method's; the reference is the disaggregated search alone)",
    )
    ap.add_argument(
        "--reference",
        choices=("full", "bounded", "none"),
        default="full",
        help="the exhaustive plan: of every configuration, of those up to the method "
        "winner's GPUs, or none",
    )
    ap.add_argument(
        "--method-result",
        type=Path,
        help="reuse the method's result (a JSON line this script printed) instead of planning again",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "plan_speed")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    trace = args.out / "trace.jsonl"
    n = write_trace(trace, args.rate, args.hours, args.seed)
    scenario = args.out / "plan_speed.toml"
    scenario.write_text(SCENARIO.format(trace=trace, ttft=args.ttft, tpot=args.tpot))
    print(f"synthetic Mooncake-format trace: {n:,} requests over {args.hours:g} h "
          f"(seed {args.seed}, {args.rate:g} req/s) in {trace}")  # fmt: skip
    out = {"trace_requests": n, "rate": args.rate, "hours": args.hours, "seed": args.seed,
           "slo": {"ttft_s": args.ttft, "tpot_s": args.tpot}, "workers": args.workers,
           "uptime_before": uptime()}  # fmt: skip
    print(f"uptime before: {out['uptime_before']}")
    print(f"simulations on {args.workers} local worker process(es) (--workers) on a machine "
          f"of {os.cpu_count()} cores; the wall times below are of all of them together")  # fmt: skip
    if args.method_result is not None:
        plans = {"method": json.loads(args.method_result.read_text()) | {"reused": True}}
    else:
        plans = {"method": plan_once(scenario, True, args.workers, colocated=args.colocated)}
    print(f"method: {json.dumps(plans['method'])}", flush=True)
    if args.reference != "none":
        bound = plans["method"]["winner_gpus"] if args.reference == "bounded" else None
        plans["exhaustive"] = plan_once(scenario, False, args.workers, bound)
        plans["exhaustive"]["max_gpus"] = bound
        print(f"exhaustive: {json.dumps(plans['exhaustive'])}", flush=True)
    out |= {"plans": plans, "uptime_after": uptime()}
    m = plans["method"]
    print(f"uptime after: {out['uptime_after']}")
    print(f"method: {m['configurations']} configurations, {m['screened_out']} screened out, "
          f"{m['simulations']} simulations of {m['requests_simulated']:,} requests in "
          f"{m['wall_s']:.0f} s ({m.get('candidates_s', 0):.0f} s of it loading and screening the "
          f"configurations); winner {m['winner']}")  # fmt: skip
    if m.get("colocated"):
        co = m["colocated"]
        print(f"of it the colocated search: {co['simulations']} simulations of "
              f"{co['requests_simulated']:,} requests ({co['worker_s']:.0f} s of simulation); "
              f"best {co['best']}; {co['comparison']}")  # fmt: skip
    c = m.get("cpu_s")
    if c is not None:  # what the load took away: the CPU the plan used
        print(f"method CPU: {c['this_process']:.0f} s in this process (loading, screening, "
              f"ranking) + {c['workers']:.0f} s in the {args.workers} workers; on {args.workers} "
              f"idle cores about {c['this_process'] + c['workers'] / args.workers:.0f} s of "
              "wall time")  # fmt: skip
    ok = m["wall_s"] <= 600 and m["winner"] is not None
    if "exhaustive" in plans:
        e = plans["exhaustive"]
        same = e["winner"] == m["winner"]
        out["same_winner"] = same
        what = "exhaustive" if e["max_gpus"] is None else f"exhaustive up to {e['max_gpus']} GPUs"
        print(f"{what}: {e['simulations']} simulations of {e['requests_simulated']:,} requests in "
              f"{e['wall_s']:.0f} s; winner {e['winner']}")  # fmt: skip
        if e["max_gpus"] is None:
            out["ratio"] = e["wall_s"] / m["wall_s"]
            print(f"exhaustive / method wall time: {out['ratio']:.1f}x; same winner: {same}")
        else:
            full = m["configurations"] * n  # every configuration on the whole trace
            est = e["wall_s"] / e["requests_simulated"] * full
            out |= {"exhaustive_requests": full, "exhaustive_wall_s_estimate": est,
                    "ratio_estimate": est / m["wall_s"]}  # fmt: skip
            print(f"exhaustive plan, estimated at the reference's pace: {full:,} requests, "
                  f"~{est:.0f} s; estimated ratio ~{est / m['wall_s']:.0f}x; same winner: {same}")  # fmt: skip
        ok = ok and same
    print(f"goal (<= 600 s with the exhaustive winner): {'met' if ok else 'NOT met'}")
    (args.out / "plan_speed.json").write_text(json.dumps(out, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
