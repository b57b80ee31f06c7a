"""Write the simulation trace of every catalogue and fault scenario, staging and slice.

A change meant to move code without changing behaviour proves it with this: run it
before and after into two folders and compare them byte for byte.

    .venv/bin/python scripts/catalogue_traces.py /tmp/before
    ... change ...
    .venv/bin/python scripts/catalogue_traces.py /tmp/after
    diff -r /tmp/before /tmp/after && echo identical

Each trace is JSON lines (one record per line, in the order the run emitted them),
so a difference names the first record that moved. The summary's deterministic
figures are written beside it (wall-clock figures left out).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WALL_KEYS = {"wall_s", "requests_per_wall_s", "events_per_wall_s"}
# numbers of the order `kvstage calibrate` writes on a 2-core host
HOST_MODEL = {
    "host_model": "cpu-loop",
    "host_cores": 2,
    "engine_thread_cores": 0.5,
    "event_us": 40,
    "fill_latency_us": 200,
    "fill_bandwidth_gbs": 2,
}


def scenarios() -> list[Path]:
    return sorted((ROOT / "scenarios").glob("*.toml")) + sorted(
        (ROOT / "scenarios" / "faults").glob("*.toml")
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="folder for <scenario>-<path>.jsonl and .summary.json")
    p.add_argument("--requests", type=int, default=None, help="override workload.requests (faster)")
    args = p.parse_args(argv)
    from kvstage.run.summary import simulation_summary
    from kvstage.run.tracefile import write_trace
    from kvstage.shared.scenario import load_scenario
    from kvstage.sim.driver import Simulation

    args.out.mkdir(parents=True, exist_ok=True)
    for path in scenarios():
        for transfer in ("staging", "slice", "staging-host"):
            sets = [f"transfer.path={transfer.removesuffix('-host')}"]
            if transfer.endswith("-host"):  # the opt-in cpu-loop host model (sim/host.py)
                sets += [f"links.{k}={v}" for k, v in HOST_MODEL.items()]
            if args.requests is not None:
                sets.append(f"workload.requests={args.requests}")
            scenario = load_scenario(path, overrides=sets)
            result = Simulation(scenario).run()
            stem = f"{path.stem}-{transfer}"
            write_trace(args.out / f"{stem}.jsonl", result.records, "sim")
            summary = {
                k: v for k, v in simulation_summary(scenario, result).items() if k not in WALL_KEYS
            }
            (args.out / f"{stem}.summary.json").write_text(
                json.dumps(summary, indent=1, sort_keys=True, default=str)
            )
            print(
                f"{stem}: {len(result.records)} records, {result.rooms_done} done, {result.rooms_failed} failed",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
