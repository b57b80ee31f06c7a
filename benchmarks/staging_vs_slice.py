"""Staging vs slice under load: TTFT as concurrency grows, per serving-engine preset.

N prompts arriving at once (Llama-3.1-8B: 32 layers, 8 KV heads of 128, bf16; 128
tokens each by default: the setup docs/staging-vs-slice.md argues SGLang PR #22536
used), prefill TP2 -> decode TP4 and TP4 -> TP4, N = 1, 8, 64, 128, 256, 512, on the
`rdma-400g` profile. For each engine preset (`[engine] preset`, shared/scenario/
engines.py; "none": kvstage's own posting threads, sim/links.py) it prints the mean
TTFT (arrival to decode ready) of the slice and the staging path, their ratio, the
slice path's extra TTFT Delta(N) = slice - staging and c(N) = 2 Delta / (N + 1): one
serialized per-request resource of cost c gives c(N) = c at every N.

    .venv/bin/python benchmarks/staging_vs_slice.py
    .venv/bin/python benchmarks/staging_vs_slice.py --engine sglang-nixl --prompt-tokens 1024
    .venv/bin/python benchmarks/staging_vs_slice.py --engine none --set links.post_threads=0
    .venv/bin/python benchmarks/staging_vs_slice.py --prompts 1,64 --geometry 2x4

Every number comes from the profile (scenarios/profiles/<name>.toml) and the preset,
each with its source; --set overrides any scenario field as `kvstage sim --set` does.
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

PROMPT_TOKENS = 128
GEOMETRIES = {"2x4": (2, 4), "4x4": (4, 4), "8x2": (8, 2)}
ENGINES = "none,sglang-nixl,sglang-nixl-prepped,sglang-mooncake,vllm-nixl"


def scenario(
    prefill_tp: int,
    decode_tp: int,
    prompts: int,
    path: str,
    profile: str,
    sets: list[str],
    engine: str = "none",
):
    base = {
        "name": f"llama3.1-8b-p{prefill_tp}-d{decode_tp}-{prompts}x{PROMPT_TOKENS}-{path}",
        "engine": {} if engine == "none" else {"preset": engine},
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
        sets: list[str], engine: str = "none") -> tuple[float, float, int, float]:  # fmt: skip
    """(mean TTFT s, mean exposed transfer s, work requests of the first prompt, its
    forward s) of one run."""
    result = Simulation(
        scenario(prefill_tp, decode_tp, prompts, path, profile, sets, engine), check=False
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


def study(p: int, d: int, counts: list[int], engine: str, args) -> None:
    """One table: per N the two paths' mean TTFT, ratio, Delta(N), c(N)."""
    print(f"\nprefill TP{p} -> decode TP{d}, engine {engine}")
    print(
        f"  {'N':>5} {'slice TTFT ms':>14} {'staging TTFT ms':>16} {'ratio':>6} "
        f"{'Delta ms':>9} {'c(N) ms':>8}"
    )
    cs = []
    per_prompt = 0
    for n in counts:
        s_ttft, _, per_prompt, _ = run(p, d, n, "slice", args.profile, args.sets, engine)
        g_ttft, _, _, _ = run(p, d, n, "staging", args.profile, args.sets, engine)
        delta = s_ttft - g_ttft
        cs.append(2 * delta / (n + 1))
        print(
            f"  {n:5d} {s_ttft * 1e3:14.1f} {g_ttft * 1e3:16.1f} {s_ttft / g_ttft:6.2f} "
            f"{delta * 1e3:9.2f} {cs[-1] * 1e3:8.3f}"
        )
    pos = [c for c in cs if c > 0]
    spread = f"{max(pos) / min(pos):.2f}" if len(pos) == len(cs) else "-"
    print(
        f"  slice path: {per_prompt:,} descriptors (work requests) per prompt; "
        f"c(N) max / min: {spread}"
    )


def main() -> int:
    global PROMPT_TOKENS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="rdma-400g")
    ap.add_argument("--prompts", default="1,8,64,128,256,512", help="comma-separated N")
    ap.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS)
    ap.add_argument("--geometry", default="2x4,4x4", help="comma-separated PxD (TP sizes)")
    ap.add_argument("--engine", default=ENGINES, help="comma-separated presets; none: no [engine]")
    ap.add_argument(
        "--set", dest="sets", action="append", default=[], help="scenario override, repeatable"
    )
    args = ap.parse_args()
    PROMPT_TOKENS = args.prompt_tokens
    counts = [int(x) for x in args.prompts.split(",")]
    t0 = time.perf_counter()
    print(
        f"Llama-3.1-8B, N prompts of {PROMPT_TOKENS} tokens at once, profile {args.profile}"
        + (f", {' '.join(args.sets)}" if args.sets else "")
    )
    for engine in args.engine.split(","):
        for geo in args.geometry.split(","):
            p, d = GEOMETRIES.get(geo) or tuple(int(x) for x in geo.split("x"))
            study(p, d, counts, engine, args)
    print(f"\n{time.perf_counter() - t0:.1f} s wall")
    return 0


if __name__ == "__main__":
    sys.exit(main())
