"""`kvstage hw --baseline`: the vendors' own benchmarks beside kvstage's figures.

Three tools, each looked up on PATH; where one is absent, one line says so:
- `ib_write_bw` (perftest): RDMA WRITE bandwidth between two processes. Run here, on
  the NIC the run's ranks used, when the run has an RDMA NIC and all its ranks are on
  this host (server and client on one host over the NIC; 8 MiB messages, 2 s,
  `--report_gbits`, converted to GB/s). Across hosts the launcher cannot start the
  other end: the line gives the two command lines to run by hand.
- `transfer_engine_bench` (Mooncake; the wheel installs it): run here when all the
  ranks are on this host: a target and an initiator meeting peer to peer
  (P2PHANDSHAKE, the target's handshake port read from its log), writes of 8 MiB
  blocks for 2 s over the run's protocol (rdma on its NIC where the run's NIC is RDMA,
  else tcp). It prints "GB/s" (its calculateRate; read as 10^9 bytes/s [A]).
- `nixlbench` (NIXL) coordinates its two ends through an etcd server
  (`--etcd_endpoints`) [C: its README]: found, it is named, not run.
Across hosts the launcher cannot start a tool's other end: the line says so.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

TOOLS = ("nixlbench", "ib_write_bw", "transfer_engine_bench")
IB_MSG_BYTES = 8 << 20
IB_SECONDS = 2
IB_PORT = 18515  # perftest's default TCP port for the exchange [C: perftest]
TIMEOUT_S = 30.0


def parse_ib_write_bw(text: str) -> float | None:
    """GB/s (10^9 bytes/s) from ib_write_bw's result row with --report_gbits:
    `#bytes #iterations BW peak[Gb/sec] BW average[Gb/sec] MsgRate[Mpps]`."""
    found = None
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[0].isdigit():
            try:
                found = float(parts[3]) / 8  # Gbit/s -> GB/s
            except ValueError:
                continue
    return found


def _ib_write_bw(tool: str, nic: str) -> tuple[float | None, str]:
    base = [tool, "-d", nic, "-s", str(IB_MSG_BYTES), "-D", str(IB_SECONDS), "--report_gbits"]
    base += ["-p", str(IB_PORT)]
    server = subprocess.Popen(base, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(0.5)  # the server opens its exchange port
        client = subprocess.run(
            [*base, "127.0.0.1"], capture_output=True, text=True, timeout=TIMEOUT_S
        )
        server.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None, f"no result within {TIMEOUT_S:.0f} s"
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(timeout=5)
    gbs = parse_ib_write_bw(client.stdout)
    if client.returncode != 0 or gbs is None:
        tail = (client.stdout + client.stderr).strip().splitlines()[-1:] or ["no output"]
        return None, f"exit {client.returncode}: {tail[0][:160]}"
    return gbs, f"{' '.join(base)} (server) and ... 127.0.0.1 (client)"


TEB_BLOCK = 8 << 20
TEB_BUFFER = 256 << 20


def parse_teb(text: str) -> float | None:
    """GB/s from transfer_engine_bench's `Test completed: ..., throughput X GB/s`."""
    m = re.findall(r"Test completed:.*throughput\s+([\d.]+)\s*GB/s", text)
    return float(m[-1]) if m else None


def _target_port(log: Path, host: str, proc: subprocess.Popen) -> str | None:
    """The handshake port a transfer_engine_bench target says it listens on (10 s at most)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and proc.poll() is None:
        m = re.search(rf"listening on {re.escape(host)}:(\d+)", log.read_text(errors="replace"))
        if m:
            return m.group(1)
        time.sleep(0.1)
    return None


def _transfer_engine_bench(tool: str, host: str, nic: str | None) -> tuple[float | None, str]:
    import tempfile

    proto = ["--protocol=rdma", f"--device_name={nic}"] if nic else ["--protocol=tcp"]
    common = [tool, "--metadata_server=P2PHANDSHAKE", f"--local_server_name={host}", *proto]
    common += [f"--buffer_size={TEB_BUFFER}"]
    env = {**os.environ, "MC_LOG_LEVEL": "INFO"}  # the target says its handshake port at INFO
    with tempfile.TemporaryDirectory(prefix="kvstage-teb-") as tmp:
        log = Path(tmp) / "target.log"
        with log.open("w") as fh:
            target = subprocess.Popen(  # its own group: the wrapper on PATH starts the binary
                [*common, "--mode=target"],
                stdout=fh,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        try:
            port = _target_port(log, host, target)
            if port is None:
                return None, "its target did not say its handshake port within 10 s"
            run = [*common, "--mode=initiator", f"--segment_id={host}:{port}", "--operation=write"]
            run += ["--duration=2", "--threads=1", f"--block_size={TEB_BLOCK}", "--batch_size=4"]
            done = subprocess.run(run, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
        except subprocess.TimeoutExpired:
            return None, f"no result within {TIMEOUT_S:.0f} s"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(target.pid, signal.SIGKILL)
            target.wait(timeout=5)
    gbs = parse_teb(done.stdout + done.stderr)
    if gbs is None:
        return None, f"exit {done.returncode}, no 'Test completed' line"
    return gbs, f"write, 8 MiB x 4 per batch, 2 s, {proto[0][2:]}"


def baselines(
    affinity: Mapping[str, Mapping[str, Any] | None],
    which: Callable[[str], str | None] = shutil.which,
) -> list[dict[str, Any]]:
    """One entry per tool: {tool, path, gbs, note}; `affinity`: the run's, per rank."""
    rows = [a or {} for a in affinity.values()]
    hosts = sorted({str(a.get("host")) for a in rows})
    rdma = sorted({a["nic"] for a in rows if a.get("kind") == "rdma"})
    out = []
    for tool in TOOLS:
        path = which(tool)
        entry: dict[str, Any] = {"tool": tool, "path": path, "gbs": None}
        if path is None:
            entry["note"] = "not on PATH: no baseline from it"
        elif tool == "nixlbench":
            entry["note"] = (
                f"found, not run: its two ends meet through an etcd server; run it on {hosts}"
            )
        elif len(hosts) > 1:
            entry["note"] = (
                f"found, not run: the pairs span hosts {hosts} and only this host's end can be "
                "started here; run its two ends on a prefill and a decode host"
            )
        elif tool == "transfer_engine_bench":
            entry["gbs"], entry["note"] = _transfer_engine_bench(
                path, hosts[0], (rdma or [None])[0]
            )
        elif not rdma:
            entry["note"] = "found, not run: the run's ranks used no RDMA NIC"
        else:
            entry["gbs"], entry["note"] = _ib_write_bw(path, rdma[0])
        out.append(entry)
    return out


def baseline_lines(entries: list[dict[str, Any]], pairs: list[dict[str, Any]]) -> list[str]:
    """What each tool measured beside kvstage's lowest pair and its ceiling (GB/s)."""
    low = min(pairs, key=lambda p: p["achieved_gbs"]) if pairs else None
    ours = (
        f"; kvstage: lowest pair {low['prefill']}->{low['decode']} {low['achieved_gbs']:.2f} GB/s, "
        f"its ceiling {low['ceiling_gbs']:.2f} GB/s"
        if low and low.get("ceiling_gbs")
        else ""
    )
    out = []
    for e in entries:
        if e["gbs"] is not None:
            out.append(f"baseline {e['tool']}: {e['gbs']:.2f} GB/s ({e['note']}){ours}")
        else:
            out.append(f"baseline {e['tool']}: {e['note']}")
    return out
