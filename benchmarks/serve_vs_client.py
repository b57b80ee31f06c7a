"""A real benchmark client (AIPerf) against `kvstage serve`: does it measure what kvstage
simulated? Prints, per metric, the client's figure minus kvstage's own for the same
requests, and how much of that the server's lag explains (the rest is the client's
timing noise).

    .venv/bin/python benchmarks/serve_vs_client.py [--requests 12] [--gap-ms 150] \
        [--scenario scenarios/llama3-70b-p8-d2.toml] [--set K=V ...] [--out DIR]

It writes a Mooncake trace of `--requests` requests (`--gap-ms` apart, prompts and
output lengths all different, so requests pair by their token counts), starts
`kvstage serve` on a free port, runs `aiperf profile` on the trace with a fixed
schedule and the tokenizer the server wrote (offline: no hub), stops the server, and pairs
AIPerf's `profile_export.jsonl` with the server's `served.jsonl`
(kvstage/serve/agreement.py). Results: docs/results/2026-12-03-serve-vs-aiperf.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvstage.fmt import quantile
from kvstage.measured.aiperf import read_records
from kvstage.serve.agreement import client_view, differences, pair, read_served
from kvstage.serve.tokenizer import HUB_REPO

REPO = Path(__file__).resolve().parents[1]
SCENARIO = REPO / "scenarios" / "llama3-70b-p8-d2.toml"
MODEL = "kvstage-sim"


def write_trace(path: Path, requests: int, gap_ms: float) -> list[tuple[int, int]]:
    """A Mooncake trace whose requests all differ in (input, output) length."""
    rows, keys = [], []
    for i in range(requests):
        inp, out = 300 + 137 * i, 6 + 2 * (i % 5) + i
        ids = list(range(1000 * i, 1000 * i + -(-inp // 512)))  # no shared prefixes
        rows.append({"timestamp": round(i * gap_ms), "input_length": inp, "output_length": out})
        rows[-1]["hash_ids"] = ids
        keys.append((inp, out))
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return keys


def start_server(scenario: Path, sets: list[str], run_dir: Path, timeout_s: float = 180.0):
    """`kvstage serve` on a free port: (process, base URL)."""
    cmd = [sys.executable, "-m", "kvstage.cli", "serve", str(scenario), "--port", "0"]
    cmd += ["--out", str(run_dir), "--model", MODEL]
    for s in sets:
        cmd += ["--set", s]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout_s
    seen = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if line.startswith("listening on "):
            return proc, line.split()[-1]
    proc.kill()
    raise RuntimeError("kvstage serve did not say it was listening:\n" + "".join(seen[-20:]))


def stop_server(proc, timeout_s: float = 120.0) -> str:
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=timeout_s)
    return out


AIPERF = Path(sys.executable).parent / "aiperf"  # the bench-client extra's
SLOW_HOST_WAITS = (
    "REGISTRATION_TIMEOUT",
    "START_TIMEOUT",
    "PROFILE_START_TIMEOUT",
    "COMMAND_RESPONSE_TIMEOUT",
)


def run_aiperf(url: str, run_dir: Path, trace: Path, out: Path, timeout_s: float = 600.0):
    """AIPerf replays `trace` on a fixed schedule against `url`, offline: the tokenizer
    is the server's, from the hub cache in its run directory (AIPerf's worker processes
    resolve tokenizers by name in offline mode, so a plain directory path fails there
    once the dataset is built in parallel)."""
    aiperf = Path(os.environ.get("KVSTAGE_AIPERF", AIPERF))
    cmd = [
        str(aiperf), "profile",
        "--model", MODEL, "--url", url, "--endpoint-type", "completions", "--streaming",
        "--tokenizer", HUB_REPO,
        "--input-file", str(trace), "--custom-dataset-type", "mooncake_trace", "--fixed-schedule",
        "--artifact-dir", str(out), "--ui-type", "none", "--random-seed", "0",
        "--workers-max", "2", "--record-processors", "1",
        "--no-server-metrics", "--no-gpu-telemetry",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_CACHE": str(run_dir / "hf-cache"), "HF_HUB_OFFLINE": "1"}
    # AIPerf's own start-up waits (30 s to register its services, 60 s to start) are
    # too short on a loaded 2-core host (seen: "Some services failed to register within
    # timeout" at a load average of 30); its environment variables lengthen them
    env.update({f"AIPERF_SERVICE_{k}": str(timeout_s) for k in SLOW_HOST_WAITS})
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"aiperf exited {r.returncode}:\n{(r.stdout + r.stderr)[-4000:]}")
    found = sorted(out.rglob("profile_export.jsonl"))
    if not found:
        raise RuntimeError(f"aiperf wrote no profile_export.jsonl under {out}")
    return found[0]


def replay(workdir: Path, scenario: Path, sets: list[str], requests: int, gap_ms: float):
    """The whole loop: (pairs, differences, server output)."""
    workdir.mkdir(parents=True, exist_ok=True)
    run_dir = workdir / "serve"
    proc, url = start_server(scenario, sets, run_dir)
    try:
        pairs = replay_on(url, run_dir, workdir / "client", requests, gap_ms)
    finally:
        log = stop_server(proc)
    return pairs, differences(pairs), log


def replay_on(url: str, run_dir: Path, workdir: Path, requests: int, gap_ms: float):
    """AIPerf replays a fresh trace on a running server (whose run directory is
    `run_dir`); its records paired with the requests the server served meanwhile."""
    workdir.mkdir(parents=True, exist_ok=True)
    trace = workdir / "trace.jsonl"
    write_trace(trace, requests, gap_ms)
    served = run_dir / "served.jsonl"
    before = len(read_served(served))
    export = run_aiperf(url, run_dir, trace, workdir / "aiperf")
    return pair(read_records(export).requests, read_served(served)[before:])


def _row(name: str, xs: list[float]) -> str:
    ms = sorted(x * 1e3 for x in xs)
    a = sorted(abs(x) for x in ms)
    return (
        f"{name:<18} n={len(ms):<4} median {quantile(ms, 0.5):+8.3f}  p99 |.| "
        f"{quantile(a, 0.99):7.3f}  max |.| {a[-1]:7.3f} ms"
    )


def _values(x) -> list[float]:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", type=Path, default=SCENARIO)
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--gap-ms", type=float, default=150.0)
    ap.add_argument("--out", type=Path, default=Path("runs") / f"serve-vs-aiperf-{os.getpid()}")
    a = ap.parse_args()
    load = os.getloadavg()
    pairs, diff, _ = replay(a.out, a.scenario, a.sets, a.requests, a.gap_ms)
    print(f"{len(pairs)} requests paired; load average before {load[0]:.2f}, after "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")  # fmt: skip
    print("metric  quantile: AIPerf / kvstage (ms)")
    for m in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        theirs = sorted(v for c, _ in pairs for v in _values(client_view(c)[m]))
        ours = sorted(v for _, row in pairs for v in _values(row[m]))
        cells = [
            f"p{round(q * 100)} {quantile(theirs, q) * 1e3:7.1f} / {quantile(ours, q) * 1e3:7.1f}"
            for q in (0.5, 0.9, 0.99)
        ]
        print(f"{m:<7} " + " | ".join(cells))
    print("client minus kvstage, per request (ITL: per gap); 'vs sent': minus the figure as sent")
    for m, d in diff.items():
        print(_row(f"{m} vs sim", d["vs_sim"]))
        print(_row(f"{m} vs sent", d["vs_sent"]))
    lags = sorted(x for _, row in pairs for x in row["sent_late_s"])
    print(_row("server lag", lags))
    print(f"artifacts: {a.out}")


if __name__ == "__main__":
    main()
