"""Staging vs slice vs the engine's raw ceiling, on real transfers (run by hand).

For each backend it runs one fan-in scenario (Llama-3-8B geometry, prefill TP2 ->
decode TP1, all 32 layers kept so the slice path's request count is realistic;
prompts and request count shrunk to fit host memory) on the staging path and on
the slice path, and in the same run measures the engine's raw ceiling: one plain
write of the same total bytes between two processes. Prints:

  staging: payload, time with a write in flight, effective GB/s, share of the ceiling
  slice:   the same, and slice/staging time ratio

Targets on a quiet 2-core machine: staging >= 0.7 of the raw ceiling; slice >= 10x
slower than staging. The machine is shared: compare the ratios, not absolutes.

    .venv/bin/python benchmarks/hw_transfer.py [--backends nixl,mooncake] [--requests 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent))
from transport_raw import run_backend  # noqa: E402

from kvstage.hwrun import run_hardware  # noqa: E402
from kvstage.runs import read_summary  # noqa: E402
from kvstage.shared.scenario import load_scenario  # noqa: E402
from kvstage.tracefile import read_records  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def scenario(backend: str, path: str, requests: int, prompt: int):
    return load_scenario(
        REPO / "scenarios" / "llama3-8b-p4-d2.toml",
        overrides=[
            "prefill.tp=2",
            "decode.tp=1",
            f"transfer.path={path}",
            f"hardware.backend={backend}",
            "hardware.verify=sample",
            f"workload.requests={requests}",
            "workload.arrival=fixed",
            "workload.rate_per_s=1000",
            "workload.prompt=fixed",
            f"workload.prompt_tokens={prompt}",
            "prefill.chunked_prefill_size=512",
            "decode.staging_pool_mb=512",
            "decode.prefix_tokens=0",
        ],
    )


def write_busy(run_dir: Path) -> float:
    """Seconds during which at least one write was in flight (union of the write and
    slice_write spans in the trace): the transfer time, without the prefill's fill
    ("forward") and gather time between writes."""
    _, records = read_records(run_dir)
    spans = sorted((r.start, r.end) for r in records if r.phase in ("write", "slice_write"))
    total, cur_start, cur_end = 0.0, None, None
    for s, e in spans:
        if cur_end is None or s > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = s, e
        else:
            cur_end = max(cur_end, e)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="nixl,mooncake")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3, help="repetitions of the raw write")
    args = ap.parse_args()
    console = Console(width=120)
    rows = []
    for backend in args.backends.split(","):
        out = {}
        with tempfile.TemporaryDirectory() as tmp:
            for path in ("staging", "slice"):
                s = scenario(backend, path, args.requests, args.prompt)
                code, run_dir = run_hardware(s, out=Path(tmp) / path, console=Console(file=open("/dev/null", "w")))
                summ = read_summary(run_dir)
                if code != 0 or summ["requests_failed"] or summ["bytes_wrong"]:
                    console.print(f"[red]{backend} {path} run failed[/]: {summ.get('errors')}")
                    return 1
                out[path] = summ
                out[path + "_busy"] = write_busy(run_dir)
        payload = out["staging"]["payload_bytes"]
        # raw ceiling: one write of the same bytes per writer between two processes
        per_writer_mib = max(1, payload // 2 >> 20)
        raw = run_backend(backend, argparse.Namespace(size_mib=per_writer_mib, op_kib=64, reps=args.reps, timeout=120.0))
        raw_s = statistics.median(raw["seconds"]["large"])
        raw_gbs = (per_writer_mib << 20) / raw_s / 1e9
        st_s, sl_s = out["staging_busy"], out["slice_busy"]
        st_gbs = payload / st_s / 1e9
        rows.append((backend, payload, st_s, st_gbs, sl_s, sl_s / st_s, raw_gbs, st_gbs / raw_gbs,
                     out["staging"]["transfer_requests"]["total"], out["slice"]["transfer_requests"]["total"]))
    console.print(f"{'backend':9} {'payload MiB':>11} {'staging s':>9} {'staging GB/s':>12} {'slice s':>8} "
                  f"{'slice/staging':>13} {'raw GB/s':>8} {'staging/raw':>11} {'req staging':>11} {'req slice':>10}")
    for b, p, st, stg, sl, ratio, rawg, share, rq_st, rq_sl in rows:
        console.print(f"{b:9} {p / 2**20:11.1f} {st:9.3f} {stg:12.2f} {sl:8.3f} {ratio:13.1f} {rawg:8.2f} "
                      f"{share:11.2f} {rq_st:11,} {rq_sl:10,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
