"""What `kvstage hw` checks before it writes anything or starts a rank.

Each check returns one line saying what is wrong and what is allowed, or None; the
launcher refuses the run (exit 2) on the first problem, before the run directory, the
secret or any process exists. What a rank can only learn where it runs (its GPU, its
host's RDMA devices, a rendezvous that does not answer) it checks itself and says in
one line the same way (hw/rank/main.py).
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvstage.hw.transport.bandwidth import probe_bytes
from kvstage.hw.transport.used import no_rdma_here, rdma_asked
from kvstage.shared.cluster import pipeline_problem
from kvstage.shared.serving.capacity import scenario_gpus

MIB = 1 << 20
# What one rank process holds besides its pools: the interpreter with torch 2.13 (CPU),
# nixl 1.5.1 and mooncake 0.3.13 imported, peak RSS measured here (2026-12-02): 261 MiB.
RANK_BASE_BYTES = 256 * MIB
# Gathered blocks in flight per decode rank a prefill rank writes to: its send buffer
# holds this many full chunks' blocks for each (hw/rank/prefill.py sizes it so).
SEND_BUFFER_CHUNKS = 4
# Host memory the launcher leaves for everything else (the launcher itself, page cache
# the engines need, other processes): a kvstage assumption, not a measurement.
HOST_RESERVE_BYTES = 512 * MIB


def port_problem(bind: str, port: int) -> str | None:
    """The rendezvous port is taken (another run, another program). Port 0 (a free port
    the system picks) is never a problem."""
    if port == 0:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(
            socket.SOL_SOCKET, socket.SO_REUSEADDR, 1
        )  # as ZMQ binds: TIME_WAIT is no conflict
        try:
            s.bind((bind, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return (
                    f"--port {port}: the port is in use on {bind} (another kvstage run, or another "
                    f"program); allowed: a free port, or 0 to let the system pick one"
                )
            return f"--port {port}: cannot listen on {bind}:{port}: {exc.strerror or exc}"
    return None


def rank_bytes(scenario: Any, role: str, rank: int) -> int:
    """What one rank allocates: its KV pool, the decode's staging ring or the prefill's
    send buffer (as hw/rank/process.py, hw/rank/decode.py, hw/rank/prefill.py size them), and
    RANK_BASE_BYTES."""
    from kvstage.shared.cluster import hardware_sessions
    from kvstage.shared.pages import kv_pool_pages
    from kvstage.shared.workload import generate_requests

    g = scenario.geometry()
    requests = generate_requests(scenario)
    sessions, _ = hardware_sessions(scenario, requests)
    mine = [r for r in requests if sessions.serves(role, rank, r.room)]
    heads = g.prefill_heads if role == "prefill" else g.decode_heads
    pages = kv_pool_pages(g, role, mine, scenario.hardware.kv_pool_mb * MIB)
    total = pages * g.block_bytes(g.page_size, heads) + RANK_BASE_BYTES
    if role == "decode":
        return total + max(1, scenario.pool_bytes)
    # the bandwidth probe's source buffer (hw/rank/prefill.py _probe), when one runs
    total += probe_bytes(scenario.pool_bytes)
    targets = sessions.all_targets(rank)
    local = sessions.local(role, rank)
    full = max(
        (
            g.block_bytes(
                g.grid_pages * g.page_size, g.head_slice(local, d % g.decode_tp).num_heads
            )
            for d in targets
        ),
        default=0,
    )
    return total + max(1, full * SEND_BUFFER_CHUNKS * len(targets))


def available_host_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def memory_problem(
    scenario: Any, ranks: list[tuple[str, int]], available: int | None = None
) -> str | None:
    """The ranks spawned on this host would not fit its free memory (host memory; on
    cuda the pools live on the GPUs, checked by each rank, and only the base counts here)."""
    available = available_host_bytes() if available is None else available
    if available is None or not ranks:
        return None
    on_gpu = scenario.hardware.device.startswith("cuda")
    need = sum(
        RANK_BASE_BYTES if on_gpu else rank_bytes(scenario, role, rank) for role, rank in ranks
    )
    usable = max(0, available - HOST_RESERVE_BYTES)
    if need <= usable:
        return None
    return (
        f"{len(ranks)} ranks need {need / MIB:,.0f} MiB of host memory (KV pools, staging rings, send "
        f"buffers, {RANK_BASE_BYTES // MIB} MiB each for the process) but this host has "
        f"{usable / MIB:,.0f} MiB to spare ({available / MIB:,.0f} MiB available less "
        f"{HOST_RESERVE_BYTES // MIB} MiB kept back); allowed: a smaller hardware.kv_pool_mb or "
        f"decode.staging_pool_mb, fewer requests or ranks (hardware.scale_down), or a bigger host"
    )


def simulated_only(scenario: Any) -> str | None:
    """What the scenario asks that only the simulator models, or None."""
    if scenario.cluster.max_local_prefill_length is not None:
        return (
            "cluster.max_local_prefill_length: conditional disaggregation (prompts prefilled "
            "on their decode instance) is simulated only; hardware mode moves every prompt's "
            'KV: remove it or set it to "off" (kvstage sim runs it)'
        )
    return None


def launch_problem(
    scenario: Any, *, spawn: bool, bind: str, port: int, device_problem: Callable[[str], str | None]
) -> str | None:
    """The first reason `kvstage hw` must not start, or None."""
    prefill, decode = scenario_gpus(scenario)
    ranks = [("prefill", r) for r in range(prefill)] + [("decode", r) for r in range(decode)]
    checks = [
        lambda: pipeline_problem(scenario),
        lambda: simulated_only(scenario),
        lambda: port_problem(bind, port),
        lambda: device_problem(scenario.hardware.device) if spawn else None,
        lambda: no_rdma_here(rdma_asked(scenario.hardware)) if spawn else None,
        lambda: memory_problem(scenario, ranks) if spawn else None,
    ]
    for check in checks:
        problem = check()
        if problem:
            return problem
    return None
