"""What really moved a rank's bytes: the transports its engine chose, read from the engine.

A run that asked for RDMA must not pass on TCP. Neither engine refuses on its own:
Mooncake asked for protocol "rdma" on a host without an HCA initializes fine, finds
"0 HCAs" and serves the transfers over TCP; UCX under NIXL picks whatever transport
reaches the peer. So each rank asks its engine what it chose, and the launcher
compares that with what the run asked for (`rdma_problem`), failing closed.

- NIXL: UCX prints, per endpoint configuration and operation, the transports its
  protocol selection chose when `UCX_PROTO_INFO=y`; the rank sends UCX's log to a file
  of its own (`UCX_LOG_FILE`) and reads the tables of "remote memory write" (the
  one-sided WRITEs kvstage posts): e.g. `cma/memory` (same host, host memory),
  `tcp/eth0`, `rc_mlx5/mlx5_0:1` (RDMA), `cuda_ipc/cuda` (same host, GPU memory).
- Mooncake: the protocol it was initialized with and the HCAs of its topology
  (`TransferEngine.get_local_topology()`, JSON: per CPU or GPU location, the preferred
  and the other HCAs).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

# Transport names (the part before "/" in a UCX protocol table's Config column) that are
# RDMA: InfiniBand / RoCE verbs and mlx5 transports, AWS SRD; "rdma" is Mooncake's.
RDMA_TRANSPORTS = (
    "rc",
    "rc_verbs",
    "rc_mlx5",
    "dc",
    "dc_mlx5",
    "ud",
    "ud_verbs",
    "ud_mlx5",
    "gga",
    "gga_mlx5",
    "srd",
    "rdma",
)
# Transports that never cross a host: a same-host pair may use them under any ask.
LOCAL_TRANSPORTS = (
    "cma",
    "sysv",
    "posix",
    "knem",
    "xpmem",
    "cuda_ipc",
    "rocm_ipc",
    "self",
    "cuda_copy",
    "rocm_copy",
    "memory",
)
UCX_TABLE_SCOPE = re.compile(
    r"\|\s*(?P<peer>\S+)\s+(?P<scope>self|intra-node|inter-node)\s+cfg#\d+"
)
UCX_CONFIG_CELL = re.compile(r"\|[^|]*\|[^|]*\|\s*(?P<config>[^|]+?)\s*\|\s*$")


def transport_name(config: str) -> str:
    """`rc_mlx5/mlx5_0:1` -> `rc_mlx5`; a multi-lane cell `50% on rc_mlx5/mlx5_0:1 and ...`
    gives its first transport."""
    for token in config.replace(",", " ").split():
        if "/" in token:
            return token.split("/", 1)[0]
    return config.strip()


def is_rdma(transport: str) -> bool:
    return transport_name(transport) in RDMA_TRANSPORTS


def parse_ucx_proto_info(text: str) -> dict[str, list[str]]:
    """{scope: the transports/devices UCX chose for remote memory writes} from UCX's
    protocol-selection tables (UCX_PROTO_INFO=y); scope is "intra-node" or "inter-node"
    (endpoints of a process to itself are left out)."""
    out: dict[str, set[str]] = {}
    scope = None
    in_write = False
    for raw in text.splitlines():
        line = (
            raw.split("]", 2)[-1] if raw.startswith("[") else raw
        )  # drop "[time] [host:pid:thread]"
        m = UCX_TABLE_SCOPE.search(line)
        if m:
            scope, in_write = m.group("scope"), False
            continue
        if scope is None:
            continue
        if "|" in line and "remote memory write" in line:
            in_write = True
            continue
        if "|" in line and (
            "active message" in line or "remote memory read" in line or "atomic" in line
        ):
            in_write = False
            continue
        cell = UCX_CONFIG_CELL.search(line)
        if in_write and cell and scope != "self":
            config = cell.group("config")
            if config != "Config" and "/" in config:
                for part in re.findall(r"[A-Za-z0-9_]+/[A-Za-z0-9_.:-]+", config):
                    out.setdefault(scope, set()).add(part)
    return {k: sorted(v) for k, v in sorted(out.items())}


# where a rank told UCX to log (set by the rank with the two UCX variables; absent: the
# user set UCX's own, and nothing is recorded)
UCX_LOG_ENV = "KVSTAGE_UCX_LOG"


def ucx_log_env(log_path: Path, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables that make UCX write its protocol choices to `log_path`, to be set
    before NIXL loads UCX (none where the user set UCX's log file or protocol info
    already: theirs stands)."""
    env = os.environ if env is None else env
    if env.get("UCX_LOG_FILE") or env.get("UCX_PROTO_INFO"):
        return {}
    return {"UCX_PROTO_INFO": "y", "UCX_LOG_FILE": str(log_path), UCX_LOG_ENV: str(log_path)}


def read_ucx_log(log_path: Path | None) -> dict[str, Any]:
    """summary.json's view of a NIXL rank's transports, from its UCX log; the log's other
    lines (UCX warnings and errors) are returned too, to be shown in the rank's log."""
    if log_path is None:
        return {"source": "not recorded (UCX_LOG_FILE or UCX_PROTO_INFO set by the user)"}
    try:
        text = log_path.read_text(errors="replace")
    except OSError as exc:
        return {"source": f"UCX log {log_path} unreadable: {exc.strerror or exc}"}
    writes = parse_ucx_proto_info(text)
    notes = [ln for ln in text.splitlines() if ("WARN" in ln or "ERROR" in ln) and "|" not in ln][
        :20
    ]
    return {
        "source": "UCX_PROTO_INFO",
        "writes": writes,
        "over": carried_over(writes),
        "ucx_notes": notes,
    }


def mooncake_hcas(topology_json: str) -> list[str]:
    """Every HCA named in Mooncake's local topology (preferred or not), sorted."""
    try:
        topo = json.loads(topology_json)
    except (TypeError, ValueError):
        return []
    found: set[str] = set()
    locations = topo.values() if isinstance(topo, dict) else []
    for groups in locations:
        for group in groups if isinstance(groups, list) else []:
            if isinstance(group, list):
                found.update(h for h in group if isinstance(h, str))
    return sorted(found)


def mooncake_used(protocol: str, topology_json: str) -> dict[str, Any]:
    hcas = mooncake_hcas(topology_json)
    rdma = protocol == "rdma" and bool(hcas)  # Mooncake falls back to TCP without an HCA
    writes = {"any": [f"rdma/{h}" for h in hcas] if rdma else ["tcp"]}
    return {
        "source": "Mooncake topology",
        "protocol": protocol,
        "hcas": hcas,
        "writes": writes,
        "over": "rdma" if rdma else "tcp",
    }


def carried_over(writes: Mapping[str, Iterable[str]]) -> str | None:
    """What the writes crossed: "rdma" (RDMA, and same-host transports for local peers),
    "same-host" (only transports that never leave the host, e.g. CMA), "tcp" (any other
    transport: TCP sockets), None when nothing was recorded."""
    names = {transport_name(t) for ts in writes.values() for t in ts}
    if not names:
        return None
    if names - set(RDMA_TRANSPORTS) - set(LOCAL_TRANSPORTS):
        return "tcp"
    return "rdma" if names & set(RDMA_TRANSPORTS) else "same-host"


def rdma_problem(asked: str | None, used: Mapping[str, Mapping[str, Any]]) -> str | None:
    """Why the run must fail: it asked for RDMA (`asked` says where) and a rank's writes
    went over TCP; None when RDMA was not asked, or every write went over RDMA or stayed
    on its host (a same-host pair's CMA or CUDA IPC is no network at all)."""
    if not asked:
        return None
    bad = []
    for name, u in sorted(used.items()):
        if u.get("over") == "tcp":
            what = ", ".join(t for ts in u.get("writes", {}).values() for t in ts) or "?"
            bad.append(f"{name} wrote over {what}")
    if not bad:
        return None
    return f"{asked} asked for RDMA, but {'; '.join(bad)}: the bytes did not move over RDMA"


def rdma_devices(sysfs: Path = Path("/sys/class/infiniband")) -> list[str]:
    """The RDMA devices this host has (mlx5_0, ...), from sysfs; [] when none."""
    try:
        return sorted(p.name for p in sysfs.iterdir())
    except OSError:
        return []


def rdma_asked(hardware: Any, env: Mapping[str, str] | None = None) -> str | None:
    """Where this run asks for RDMA, as a phrase for messages, or None."""
    env = os.environ if env is None else env
    if hardware.backend == "mooncake" and hardware.mooncake_protocol == "rdma":
        return 'hardware.mooncake_protocol = "rdma"'
    if hardware.backend == "nixl":
        tls = env.get("UCX_TLS", "")
        if any(
            transport_name(t.lstrip("^")) in RDMA_TRANSPORTS or t in ("ib", "rc", "dc", "ud")
            for t in tls.split(",")
            if t and not tls.startswith("^")
        ):
            return f"UCX_TLS = {tls!r}"
        if "mlx" in env.get("UCX_NET_DEVICES", ""):
            return f"UCX_NET_DEVICES = {env['UCX_NET_DEVICES']!r}"
    return None


def no_rdma_here(asked: str | None, devices: list[str] | None = None) -> str | None:
    """The one line that refuses a run asking for RDMA on a host without an RDMA device."""
    if not asked:
        return None
    devices = rdma_devices() if devices is None else devices
    if devices:
        return None
    return (
        f"{asked} but this host has no RDMA device (/sys/class/infiniband is empty or absent), so "
        f"the engine would move the bytes over TCP; allowed: a host with an RDMA NIC, or TCP "
        f'(mooncake_protocol = "tcp", UCX_TLS/UCX_NET_DEVICES without RDMA transports)'
    )
