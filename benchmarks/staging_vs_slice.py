"""Staging vs slice under load: TTFT and exposed transfer time as concurrency grows.

Llama-3.1-8B (32 layers, 8 KV heads of 128, bf16), N prompts of 1,024 tokens arriving
at once, prefill TP2 -> decode TP4 and prefill TP8 -> decode TP2, N = 1, 8, 64, 256,
512, on the `rdma-400g` profile (NIXL on 400 Gb/s RDMA): the transfer engine's posting
threads and the NIC message rate are on (sim/links.py). For each point it prints the
mean TTFT (arrival to decode ready) and the mean exposed transfer (the room's last
prefill forward end to decode ready: what a request waits for beyond its compute) of
the slice path and the staging path, and their ratio; the slice path's work requests
per prompt are printed once per geometry.

    .venv/bin/python benchmarks/staging_vs_slice.py
    .venv/bin/python benchmarks/staging_vs_slice.py --profile rdma-400g-mooncake
    .venv/bin/python benchmarks/staging_vs_slice.py --set links.post_threads=0   # posting in parallel
    .venv/bin/python benchmarks/staging_vs_slice.py --prompts 1,64 --geometry 2x4

Every number comes from the profile (scenarios/profiles/<name>.toml, each with its
source); --set overrides any scenario field as `kvstage sim --set` does.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvstage.metrics.rooms import room_latencies  # noqa: E402
from kvstage.shared.scenario import apply_overrides, scenario_from_dict  # noqa: E402
from kvstage.sim.driver import Simulation  # noqa: E402

PROMPT_TOKENS = 1024
GEOMETRIES = {"2x4": (2, 4), "8x2": (8, 2)}


def scenario(
    prefill_tp: int, decode_tp: int, prompts: int, path: str, profile: str, sets: list[str]
):
    base = {
        "name": f"llama3.1-8b-p{prefill_tp}-d{decode_tp}-{prompts}x{PROMPT_TOKENS}-{path}",
        "model": {"preset": "llama-3.1-8b"},
        "prefill": {"tp": prefill_tp},
        "decode": {"tp": decode_tp},
        "transfer": {"path": path, "room_timeout_s": 600.0},
        "links": {"profile": profile},
        # all N prompts at t = 0: one burst of N
        "workload": {
            "requests": prompts,
            "arrival": "burst",
            "burst_size": prompts,
            "rate_per_s": 1e-3,
            "prompt": "fixed",
            "prompt_tokens": PROMPT_TOKENS,
            "seed": 0,
        },
    }
    return scenario_from_dict(apply_overrides(base, sets) if sets else base)


def run(prefill_tp: int, decode_tp: int, prompts: int, path: str, profile: str,
        sets: list[str]) -> tuple[float, float, int, float]:  # fmt: skip
    """(mean TTFT s, mean exposed transfer s, work requests of the first prompt, its
    forward s) of one run."""
    result = Simulation(
        scenario(prefill_tp, decode_tp, prompts, path, profile, sets), check=False
    ).run()
    if result.rooms_done != prompts:
        raise SystemExit(
            f"{path} {prefill_tp}->{decode_tp} x{prompts}: {result.rooms_failed} rooms failed "
            f"({result.failures})"
        )
    computed: dict[int, float] = {}
    requests: dict[int, int] = {}
    forward = 0.0
    for r in result.records:
        if r.phase == "compute":
            computed[r.room] = max(computed.get(r.room, 0.0), r.end)
            if r.room == 0:
                forward = max(forward, r.end - r.start)
        elif r.phase in ("slice_write", "write"):
            requests[r.room] = requests.get(r.room, 0) + r.requests
    rooms = room_latencies(result.records)
    ttft = [info["done"] - info["arrival"] for info in rooms.values()]
    exposed = [info["done"] - computed[room] for room, info in rooms.items()]
    return statistics.fmean(ttft), statistics.fmean(exposed), requests.get(0, 0), forward


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="rdma-400g")
    ap.add_argument("--prompts", default="1,8,64,256,512", help="comma-separated concurrencies")
    ap.add_argument(
        "--geometry", default="2x4,8x2", help="comma-separated PxD (prefill TP x decode TP)"
    )
    ap.add_argument(
        "--set", dest="sets", action="append", default=[], help="scenario override, repeatable"
    )
    args = ap.parse_args()
    counts = [int(x) for x in args.prompts.split(",")]
    t0 = time.perf_counter()
    print(
        f"Llama-3.1-8B, N prompts of {PROMPT_TOKENS} tokens at once, profile {args.profile}"
        + (f", {' '.join(args.sets)}" if args.sets else "")
    )
    for geo in args.geometry.split(","):
        p, d = GEOMETRIES.get(geo) or tuple(int(x) for x in geo.split("x"))
        print(f"\nprefill TP{p} -> decode TP{d}")
        print(
            f"  {'N':>5} {'slice TTFT ms':>14} {'staging TTFT ms':>16} {'ratio':>6} "
            f"{'slice exposed ms':>17} {'staging exposed ms':>19} {'ratio':>6}"
        )
        per_prompt, forward = 0, 0.0
        for n in counts:
            s_ttft, s_exp, per_prompt, forward = run(p, d, n, "slice", args.profile, args.sets)
            g_ttft, g_exp, _, _ = run(p, d, n, "staging", args.profile, args.sets)
            print(
                f"  {n:5d} {s_ttft * 1e3:14.1f} {g_ttft * 1e3:16.1f} {s_ttft / g_ttft:6.2f} "
                f"{s_exp * 1e3:17.2f} {g_exp * 1e3:19.2f} {s_exp / g_exp:6.1f}"
            )
        s = scenario(p, d, 1, "slice", args.profile, args.sets)
        link, g = s.links.resolved().link, s.geometry()
        batches = len(g.targets(0))
        posting = per_prompt / p * link.per_request_s + batches * link.per_batch_s
        print(
            f"  slice path: {per_prompt:,} work requests per prompt; one prefill rank posts "
            f"{per_prompt // p:,} of them in {batches} batches: {posting * 1e3:.2f} ms on "
            f"{link.post_threads or 'unlimited'} posting thread(s), against a "
            f"{forward * 1e3:.2f} ms prefill forward per prompt"
        )
    print(f"\n{time.perf_counter() - t0:.1f} s wall")
    return 0


if __name__ == "__main__":
    sys.exit(main())
