"""What does posting a transfer cost, and does it serialise? The posting probe alone.

Runs `kvstage.hw.probes.posting.measure_posting` (a receiver and two sender processes
on this machine, host memory, the engine called directly) and prints the fit of
`kvstage.calibrate.posting`: posting per batch and per request with fresh descriptors
(and, for NIXL, with descriptor lists prepared once), the small-write rate after
posting, and whether two ranks' (two processes) or two threads' batches posted at once
overlap or serialise. `kvstage calibrate` runs the same probe and writes these numbers
into the profile; this script is for repeating the measurement on another host (it
needs only numpy, torch and the engine, not the rest of kvstage's dependencies):

    .venv/bin/python benchmarks/posting.py nixl
    .venv/bin/python benchmarks/posting.py mooncake --quick --json runs/posting-mooncake.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvstage.calibrate.posting import fit_posting  # noqa: E402
from kvstage.hw.probes.posting import PostingPlan, measure_posting  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("backend", choices=["nixl", "mooncake"])
    ap.add_argument("--quick", action="store_true", help="fewer batch sizes and repetitions")
    ap.add_argument(
        "--json", type=Path, default=None, help="also write the raw points and the fit here"
    )
    args = ap.parse_args()
    plan = PostingPlan.quick_plan() if args.quick else PostingPlan()
    t0 = time.perf_counter()
    raw = measure_posting(args.backend, plan)
    fit = fit_posting(raw)
    print(f"{args.backend}: posting probe, {raw['cores']} cores, {time.perf_counter() - t0:.1f} s")
    for line in fit.toml_lines():
        print(line.removeprefix("# "))
    for name, o in (("two ranks", fit.two_ranks), ("two threads", fit.two_threads)):
        print(
            f"  {name}: {raw['pair_ops']} writes each; alone posted {o.alone_post_s * 1e3:.2f} ms, done "
            f"{o.alone_done_s * 1e3:.2f} ms; both at once: later posted {o.pair_post_s * 1e3:.2f} ms "
            f"({o.post_ratio:.2f}x), later done {o.pair_done_s * 1e3:.2f} ms ({o.done_ratio:.2f}x)"
        )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"raw": raw, "fit": fit.table()}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
