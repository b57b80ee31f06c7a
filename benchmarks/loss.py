"""Rooms done under message loss: 1% of every message type dropped, duplicated and
delayed, in simulation (10,000 requests) and on real transfers (200 rooms, every
byte verified). Run by hand; prints the figures.

Target (issue "a protocol that loses nothing"): at least 99.9% of rooms done, every
failure with its reason, no invariant violation, 0 bytes wrong.

    .venv/bin/python benchmarks/loss.py [--sim-requests 10000] [--hw-rooms 200] [--backend nixl] [--skip-hw]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import Counter
from pathlib import Path

from kvstage.run.hwrun import launch_run
from kvstage.run.result import judge
from kvstage.shared.faults import MESSAGE_NAMES
from kvstage.shared.scenario import load_scenario
from kvstage.sim.driver import Simulation

REPO = Path(__file__).resolve().parents[1]
BASE = REPO / "scenarios" / "faults" / "drop-rsp-watermark.toml"


def loss_overrides(p: float) -> list[str]:
    types = ", ".join(f"{name} = {p}" for name in MESSAGE_NAMES.values())
    return [f"faults.{kind}={{ {types} }}" for kind in ("drop", "duplicate", "delay")]


def simulated(requests: int) -> None:
    sets = [f"workload.requests={requests}", "workload.rate_per_s=40", "transfer.room_timeout_s=2"]
    wall = time.perf_counter()
    r = Simulation(load_scenario(BASE, overrides=sets + loss_overrides(0.01))).run()
    wall = time.perf_counter() - wall
    drops = sum(v for k, v in r.faults_injected.items() if k.startswith("drop:"))
    print(
        f"simulation: {r.rooms_done:,} of {requests:,} rooms done ({r.rooms_done / requests:.3%}), "
        f"{len(r.failures)} failed, {len(r.violations)} invariant violations, {drops:,} messages dropped, "
        f"{wall:.1f} s wall"
    )
    for reason, n in Counter(r.failures.values()).most_common(3):
        print(f"  {n} x {reason[:140]}")


def hardware(rooms: int, backend: str) -> None:
    sets = [
        f"workload.requests={rooms}",
        "workload.rate_per_s=20",
        "transfer.room_timeout_s=20",
        f"hardware.backend={backend}",
        "expect.failed_rooms=[]",
    ]
    s = load_scenario(BASE, overrides=sets + loss_overrides(0.01))
    with tempfile.TemporaryDirectory() as tmp:
        result = launch_run(s, Path(tmp), timeout_s=900)
    code, summary = judge(result).code, result.summary
    done, failed = summary["requests_done"], summary["requests_failed"]
    drops = sum(v for k, v in summary["faults_injected"].items() if k.startswith("drop:"))
    print(
        f"hardware ({backend}): {done} of {rooms} rooms done ({done / rooms:.2%}), {failed} failed, "
        f"{summary['bytes_wrong']:,} of {summary['bytes_verified']:,} bytes wrong, "
        f"{summary['invariant_violations']} invariant violations, {drops} messages dropped, "
        f"{summary['wall_s']:.1f} s wall, exit {code}"
    )
    for reason, n in list(summary.get("failure_groups", {}).items())[:3]:
        print(f"  {n} x {reason[:140]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sim-requests", type=int, default=10_000)
    p.add_argument("--hw-rooms", type=int, default=200)
    p.add_argument("--backend", choices=["nixl", "mooncake"], default="nixl")
    p.add_argument("--skip-hw", action="store_true")
    args = p.parse_args()
    simulated(args.sim_requests)
    if not args.skip_hw:
        hardware(args.hw_rooms, args.backend)


if __name__ == "__main__":
    main()
