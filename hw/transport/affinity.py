"""Which NIC each rank uses: its rail NIC, from the host's PCIe topology or a user map.

On a GPU node with one NIC per GPU (a "rail"), a rank should send through the NIC on
its GPU's PCIe switch; anything else crosses the CPU's host bridge, or the socket
interconnect, for every byte. This module reads the topology from sysfs, never guesses:

- GPUs: PCI functions of vendor 0x10de (NVIDIA) with a display or 3D controller class
  (0x0300xx, 0x0302xx), numbered by PCI bus id, as `nvidia-smi` and CUDA_DEVICE_ORDER=
  PCI_BUS_ID number them [A: identical GPUs; where `nvidia-smi` answers, its
  index -> bus id table is used instead];
- NICs: RDMA devices (/sys/class/infiniband/<dev>/device) and IP interfaces
  (/sys/class/net/<if>/device; a veth, bridge or loopback has no PCI device);
- each device's PCIe path: the chain of PCI functions from its root port down to it
  (the realpath of /sys/bus/pci/devices/<bdf>), and its numa_node.

Two devices **share a PCIe switch** when their paths share a bridge below the host
bridge (nvidia-smi's PIX / PXB); not when they meet only at the host bridge or are in
different PCI domains (PHB, NODE, SYS); unknown (None) when either has no PCI device.

The NIC of a rank, first that applies:
1. the user's map, `kvstage hw --nic-map 0=mlx5_0,1=mlx5_1` or $KVSTAGE_NIC_MAP, keyed
   by the rank's local rank (LOCAL_RANK / SLURM_LOCALID; ranks that `kvstage hw`
   spawns: their order, prefill first);
2. on a host with RDMA devices and a rank on a GPU: the RDMA device whose PCIe path
   shares the most bridges with the GPU's (ties: the same NUMA node, then the name);
3. on a host with RDMA devices and a rank without a GPU: RDMA devices in name order,
   one per local rank, round robin [A];
4. no RDMA device: the IP interface that holds the rank's address (`lo` on loopback).

The engines get it (hw/transport/placement.py engine_env, transport_options): UCX_NET_DEVICES =
`mlx5_N:PORT` (the first active port) for an RDMA NIC, the interface name otherwise;
Mooncake's device name for protocol rdma. What a user set (UCX_NET_DEVICES,
hardware.mooncake_device) stands, and the record says so.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import re
import shutil
import socket
import struct
import subprocess
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SYS = Path("/sys")
NIC_MAP_ENV = "KVSTAGE_NIC_MAP"
# the local rank of a rank that `kvstage hw` spawned (its place among the host's ranks)
LOCAL_SLOT_ENV = "KVSTAGE_LOCAL_SLOT"
# the NIC this rank's engines were given, for Mooncake's device name (set by engine_env)
RANK_NIC_ENV = "KVSTAGE_RANK_NIC"
NVIDIA_VENDOR = "0x10de"
GPU_CLASSES = ("0x0300", "0x0302")  # PCI class: VGA-compatible, 3D controller
BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_SIOCGIFADDR = 0x8915  # ioctl: an interface's IPv4 address (linux/sockios.h)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def interface_of(address: str) -> str | None:
    """The name of the network interface that holds IPv4 `address` here, or None."""
    if is_loopback(address):
        return "lo"
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on this interface
        if socket.inet_ntoa(raw[20:24]) == address:
            return name
    return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _numa(dev: Path) -> int | None:
    text = _read(dev / "numa_node")
    try:
        n = int(text) if text is not None else -1
    except ValueError:
        return None
    return n if n >= 0 else None  # -1: the platform does not say


@dataclass(frozen=True)
class PciDevice:
    bdf: str
    path: tuple[str, ...]  # PCI functions from the root port down to this one (itself last)
    numa: int | None


def pci_device(link: Path) -> PciDevice | None:
    """The PCI function a sysfs `device` link (or /sys/bus/pci/devices/<bdf>) points at;
    None for a device that is not on PCI (veth, loopback, a virtio device's child)."""
    try:
        real = Path(os.path.realpath(link))
    except OSError:
        return None
    if not real.exists():
        return None
    # a virtio NIC's `device` is virtioN, a child of its PCI function
    while real.name and not BDF.match(real.name) and real.parent != real:
        if "pci" in real.name or real.name in ("devices", "virtual"):
            return None
        real = real.parent
    if not BDF.match(real.name):
        return None
    chain = tuple(p for p in real.parts if BDF.match(p))
    return PciDevice(real.name, chain, _numa(real))


def shares_switch(a: PciDevice | None, b: PciDevice | None) -> bool | None:
    """True when `a` and `b` share a PCIe bridge below the host bridge; None when either
    is not a PCI device."""
    if a is None or b is None:
        return None
    common = 0
    for x, y in zip(a.path[:-1], b.path[:-1], strict=False):
        if x != y:
            break
        common += 1
    return common > 0


def _common(a: PciDevice, b: PciDevice) -> int:
    n = 0
    for x, y in zip(a.path, b.path, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass(frozen=True)
class Gpu:
    index: int
    pci: PciDevice


def parse_smi_bus_ids(text: str) -> dict[int, str]:
    """`nvidia-smi --query-gpu=index,pci.bus_id --format=csv,noheader` -> {index: bdf}
    (nvidia-smi writes an 8-digit domain, upper case: 00000000:1B:00.0)."""
    out = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 2 or not parts[0].isdigit():
            continue
        dom, _, rest = parts[1].lower().rpartition(":")
        dom_bus = dom.split(":")
        if len(dom_bus) == 2:
            out[int(parts[0])] = f"{dom_bus[0][-4:]}:{dom_bus[1]}:{rest}"
    return out


def _smi_bus_ids() -> dict[int, str]:
    if shutil.which("nvidia-smi") is None:
        return {}
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,pci.bus_id", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return parse_smi_bus_ids(done.stdout) if done.returncode == 0 else {}


def gpus(sys_root: Path = SYS, smi: dict[int, str] | None = None) -> list[Gpu]:
    """The host's NVIDIA GPUs by index: nvidia-smi's bus ids where given (`smi`),
    else PCI bus order."""
    devices = sys_root / "bus" / "pci" / "devices"
    try:
        entries = sorted(p.name for p in devices.iterdir())
    except OSError:
        return []
    if smi:
        found = [(i, pci_device(devices / bdf)) for i, bdf in sorted(smi.items())]
        return [Gpu(i, d) for i, d in found if d is not None]
    out = []
    for bdf in entries:
        d = devices / bdf
        if _read(d / "vendor") == NVIDIA_VENDOR and (_read(d / "class") or "").startswith(
            GPU_CLASSES
        ):
            pci = pci_device(d)
            if pci is not None:
                out.append(Gpu(len(out), pci))
    return out


@dataclass(frozen=True)
class Nic:
    name: str
    kind: str  # "rdma" or "ip"
    pci: PciDevice | None
    port: int | None = None  # RDMA: the first active port (else the first)
    speed_gbs: float | None = None  # link rate, GB/s (10^9 bytes/s)


def rdma_rate_gbs(text: str | None) -> float | None:
    """An RDMA port's `rate` ("400 Gb/sec (4X NDR)") in GB/s (10^9 bytes/s)."""
    m = re.match(r"\s*([\d.]+)\s*Gb/sec", text or "")
    return float(m.group(1)) / 8 if m else None


def net_speed_gbs(text: str | None) -> float | None:
    """/sys/class/net/<if>/speed (Mbit/s; -1 or unreadable: unknown) in GB/s."""
    try:
        mbps = int(text or "")
    except ValueError:
        return None
    return mbps * 1e6 / 8 / 1e9 if mbps > 0 else None


def rdma_nics(sys_root: Path = SYS) -> list[Nic]:
    root = sys_root / "class" / "infiniband"
    try:
        names = sorted(p.name for p in root.iterdir())
    except OSError:
        return []
    out = []
    for name in names:
        ports = sorted(
            (p for p in (root / name / "ports").glob("*") if p.name.isdigit()),
            key=lambda p: int(p.name),
        )
        active = [p for p in ports if "ACTIVE" in (_read(p / "state") or "")]
        port = (active or ports or [None])[0]
        out.append(
            Nic(
                name,
                "rdma",
                pci_device(root / name / "device"),
                int(port.name) if port is not None else None,
                rdma_rate_gbs(_read(port / "rate")) if port is not None else None,
            )
        )
    return out


def ip_nics(sys_root: Path = SYS) -> list[Nic]:
    root = sys_root / "class" / "net"
    try:
        names = sorted(p.name for p in root.iterdir())
    except OSError:
        return []
    return [
        Nic(
            n,
            "ip",
            pci_device(root / n / "device") if (root / n / "device").exists() else None,
            None,
            net_speed_gbs(_read(root / n / "speed")),
        )
        for n in names
    ]


def parse_nic_map(text: str) -> dict[int, str]:
    """`0=mlx5_0,1=mlx5_1` -> {0: "mlx5_0", 1: "mlx5_1"}; ValueError naming the bad item."""
    out: dict[int, str] = {}
    for item in (i.strip() for i in text.split(",")):
        if not item:
            continue
        key, sep, nic = item.partition("=")
        if not sep or not key.strip().isdigit() or not re.fullmatch(r"[A-Za-z0-9_.:-]+", nic):
            raise ValueError(
                f"--nic-map item {item!r} is not LOCAL_RANK=NIC; allowed: e.g. "
                f"0=mlx5_0,1=mlx5_1 (a NIC from /sys/class/infiniband or /sys/class/net)"
            )
        out[int(key)] = nic.strip()
    return out


@dataclass(frozen=True)
class Affinity:
    """One rank's placement on its host: what the table prints and summary.json keeps."""

    rank: str
    host: str  # the rank's address
    gpu: str  # "GPU1 0000:1b:00.0", or "no GPU"
    numa: str  # the GPU's NUMA node (else the NIC's), "?" where sysfs does not say
    nic: str
    kind: str  # rdma or ip
    how: str  # why this NIC
    shares_switch: bool | None
    ucx_device: str | None  # what UCX_NET_DEVICES is (None: not set by kvstage)
    local_rank: int | None = None
    # the NIC's link rate, GB/s: an RDMA port's rate, a PCI NIC's speed; None where sysfs
    # does not say, or the device is virtual (a veth's "speed" is nominal, not a limit)
    link_gbs: float | None = None

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)


def _gpu_of(device: str, env: Mapping[str, str], found: list[Gpu]) -> tuple[Gpu | None, str]:
    """The GPU a rank on `device` uses, and how to print it."""
    if not str(device).startswith("cuda"):
        return None, "no GPU"
    ordinal = int(str(device).partition(":")[2] or 0)
    visible = env.get("CUDA_VISIBLE_DEVICES")
    index = ordinal
    if visible is not None:
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        if ordinal >= len(entries) or not entries[ordinal].isdigit():
            return None, f"{device} (CUDA_VISIBLE_DEVICES={visible!r}: PCI position unknown)"
        index = int(entries[ordinal])
    for g in found:
        if g.index == index:
            return g, f"GPU{index} {g.pci.bdf}"
    return None, f"{device} (no NVIDIA GPU {index} in sysfs)"


def _best_rdma(gpu: Gpu, nics: list[Nic]) -> Nic:
    placed = [n for n in nics if n.pci is not None]
    if not placed:
        return nics[0]
    return min(
        placed,
        key=lambda n: (-_common(gpu.pci, n.pci), n.pci.numa != gpu.pci.numa, n.name),
    )


def _choose(
    local: int | None,
    gpu: Gpu | None,
    host_iface: str | None,
    user_map: dict[int, str],
    rdma: list[Nic],
    ip: list[Nic],
) -> tuple[Nic | None, str]:
    if local is not None and local in user_map:
        name = user_map[local]
        known = {n.name: n for n in [*rdma, *ip]}
        if name not in known:
            raise ValueError(
                f"--nic-map {local}={name}: no such NIC on this host; allowed: "
                f"{', '.join(sorted(known)) or 'none found'}"
            )
        return known[name], "user map"
    if rdma and gpu is not None:
        return _best_rdma(gpu, rdma), "PCIe topology (nearest to the GPU)"
    if rdma:
        return rdma[(local or 0) % len(rdma)], "round robin (no GPU)"
    by_name = {n.name: n for n in ip}
    if host_iface in by_name:
        return by_name[host_iface], "holds the rank's address"
    return None, "no NIC holds the rank's address"


def rank_affinity(
    rank: str,
    host: str,
    device: str,
    local_rank: int | None,
    *,
    env: Mapping[str, str] | None = None,
    sys_root: Path = SYS,
    host_iface: str | None = None,
    smi: dict[int, str] | None = None,
) -> Affinity:
    """This rank's NIC and GPU (see the module docstring). `host_iface`: the interface
    holding `host` (default: looked up here). ValueError for a bad user map."""
    env = os.environ if env is None else env
    if local_rank is None and env.get(LOCAL_SLOT_ENV, "").isdigit():
        local_rank = int(env[LOCAL_SLOT_ENV])
    user_map = parse_nic_map(env.get(NIC_MAP_ENV, ""))
    found = gpus(sys_root, _smi_bus_ids() if smi is None and sys_root == SYS else smi)
    gpu, gpu_text = _gpu_of(device, env, found)
    rdma, ip = rdma_nics(sys_root), ip_nics(sys_root)
    iface = host_iface if host_iface is not None else interface_of(host)
    if is_loopback(host) and local_rank not in user_map:
        rdma = []  # every peer is on this host: no NIC carries the bytes
    nic, how = _choose(local_rank, gpu, iface, user_map, rdma, ip)
    user_ucx = env.get("UCX_NET_DEVICES")
    if nic is None:
        ucx = None
    elif nic.kind == "rdma":
        ucx = f"{nic.name}:{nic.port or 1}"
    else:
        ucx = nic.name
    if user_ucx:
        how += f"; UCX_NET_DEVICES={user_ucx} set by the user stands"
        ucx = user_ucx
    numa = gpu.pci.numa if gpu is not None else (nic.pci.numa if nic and nic.pci else None)
    return Affinity(
        rank=rank,
        host=host,
        gpu=gpu_text,
        numa=str(numa) if numa is not None else "?",
        nic=nic.name if nic else "-",
        kind=nic.kind if nic else "-",
        how=how,
        shares_switch=shares_switch(gpu.pci if gpu else None, nic.pci if nic else None),
        ucx_device=ucx,
        local_rank=local_rank,
        link_gbs=nic.speed_gbs if nic is not None and nic.pci is not None else None,
    )


_current: Affinity | None = None


def choose_for_rank(rank: str, host: str, device: str, local_rank: int | None) -> Affinity | None:
    """A rank's affinity, kept for its report and said in its log (one line); None after
    saying, in one line, why the user's map cannot be followed."""
    import sys

    try:
        aff = rank_affinity(rank, host, device, local_rank)
    except ValueError as exc:
        print(f"{rank}: error: {exc}", file=sys.stderr)
        return None
    set_current(aff)
    print(f"{rank}: NIC {aff.nic} ({aff.how}), {aff.gpu}, NUMA {aff.numa}", file=sys.stderr)
    return aff


def set_current(aff: Affinity | None) -> None:
    global _current
    _current = aff


def current() -> dict[str, Any] | None:
    """This process's affinity, as the rank reports it (None where none was chosen)."""
    return _current.to_wire() if _current is not None else None


def _yes_no(v: bool | None) -> str:
    return "unknown" if v is None else ("yes" if v else "no")


def table_lines(rows: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The affinity table: rank, host, GPU, NUMA node, NIC, GPU and NIC on one switch."""
    head = (
        f"{'rank':<10} {'host':<15} {'GPU':<22} {'NUMA':>4}  {'NIC':<12} {'same switch':<11}  how"
    )
    out = [head]
    for name in sorted(rows, key=lambda n: (not n.startswith("prefill"), len(n), n)):
        r = rows[name] or {}
        nic = f"{r.get('nic', '-')}" + (f" ({r['kind']})" if r.get("kind") == "rdma" else "")
        out.append(
            f"{name:<10} {str(r.get('host', '?')):<15} {str(r.get('gpu', '?')):<22} "
            f"{str(r.get('numa', '?')):>4}  {nic:<12} {_yes_no(r.get('shares_switch')):<11}  "
            f"{r.get('how', '')}"
        )
    return out


def host_topology(sys_root: Path = SYS) -> dict[str, Any]:
    """environment.json's `affinity`: the GPUs and NICs with their PCIe paths and NUMA
    nodes, and which GPU shares a switch with which NIC."""
    found = gpus(sys_root, _smi_bus_ids() if sys_root == SYS else None)
    nics = [*rdma_nics(sys_root), *ip_nics(sys_root)]

    def dev(p: PciDevice | None) -> dict[str, Any] | None:
        return {"bdf": p.bdf, "path": list(p.path), "numa": p.numa} if p else None

    return {
        "gpus": [{"index": g.index, **(dev(g.pci) or {})} for g in found] or "no GPU",
        "nics": [
            {
                "name": n.name,
                "kind": n.kind,
                "port": n.port,
                "speed_gbs": n.speed_gbs,
                "pci": dev(n.pci),
            }
            for n in nics
        ],
        "same_switch": {
            f"GPU{g.index}": [n.name for n in nics if shares_switch(g.pci, n.pci)] for g in found
        },
    }
