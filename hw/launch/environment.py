"""environment.json: what a hardware run ran on, so that a result can be read later.

Written by `kvstage hw` into the run directory before the ranks start: the versions of
kvstage, Python, torch (and its CUDA), NIXL, UCX and Mooncake; the host's GPUs, NICs
(IP interfaces with their state and speed, RDMA devices with their ports) and NUMA
nodes; the GPU topology where `nvidia-smi topo -m` answers, and the PCIe paths of GPUs
and NICs with which GPU shares a switch with which NIC (hw/transport/affinity.py); and the environment
variables that steer the engines, placement and kvstage. The run secret is never in it:
variables whose name says SECRET, TOKEN, KEY or PASSWORD are listed by name only.

Everything is read, never guessed: what cannot be read is said as such ("absent",
"unreadable: ..."), so an empty field cannot be mistaken for a measurement.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import runpy
import shutil
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ENVIRONMENT_FILE = "environment.json"
# variables worth recording: the engines' (UCX, NIXL, Mooncake), GPUs', placement's
ENV_PREFIXES = ("UCX_", "NIXL_", "MC_", "NCCL_", "CUDA_", "KVSTAGE_", "SLURM_", "MASTER_", "OMP_")
ENV_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "HOSTNAME")
SECRET_WORDS = re.compile(r"SECRET|TOKEN|KEY|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)
PACKAGES = (
    "kvstage",
    "torch",
    "nixl",
    "mooncake-transfer-engine-non-cuda",
    "mooncake-transfer-engine",
    "pyzmq",
    "numpy",
    "simpy",
)
COMMAND_TIMEOUT_S = 10.0


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _run(cmd: list[str]) -> str:
    """A command's output, or why there is none."""
    if shutil.which(cmd[0]) is None:
        return f"absent: no {cmd[0]} on PATH"
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unreadable: {exc}"
    return (
        done.stdout.strip()
        if done.returncode == 0
        else f"unreadable: exit {done.returncode}: {done.stderr.strip()[:300]}"
    )


def versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "kernel": platform.release()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    cuda = torch_cuda()
    if cuda is not None:
        out["torch_cuda"] = cuda or "none (CPU build)"
    out["ucx"] = ucx_version()
    return out


def torch_cuda() -> str | None:
    """The CUDA version torch was built with ("" for a CPU build; None without torch),
    from its build record (torch/version.py, the `cuda` that torch.version reads),
    without importing torch (2.4 s: every launcher of a run asks)."""
    if "torch" in sys.modules:
        return str(sys.modules["torch"].version.cuda or "")
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return None
    try:
        record = runpy.run_path(str(Path(spec.origin).parent / "version.py"))
    except (OSError, SyntaxError, ImportError):  # not laid out as torch's wheels are
        import torch

        return str(torch.version.cuda or "")
    return str(record.get("cuda") or "")


def ucx_version() -> str:
    """The UCX that NIXL bundles: ucp_get_version_string() of each bundled libucp, or why
    it is unknown."""
    import ctypes

    spec = importlib.util.find_spec("nixl")  # found, not imported (it imports torch)
    if spec is None or spec.origin is None:
        return "absent: nixl not installed"
    base = Path(spec.origin).resolve().parent.parent
    found = []
    for lib in sorted(base.glob("nixl*.libs/**/libucp*.so*")):
        try:
            fn = ctypes.CDLL(str(lib)).ucp_get_version_string
            fn.restype = ctypes.c_char_p
            found.append(f"{fn().decode()} ({lib.parent.name})")
        except (OSError, AttributeError) as exc:
            found.append(f"unreadable ({lib.parent.name}: {exc})")
    return ", ".join(found) if found else "unknown: no libucp bundled with nixl"


def net_interfaces(root: Path = Path("/sys/class/net")) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    try:
        names = sorted(p.name for p in root.iterdir())
    except OSError:
        return out
    for name in names:
        d = root / name
        speed = _read(d / "speed")
        out[name] = {
            "state": _read(d / "operstate"),
            "mtu": _read(d / "mtu"),
            "speed_mbps": int(speed)
            if speed and speed.lstrip("-").isdigit() and int(speed) > 0
            else None,
            "numa_node": _read(d / "device" / "numa_node"),
            "pci": Path(os.path.realpath(d / "device")).name if (d / "device").exists() else None,
        }
    return out


def rdma_inventory(root: Path = Path("/sys/class/infiniband")) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    try:
        devices = sorted(p.name for p in root.iterdir())
    except OSError:
        return out
    for dev in devices:
        ports = {}
        for port in sorted((root / dev / "ports").glob("*")):
            ports[port.name] = {
                "state": _read(port / "state"),
                "rate": _read(port / "rate"),
                "link_layer": _read(port / "link_layer"),
            }
        out[dev] = {
            "numa_node": _read(root / dev / "device" / "numa_node"),
            "pci": Path(os.path.realpath(root / dev / "device")).name,
            "ports": ports,
        }
    return out


def gpus() -> dict[str, Any]:
    listing = _run(
        [
            "nvidia-smi",
            "--query-gpu=index,name,memory.total,pci.bus_id,driver_version",
            "--format=csv,noheader",
        ]
    )
    topo = _run(["nvidia-smi", "topo", "-m"])
    return {"nvidia_smi": listing, "topology": topo}


def environment_variables(env: Mapping[str, str] | None = None) -> dict[str, str]:
    env = os.environ if env is None else env
    out = {}
    for k in sorted(env):
        if k.startswith(ENV_PREFIXES) or k in ENV_NAMES:
            out[k] = "(set; not recorded)" if SECRET_WORDS.search(k) else env[k]
    return out


def _affinity() -> dict[str, Any] | str:
    from kvstage.hw.transport.affinity import host_topology

    try:
        return host_topology()
    except OSError as exc:  # sysfs unreadable: say so, never guess
        return f"unreadable: {exc}"


def collect(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    numa = sorted(p.name for p in Path("/sys/devices/system/node").glob("node[0-9]*"))
    return {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "numa_nodes": numa,
        "python_executable": sys.executable,
        "versions": versions(),
        "gpus": gpus(),
        "net": net_interfaces(),
        "rdma": rdma_inventory(),
        "affinity": _affinity(),  # GPUs and NICs with PCIe paths, which share a switch
        "env": environment_variables(env),
    }


def write_environment(run_dir: Path, env: Mapping[str, str] | None = None) -> Path:
    path = run_dir / ENVIRONMENT_FILE
    path.write_text(json.dumps(collect(env), indent=2, sort_keys=True) + "\n")
    return path
