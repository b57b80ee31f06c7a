"""The slice path's extra latency on real engines, posting on the loop vs on a worker.

Issue 23 item 4: a prefill rank that does its writes' descriptor work on its loop
thread (`hardware.posting = "loop"`, as SGLang's NIXL backend at PR #22536, [engine]
preset sglang-nixl) delays its next forward, poll and message by each room's work, so
a burst of N rooms waits in line; on a posting thread (`"worker"`, as
sglang-nixl-prepped) the loop only hands the write over. Real ranks, NIXL over loopback,
host memory: prefill TP2 -> decode TP4 of a 32-layer, 8 KV-head model (head_dim 16, so
the bytes are small and the descriptors are what costs: 2 targets x 2 x 32 layers x 128
tokens = 16,384 requests per prefill rank per room, the study's count), N = 1, 4, 16
rooms arriving at once. Per N: the mean TTFT (arrival to decode ready) of the staging
path (the baseline, posting "lane", in the same run) and of the slice path per posting,
Delta = slice - staging, c(N) = 2 Delta / (N + 1) (one serialized per-room cost c gives
c(N) = c), and beside it the simulation of the same scenario under the matching engine
preset (loop: sglang-nixl, worker: sglang-nixl-prepped) on the loopback-cpu profile.
`uptime` before and after: the host is shared, compare the ratios in one run.

    .venv/bin/python benchmarks/hw_loop_posting.py [--rooms 1,4,16] [--repeats 1]
    KVSTAGE_LOOP_RT=0 .venv/bin/python benchmarks/hw_loop_posting.py   # loop at normal priority

kvstage raises a rank's loop thread to a real-time class (hw/rank/priority.py LoopPriority); a
serving engine's scheduler runs at normal priority, so KVSTAGE_LOOP_RT=0 is the closer
analogue of sglang-nixl (results: docs/results/2026-12-02-hw-loop-posting.md).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvstage.metrics.rooms import room_latencies  # noqa: E402
from kvstage.run import hwrun  # noqa: E402
from kvstage.shared.scenario import scenario_from_dict  # noqa: E402
from kvstage.shared.scenario.engines import ENGINE_PRESETS  # noqa: E402
from kvstage.sim.driver import Simulation  # noqa: E402

PROMPT_TOKENS = 128
PRESET = {"loop": "sglang-nixl", "worker": "sglang-nixl-prepped", "lane": None}


FORWARD_MS = 0.0  # --forward-ms: each room's modeled prefill forward (0: none)


def scenario(rooms: int, path: str, posting: str, engine: str | None = None):
    prefill = {"tp": 2, "chunked_prefill_size": PROMPT_TOKENS}
    hardware = {"backend": "nixl", "posting": posting}
    if FORWARD_MS:  # the forward regime: both modes price a room's forward the same way
        prefill["tokens_per_s"] = PROMPT_TOKENS / (FORWARD_MS * 1e-3)
        hardware["forward_delay"] = True
    return scenario_from_dict(
        {
            "name": f"loop-posting-p2-d4-{rooms}x{PROMPT_TOKENS}-{path}-{posting}",
            "engine": {"preset": engine} if engine else {},
            "model": {"layers": 32, "kv_heads": 8, "head_dim": 16, "params_b": 0.1},
            "prefill": prefill,
            "decode": {"tp": 4, "page_size": 16, "staging_pool_mb": 4, "prefix_tokens": 0},
            "transfer": {"path": path, "room_timeout_s": 180.0},
            "links": {"profile": "loopback-cpu"},
            "hardware": hardware,
            "workload": {
                "requests": rooms,
                "arrival": "burst",
                "burst_size": rooms,
                "rate_per_s": 1e-3,
                "prompt": "fixed",
                "prompt_tokens": PROMPT_TOKENS,
                "seed": 0,
            },
        }
    )


def write_ms(records) -> float:
    """Mean span of one slice-path write call (post to done), ms; 0 on the staging path."""
    spans = [r.end - r.start for r in records if r.phase == "slice_write"]
    return statistics.fmean(spans) * 1e3 if spans else 0.0


def forward_lag_ms(records) -> float:
    """Mean forward start lag, ms: each prefill `compute` row's start minus the previous
    room's compute end on the same rank (rooms 2..N; 0 with one room). With the forwards
    back to back this is the loop's work between them: the posting with "loop"."""
    by_rank: dict[int, list] = {}
    for r in records:
        if r.phase == "compute" and r.role == "prefill":
            by_rank.setdefault(r.rank, []).append(r)
    lags = []
    for rows in by_rank.values():
        rows.sort(key=lambda r: r.start)
        lags += [b.start - a.end for a, b in zip(rows, rows[1:], strict=False)]
    return statistics.fmean(lags) * 1e3 if lags else 0.0


def mean_ttft(records, rooms: int, what: str) -> float:
    lat = room_latencies(records)
    done = [i["done"] - i["arrival"] for i in lat.values() if "done" in i and not i.get("failed")]
    if len(done) != rooms:
        raise SystemExit(f"{what}: {len(done)} of {rooms} rooms done")
    return statistics.fmean(done)


def hw_ttft(rooms: int, path: str, posting: str) -> tuple[float, float, float, float]:
    """(mean TTFT s, mean slice write ms, ms per write the posting thread spent building
    and posting: the loop's with "loop", the worker's with "worker", mean forward start
    lag ms) of one hardware run."""
    s = scenario(rooms, path, posting)
    reports: dict[str, dict] = {}
    launch = hwrun.launch

    def keep_reports(*args, **kw):  # the real launcher; the ranks' reports kept
        result = launch(*args, **kw)
        reports.update(result.reports)
        return result

    hwrun.launch = keep_reports
    try:
        with tempfile.TemporaryDirectory(prefix="kvstage-loop-posting-") as d:
            result = hwrun.launch_run(s, Path(d), timeout_s=300.0)
    finally:
        hwrun.launch = launch
    if result.errors or result.summary.get("bytes_wrong"):
        raise SystemExit(f"{s.name}: {result.errors or 'bytes wrong'}")
    posts = [r["posting"] for n, r in reports.items() if n.startswith("prefill")]
    writes = sum(sum(p["threads"].values()) for p in posts)
    post_ms = sum(sum(p["seconds"].values()) for p in posts) * 1e3 / max(1, writes)
    records = result.records
    return mean_ttft(records, rooms, s.name), write_ms(records), post_ms, forward_lag_ms(records)


def sim_ttft(rooms: int, path: str, posting: str) -> tuple[float, float, float, float]:
    s = scenario(rooms, path, posting, PRESET[posting])
    records = Simulation(s, check=False).run().records
    # the preset's descriptor work of one call (on the scheduler or the worker)
    p, n = ENGINE_PRESETS[PRESET[posting]], s.geometry().slice_requests(0, 0, 8)
    post_ms = sum(p.split(n)) * 1e3 if path == "slice" else 0.0
    ttft = mean_ttft(records, rooms, f"sim {s.name}")
    return ttft, write_ms(records), post_ms, forward_lag_ms(records)


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rooms", default="1,4,16", help="comma-separated rooms in flight")
    ap.add_argument("--repeats", type=int, default=1, help="hardware runs per cell (best kept)")
    ap.add_argument(
        "--regime",
        choices=("forward", "wire"),
        default="forward",
        help="forward: each room's prefill forward modeled (hardware.forward_delay) and long "
        "enough that the lane keeps up, so the forwards queue, as on an RDMA host; wire: no "
        "modeled forward, the loopback copy dominates (the 2026-12-02 first runs)",
    )
    ap.add_argument(
        "--forward-ms",
        type=float,
        default=300.0,
        help="forward regime: one room's modeled prefill forward, ms (prefill.tokens_per_s); "
        "default 300, above the ~100-250 ms a loopback write call takes",
    )
    args = ap.parse_args()
    global FORWARD_MS
    FORWARD_MS = args.forward_ms if args.regime == "forward" else 0.0
    counts = [int(x) for x in args.rooms.split(",")]
    t0 = time.perf_counter()
    print(f"uptime before: {uptime()}")
    print(
        f"prefill TP2 -> decode TP4, NIXL loopback, host memory, {PROMPT_TOKENS}-token rooms "
        f"at once; TTFT ms (mean over rooms, best of {args.repeats})"
        + (f"; each room's forward {FORWARD_MS:g} ms" if FORWARD_MS else "; no modeled forward")
    )
    head = f"  {'N':>3} {'':4} {'staging':>8} {'slice loop':>11} {'slice worker':>13}"
    print(
        head + f" {'D loop':>7} {'D worker':>9} {'c loop':>7} {'c worker':>9} {'D l/w':>6}"
        f" {'write ms l/w':>13} {'post ms l/w':>12} {'fwd lag ms st/l/w':>18}"
    )
    rows = []
    for n in counts:
        hw = {
            (path, posting): min(hw_ttft(n, path, posting) for _ in range(args.repeats))
            for path, posting in (("staging", "lane"), ("slice", "loop"), ("slice", "worker"))
        }
        sim = {
            (path, posting): sim_ttft(n, path, posting)
            for path in ("staging", "slice")
            for posting in ("loop", "worker")
        }
        for mode, both in (("hw", hw), ("sim", sim)):
            t = {k: v[0] for k, v in both.items()}
            sl, sw = both[("slice", "loop")], both[("slice", "worker")]
            w = f"{sl[1]:6.2f}/{sw[1]:.2f}"
            post = f"{sl[2]:6.2f}/{sw[2]:.2f}"
            st = both.get(("staging", "lane"), both.get(("staging", "loop")))
            lag = f"{st[3]:5.1f}/{sl[3]:.1f}/{sw[3]:.1f}"
            base_l = t.get(("staging", "lane"), t.get(("staging", "loop")))
            base_w = t.get(("staging", "lane"), t.get(("staging", "worker")))
            dl, dw = t[("slice", "loop")] - base_l, t[("slice", "worker")] - base_w
            ratio = f"{dl / dw:6.2f}" if dw > 0 else "     -"
            rows.append((mode, n, dl, dw))
            print(
                f"  {n:3d} {mode:4} {base_l * 1e3:8.1f} {t[('slice', 'loop')] * 1e3:11.1f} "
                f"{t[('slice', 'worker')] * 1e3:13.1f} {dl * 1e3:7.1f} {dw * 1e3:9.1f} "
                f"{2 * dl / (n + 1) * 1e3:7.2f} {2 * dw / (n + 1) * 1e3:9.2f} {ratio} {w:>13} {post:>12} {lag:>18}"
            )
    for mode in ("hw", "sim"):
        d = {n: (dl, dw) for m, n, dl, dw in rows if m == mode}
        first = counts[0]
        grow = "  ".join(
            f"N={n}: loop {d[n][0] / d[first][0]:.1f}x worker {d[n][1] / d[first][1]:.1f}x"
            for n in counts[1:]
            if d[first][0] > 0 and d[first][1] > 0
        )
        print(f"{mode}: Delta(N) / Delta({first}): {grow}")
    print("D = slice - staging; c = 2 D / (N + 1); D l/w = D loop / D worker;")
    print("write ms l/w: mean span of one slice write call (post to done), loop / worker;")
    print("post ms l/w: per write call, the posting thread's build + check + post (hw: the")
    print("     loop thread with loop, the posting worker with worker; sim: the preset's)")
    print("fwd lag ms st/l/w: mean of each prefill forward's start minus the previous")
    print("     forward's end on the same rank (rooms 2..N), staging / slice loop / worker")
    print("sim: staging and slice under the matching preset (loop: sglang-nixl, worker:")
    print("     sglang-nixl-prepped), profile loopback-cpu")
    print(f"uptime after: {uptime()}")
    print(f"{time.perf_counter() - t0:.1f} s wall")
    return 0


if __name__ == "__main__":
    sys.exit(main())
