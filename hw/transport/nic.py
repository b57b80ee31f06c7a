"""A host's NIC byte counters, read before and after a rank's transfers.

What the engines report is what they were asked to move; the counters say what left
and entered each device. IP interfaces (TCP, veth, loopback) count bytes in
/sys/class/net/<dev>/statistics/{tx,rx}_bytes; RDMA ports count in
/sys/class/infiniband/<dev>/ports/<p>/counters/port_{xmit,rcv}_data, in units of
4 bytes (lanes), per the InfiniBand spec's PortCounters (the kernel's sysfs ABI says so).
"""

from __future__ import annotations

from pathlib import Path

NET = Path("/sys/class/net")
INFINIBAND = Path("/sys/class/infiniband")
IB_DATA_UNIT = 4  # port_xmit_data / port_rcv_data count 4-byte words


def _int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def read_counters(net: Path = NET, infiniband: Path = INFINIBAND) -> dict[str, dict[str, int]]:
    """{device: {"tx_bytes": .., "rx_bytes": ..}}: IP interfaces by name, RDMA ports as
    `mlx5_0/1`. Devices whose counters cannot be read are left out."""
    out: dict[str, dict[str, int]] = {}
    for d in sorted(net.glob("*")):
        tx, rx = _int(d / "statistics" / "tx_bytes"), _int(d / "statistics" / "rx_bytes")
        if tx is not None and rx is not None:
            out[d.name] = {"tx_bytes": tx, "rx_bytes": rx}
    for port in sorted(infiniband.glob("*/ports/*")):
        tx, rx = (
            _int(port / "counters" / "port_xmit_data"),
            _int(port / "counters" / "port_rcv_data"),
        )
        if tx is not None and rx is not None:
            out[f"{port.parent.parent.name}/{port.name}"] = {
                "tx_bytes": tx * IB_DATA_UNIT,
                "rx_bytes": rx * IB_DATA_UNIT,
            }
    return out


def counter_delta(
    before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]
) -> dict[str, dict[str, int]]:
    """Bytes each device moved between two readings (devices in both, with traffic)."""
    out = {}
    for dev in sorted(set(before) & set(after)):
        d = {k: after[dev][k] - before[dev][k] for k in ("tx_bytes", "rx_bytes")}
        if d["tx_bytes"] > 0 or d["rx_bytes"] > 0:
            out[dev] = d
    return out
