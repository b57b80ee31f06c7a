"""How promptly hardware-mode rank loops answer (run by hand; prints its figures).

For P2->D1 and P4->D2 it runs one hardware scenario and reads the trace:

- control-message delivery: STAGING_REQ sent by a prefill rank (its `req` record) to
  the decode rank handling it (the decode's `req` record for the same room, chunk and
  writer), p50 / p99 — every rank runs on this host, so one clock;
- room-open skew: for each room, the spread of the prefill ranks' `room_open` times;
- req -> rsp round trip at the prefill, p50 / p99;
- share of loop time blocked: per rank, the part of its loop's time spent in a turn
  (handling messages, starting and reporting work, or waiting for the interpreter lock)
  rather than waiting on its socket, where a message is taken at once; and the longest
  turns (how long a message could wait to be looked at).

Goal on a quiet machine (issue 13): delivery p50 under 2 ms and p99 under 20 ms for
P2->D1. Check `uptime` first: on a loaded host these figures mean little.

    .venv/bin/python benchmarks/hw_loop.py [--backend nixl] [--requests 24]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from rich.console import Console

from kvstage.hw.rank import LOOP_STATS_ENV
from kvstage.hwrun import run_hardware
from kvstage.shared.scenario import load_scenario
from kvstage.tracefile import read_records

REPO = Path(__file__).resolve().parents[1]


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def figures(records) -> dict[str, list[float]]:
    sent: dict[tuple, float] = {}
    got: dict[tuple, float] = {}
    rsp: dict[tuple, float] = {}
    opens: dict[int, list[float]] = {}
    for r in records:
        if r.phase == "req" and not r.detail.startswith("retry"):
            if r.role == "prefill":
                sent.setdefault((r.room, r.chunk, r.writer, r.peer), r.start)
            else:
                got.setdefault((r.room, r.chunk, r.writer, r.rank), r.start)
        elif r.phase == "rsp" and r.role == "prefill":
            rsp.setdefault((r.room, r.chunk, r.writer, r.peer), r.start)
        elif r.phase == "room_open" and r.role == "prefill":
            opens.setdefault(r.room, []).append(r.start)
    delivery = [got[k] - t for k, t in sent.items() if k in got]
    rtt = [rsp[k] - t for k, t in sent.items() if k in rsp]
    skew = [max(v) - min(v) for v in opens.values() if len(v) > 1]
    return {"delivery": delivery, "rtt": rtt, "skew": skew}


def run_case(tp: tuple[int, int], backend: str, requests: int) -> None:
    P, D = tp
    s = load_scenario(REPO / "scenarios" / "llama3-8b-p4-d2.toml", overrides=[
        f"prefill.tp={P}", f"decode.tp={D}", f"hardware.backend={backend}", f"workload.requests={requests}",
        "workload.rate_per_s=8", "hardware.scale_down.enabled=true"]).scaled()
    with tempfile.TemporaryDirectory() as tmp:
        stats_dir = Path(tmp) / "loop"
        stats_dir.mkdir()
        os.environ[LOOP_STATS_ENV] = str(stats_dir)  # the spawned ranks inherit it
        try:
            code, run_dir = run_hardware(s, out=Path(tmp) / "run", timeout_s=600, console=Console(quiet=True))
        finally:
            del os.environ[LOOP_STATS_ENV]
        _, records = read_records(run_dir)
        loops = {p.stem: json.loads(p.read_text()) for p in sorted(stats_dir.glob("*.json"))}
    f = figures(records)
    ms = 1e3
    print(f"P{P}->D{D} {backend} ({requests} requests, exit {code}):")
    print(f"  STAGING_REQ delivery  p50 {pct(f['delivery'], .5) * ms:7.2f} ms   p99 {pct(f['delivery'], .99) * ms:7.2f} ms"
          f"   (n={len(f['delivery'])})")
    print(f"  REQ -> RSP at prefill p50 {pct(f['rtt'], .5) * ms:7.2f} ms   p99 {pct(f['rtt'], .99) * ms:7.2f} ms")
    if f["skew"]:
        print(f"  room-open skew        p50 {pct(f['skew'], .5) * ms:7.2f} ms   max {max(f['skew']) * ms:7.2f} ms")
    if f["delivery"]:
        print(f"  delivery mean {statistics.mean(f['delivery']) * ms:.2f} ms")
    for name, lp in loops.items():
        print(f"  loop {name:9} blocked {lp['blocked_share'] * 100:5.1f}% of {lp['loop_s']:6.2f} s   turns "
              f"{lp['turns']:6d}  p50 {lp['turn_p50_s'] * ms:6.2f} ms  p99 {lp['turn_p99_s'] * ms:6.2f} ms  "
              f"max {lp['turn_max_s'] * ms:7.2f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=["nixl", "mooncake"], default="nixl")
    p.add_argument("--requests", type=int, default=24)
    args = p.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    for tp in ((2, 1), (4, 2)):
        run_case(tp, args.backend, args.requests)


if __name__ == "__main__":
    main()
