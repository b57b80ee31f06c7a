"""How fast does the simulator run a cluster? Cost per simulated request as the
cluster grows, and one simulated hour of a Llama-3-70B cluster.

The cluster: scenarios/llama3-70b-p8-d2.toml (prefill TP8 -> decode TP2, staging,
rdma-400g, H200-class decode GPUs of 141 GiB), with 2N prefill and N decode
instances, round-robin routing, ranks folded (`[cluster] fold`, sim/fold.py: one
simulated rank per set of symmetric ranks; tests/test_fold.py shows the latencies are
the same as unfolded) and sharded (`[cluster] shard`, sim/shard.py: instances that share
no room and no NIC are simulated as separate groups; tests/test_shard.py shows the
latencies and rows are the same as one simulation's). The traffic is a Mooncake-format trace (JSON Lines:
timestamp ms, input_length, output_length, hash_ids) written by this script: Poisson
arrivals at 60% of the prefill instances' capacity, lognormal prompts (median 6k
tokens, capped at 16k), 256 output tokens each. With one decode instance per two
prefill instances that is near the decode side's KV capacity (each request keeps
~7.6k tokens of KV for the ~12 s of its 256 tokens), so every stage is busy and the
queues stay bounded: prefill at 60%, the decode KV near full, NICs, rings, batches.

It prints, in one run (the machine may be shared: CPU seconds are the steadier figure):

1. the folded and the unfolded simulation of the same 4-instance minute, CPU per
   request and their ratio (the baseline of this run);
2. CPU per simulated request at 1, 4, 16 and 64 decode instances (twice as many
   prefill instances; the same simulated minute each, so requests grow with the
   cluster) and its ratio to the 1-instance figure: it should stay flat;
3. one simulated hour of 16 prefill and 8 decode instances: wall and CPU seconds,
   requests, rooms done, and TTFT / TPOT percentiles (goal: at most 120 s wall on a
   2-core machine).

    .venv/bin/python benchmarks/cluster_speed.py            # everything (a few minutes)
    .venv/bin/python benchmarks/cluster_speed.py --quick    # 2 simulated minutes instead of the hour
    .venv/bin/python benchmarks/cluster_speed.py --scaling-only --repeat 3   # 2. only, 3 rounds
    .venv/bin/python benchmarks/cluster_speed.py --scaling-only --no-shard   # 2. as one simulation

Measured 2026-12-01 (2 cores, load 2-3 from other work; --scaling-only --repeat 3):
sharded 1.00 / 0.99 / 1.00 / 1.02x the 1-instance cost at 1 / 4 / 16 / 64 decode
instances (0.49-0.50 ms per request); as one simulation (--no-shard) 1.00 / 1.05 /
1.08 / 1.39x on a quiet host. The paragraphs below are about one simulation.

What 2. shows (issue 11 item 7): events per request are the same at every size
(~82); the CPU per event grows with the cluster. Two O(cluster) costs were removed
(every future arrival sat in the event heap; a load-aware router read every instance
per request). What is left at 64 instances (1.3-1.4x on a quiet host, load 1: 2026-12-01,
3 rounds) is not work that scans the cluster: no function is called more often per
request, heap depth alone costs nothing measurable (padding a small run's heap with
370 idle entries), the invariant checker and trace records off leave the ratio as
is. It is the memory the run touches per event: at 64 instances ~2,000 rooms are in
flight across 192 simulated ranks (8+ MB of live state against a 2 MB L2), at one
instance ~30 on 3, and CPython dict lookups, compares and heap sifts slow down
accordingly (perf: _Py_dict_lookup, PyObject_RichCompare, siftup account for the
largest growth beside the interpreter loop). At the same total concurrency (64
instances at one instance's rate, 1 output token) the cost is +10%.

Where that CPU per event goes (cProfile, 1 instance for an hour against 64 for a
minute, ~14k requests each, so run length is not the difference; GC off changes
nothing): the same ~82 events per request, every one a little dearer; dict lookups,
heap pops and pushes, SimPy's step and the fabric's flow bookkeeping each take
1.2-1.8x as long per call. SimPy's event heap holds ~374 entries at 64 instances
against ~14 at one (half of them the ranks' deadline ticks, a quarter the prefill
instances' forwards, a sixth the decode batches' steps): a log-depth cost; moving the
ticks into a heap of their own would save one level of ~8.5 on heap operations
that take ~5% of the run (estimated, not built).

--router measures a load-aware router instead of round-robin. With staging-aware at
64 instances every prefill instance comes to write into every decode ring; each ring
used to tell every watermark move to every session it had ever seen (3.6x the
1-instance cost); a session is now told only while it has a live room in that ring
(shared/decode.py), and the router costs about what round-robin does (1.3-1.5x).

With --repeat N the sizes of 2. run N rounds, interleaved (1, 4, 16, 64, 1, 4, ...),
so a burst of load on a shared machine hits every size alike: each size's figure is
its least CPU per request over the rounds, and the spread of the per-round ratios is
printed beside it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvstage.metrics.rooms import percentiles, request_breakdown, room_latencies  # noqa: E402
from kvstage.shared.scenario import load_scenario  # noqa: E402
from kvstage.shared.serving.capacity import prompt_forward_s  # noqa: E402
from kvstage.sim.shard import simulate_scenario  # noqa: E402

SCENARIO = ROOT / "scenarios" / "llama3-70b-p8-d2.toml"
LOAD = 0.6  # of the prefill instances' capacity (the decode KV is then near full)
MEDIAN_PROMPT, MAX_PROMPT, OUTPUT = 6144, 16384, 256


def write_trace(path: Path, rate: float, seconds: float, seed: int) -> int:
    """A Mooncake-format trace: Poisson arrivals at `rate` for `seconds`."""
    rng = random.Random(seed)
    t, n = 0.0, 0
    with path.open("w") as f:
        while True:
            t += rng.expovariate(rate)
            if t >= seconds:
                return n
            prompt = min(
                MAX_PROMPT, max(256, int(rng.lognormvariate(math.log(MEDIAN_PROMPT), 0.6)))
            )
            blocks = list(range(n * 64, n * 64 + -(-prompt // 512)))
            f.write(
                json.dumps(
                    {
                        "timestamp": round(t * 1000, 3),
                        "input_length": prompt,
                        "output_length": OUTPUT,
                        "hash_ids": blocks,
                    }
                )
                + "\n"
            )
            n += 1


def prefill_capacity_rps(instances: int) -> float:
    """Requests per second the prefill instances compute at the trace's mean prompt."""
    s = load_scenario(SCENARIO)
    mean_prompt = min(MAX_PROMPT, MEDIAN_PROMPT * math.exp(0.6**2 / 2))
    return instances / prompt_forward_s(s, int(mean_prompt))


def run(
    decode: int,
    seconds: float,
    fold: bool,
    tmp: Path,
    seed: int = 1,
    router: str = "round-robin",
    shard: bool = False,
) -> dict:
    """`decode` decode instances and twice as many prefill instances; `shard`: in
    independent groups (sim/shard.py)."""
    rate = LOAD * prefill_capacity_rps(2 * decode)
    trace = tmp / f"trace-{decode}-{seconds:.0f}.jsonl"
    n = write_trace(trace, rate, seconds, seed)
    s = load_scenario(
        SCENARIO,
        [
            f"cluster.prefill_instances={2 * decode}",
            f"cluster.decode_instances={decode}",
            f"cluster.fold={'true' if fold else 'false'}",
            f'cluster.router="{router}"',
            f"cluster.shard={'true' if shard else 'false'}",
            'workload.arrival="trace"',
            'workload.prompt="trace"',
            f'workload.trace="{trace}"',
            f"workload.requests={n}",
            f"workload.max_prompt_tokens={MAX_PROMPT}",
            "decode.gpu_memory_gib=141",
        ],
    )
    wall, cpu = time.perf_counter(), time.process_time()
    result = simulate_scenario(s)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    per = request_breakdown(room_latencies(result.records))
    return {
        "decode": decode,
        "rate": rate,
        "requests": n,
        "done": result.rooms_done,
        "failed": result.rooms_failed,
        "violations": len(result.violations),
        "sim_s": result.sim_time_s,
        "cpu_s": cpu,
        "wall_s": wall,
        "cpu_per_request_ms": 1e3 * cpu / max(1, n),
        "ttft": percentiles(per["ttft_s"]),
        "tpot": percentiles(per.get("tpot_s", [])),
    }


def line(r: dict) -> str:
    return (
        f"{2 * r['decode']:>3} prefill x TP8 + {r['decode']:>2} decode x TP2: "
        f"{r['requests']:>7,} requests at {r['rate']:6.1f}/s, {r['done']:>7,} done, {r['failed']} failed, "
        f"{r['violations']} violations; CPU {r['cpu_s']:7.2f} s, wall {r['wall_s']:7.2f} s, "
        f"{r['cpu_per_request_ms']:.3f} ms CPU per request"
    )


def scaling(
    tmp: Path, repeat: int, router: str, shard: bool, sizes: tuple[int, ...] = (1, 4, 16, 64)
) -> None:
    """2.: CPU per simulated request at each size, its least over `repeat` interleaved rounds."""
    how = "sharded" if shard else "one simulation"
    print(
        f"\n2. cost per simulated request as the cluster grows (folded, {how}, 60 simulated seconds, {router}, "
        f"{repeat} round(s))"
    )
    rounds: list[dict[int, dict]] = []
    for _ in range(max(1, repeat)):
        rounds.append({n: run(n, 60, True, tmp, router=router, shard=shard) for n in sizes})
        print(
            f"   round {len(rounds)}: "
            + ", ".join(f"{n}: {rounds[-1][n]['cpu_per_request_ms']:.3f} ms" for n in sizes)
            + f" (load {os.getloadavg()[0]:.2f})"
        )
    best = {n: min((r[n] for r in rounds), key=lambda x: x["cpu_per_request_ms"]) for n in sizes}
    base = best[sizes[0]]["cpu_per_request_ms"]
    for n in sizes:
        ratios = [r[n]["cpu_per_request_ms"] / r[sizes[0]]["cpu_per_request_ms"] for r in rounds]
        spread = f"; per round {min(ratios):.2f}-{max(ratios):.2f}x" if len(rounds) > 1 else ""
        print(
            f"   {line(best[n])}  ({best[n]['cpu_per_request_ms'] / base:.2f}x the 1-instance cost{spread})"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="2 simulated minutes for the big run, not an hour"
    )
    ap.add_argument(
        "--scaling-only",
        action="store_true",
        help="only 2. (cost per request as the cluster grows)",
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds of 2., interleaved; the least CPU of each size",
    )
    ap.add_argument(
        "--router",
        default="round-robin",
        help="the router of 2. (round-robin, least-outstanding, staging-aware)",
    )
    ap.add_argument(
        "--no-shard",
        action="store_true",
        help="2. and 3. as one simulation each, not in independent "
        "groups (sharding needs round-robin: another router is never sharded)",
    )
    args = ap.parse_args()
    shard = not args.no_shard and args.router == "round-robin"
    print(f"host: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if args.scaling_only:
            scaling(tmp, args.repeat, args.router, shard)
            print(f"load average at the end: {os.getloadavg()[0]:.2f}")
            return
        print("\n1. folded vs unfolded, 4 prefill + 2 decode instances, 60 simulated seconds")
        unfolded, folded = run(2, 60, False, tmp), run(2, 60, True, tmp)
        print("   unfolded:", line(unfolded))
        print("   folded:  ", line(folded))
        same = unfolded["ttft"] == folded["ttft"] and unfolded["tpot"] == folded["tpot"]
        print(
            f"   CPU per request, unfolded / folded: {unfolded['cpu_s'] / folded['cpu_s']:.2f}x; "
            f"TTFT and TPOT percentiles identical: {same}"
        )
        scaling(tmp, args.repeat, args.router, shard)
        seconds = 120 if args.quick else 3600
        print(
            f"\n3. {seconds:.0f} simulated seconds of 16 prefill (TP8) + 8 decode (TP2) instances (folded"
            f"{', sharded' if shard else ''})"
        )
        r = run(8, seconds, True, tmp, shard=shard)
        print("  ", line(r))
        print(
            f"   TTFT p50 / p99 {r['ttft']['p50']:.3f} / {r['ttft']['p99']:.3f} s, "
            f"TPOT p50 / p99 {1e3 * r['tpot']['p50']:.1f} / {1e3 * r['tpot']['p99']:.1f} ms; "
            f"goal: at most 120 s wall -> {'met' if r['wall_s'] <= 120 else 'NOT met'} ({r['wall_s']:.1f} s)"
        )


if __name__ == "__main__":
    main()
