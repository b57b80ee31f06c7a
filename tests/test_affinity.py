"""Per-rank NIC affinity (hw/transport/affinity.py) against a sysfs tree built of real files.

The tree is a two-socket GPU node in miniature: under each root port a PCIe switch
with one GPU and one RDMA NIC on its downstream ports (the rail layout of an 8-GPU
node, two rails shown), a virtio eth0 on the host bridge and a veth without a PCI
device. Every link is a real symlink that os.path.realpath follows, as in /sys.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvstage.hw.transport.affinity import (
    NIC_MAP_ENV,
    RANK_NIC_ENV,
    gpus,
    parse_nic_map,
    parse_smi_bus_ids,
    rank_affinity,
    rdma_nics,
    rdma_rate_gbs,
    shares_switch,
    table_lines,
)
from kvstage.hw.transport.placement import engine_env

# (bdf, parent path under devices/pci0000:00, vendor, class, numa)
RAIL0 = ["0000:00:01.0", "0000:01:00.0"]  # root port, switch upstream port
RAIL1 = ["0000:00:02.0", "0000:05:00.0"]
DEVICES = {
    "0000:00:01.0": ([], "0x8086", "0x060400", 0),
    "0000:01:00.0": (RAIL0[:1], "0x1000", "0x060400", 0),
    "0000:02:00.0": (RAIL0, "0x1000", "0x060400", 0),
    "0000:02:01.0": (RAIL0, "0x1000", "0x060400", 0),
    "0000:03:00.0": ([*RAIL0, "0000:02:00.0"], "0x10de", "0x030200", 0),  # GPU0
    "0000:04:00.0": ([*RAIL0, "0000:02:01.0"], "0x15b3", "0x020700", 0),  # mlx5_0
    "0000:00:02.0": ([], "0x8086", "0x060400", 1),
    "0000:05:00.0": (RAIL1[:1], "0x1000", "0x060400", 1),
    "0000:06:00.0": (RAIL1, "0x1000", "0x060400", 1),
    "0000:06:01.0": (RAIL1, "0x1000", "0x060400", 1),
    "0000:07:00.0": ([*RAIL1, "0000:06:00.0"], "0x10de", "0x030200", 1),  # GPU1
    "0000:08:00.0": ([*RAIL1, "0000:06:01.0"], "0x15b3", "0x020700", 1),  # mlx5_1
    "0000:00:03.0": ([], "0x1af4", "0x020000", -1),  # virtio-net (eth0)
}


def _dev_dir(root: Path, bdf: str) -> Path:
    parents = DEVICES[bdf][0]
    return (
        root / "devices" / "pci0000:00" / Path(*parents, bdf)
        if parents
        else (root / "devices" / "pci0000:00" / bdf)
    )


def _link(link: Path, target: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(target, link.parent))


def fake_sysfs(root: Path, rdma: bool = True) -> Path:
    for bdf, (_, vendor, cls, numa) in DEVICES.items():
        d = _dev_dir(root, bdf)
        d.mkdir(parents=True, exist_ok=True)
        (d / "vendor").write_text(vendor + "\n")
        (d / "class").write_text(cls + "\n")
        (d / "numa_node").write_text(f"{numa}\n")
        _link(root / "bus" / "pci" / "devices" / bdf, d)
    virtio = _dev_dir(root, "0000:00:03.0") / "virtio2"
    virtio.mkdir()
    _link(root / "class" / "net" / "eth0" / "device", virtio)
    (root / "class" / "net" / "eth0" / "speed").write_text("25000\n")
    (root / "class" / "net" / "veth0").mkdir(parents=True)  # virtual: no device link
    (root / "class" / "net" / "lo").mkdir()
    if rdma:
        for name, bdf in (("mlx5_0", "0000:04:00.0"), ("mlx5_1", "0000:08:00.0")):
            ib = root / "class" / "infiniband" / name
            _link(ib / "device", _dev_dir(root, bdf))
            port = ib / "ports" / "1"
            port.mkdir(parents=True)
            (port / "state").write_text("4: ACTIVE\n")
            (port / "rate").write_text("400 Gb/sec (4X NDR)\n")
    return root


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    return fake_sysfs(tmp_path / "sys")


def _aff(sysfs: Path, device: str, local: int | None, env=None, host="10.0.0.1", iface="eth0"):
    return rank_affinity(
        "prefill0", host, device, local, env=env or {}, sys_root=sysfs, host_iface=iface, smi={}
    )


def test_gpus_in_bus_order_and_nics_with_ports(sysfs: Path) -> None:
    found = gpus(sysfs, smi={})
    assert [(g.index, g.pci.bdf, g.pci.numa) for g in found] == [
        (0, "0000:03:00.0", 0),
        (1, "0000:07:00.0", 1),
    ]
    assert found[0].pci.path == ("0000:00:01.0", "0000:01:00.0", "0000:02:00.0", "0000:03:00.0")
    nics = rdma_nics(sysfs)
    assert [(n.name, n.port, n.speed_gbs, n.pci.bdf) for n in nics] == [
        ("mlx5_0", 1, 50.0, "0000:04:00.0"),
        ("mlx5_1", 1, 50.0, "0000:08:00.0"),
    ]
    assert shares_switch(found[0].pci, nics[0].pci) is True
    assert shares_switch(found[0].pci, nics[1].pci) is False  # only the host bridge between
    assert shares_switch(found[0].pci, None) is None


def test_each_gpu_gets_the_nic_on_its_switch(sysfs: Path) -> None:
    a0, a1 = _aff(sysfs, "cuda:0", 0), _aff(sysfs, "cuda:1", 1)
    assert (a0.nic, a0.kind, a0.shares_switch, a0.numa, a0.ucx_device) == (
        "mlx5_0",
        "rdma",
        True,
        "0",
        "mlx5_0:1",
    )
    assert (a1.nic, a1.shares_switch, a1.numa, a1.gpu) == ("mlx5_1", True, "1", "GPU1 0000:07:00.0")
    # a task bound to GPU1 sees it as cuda:0: still GPU1's NIC
    bound = _aff(sysfs, "cuda:0", 0, env={"CUDA_VISIBLE_DEVICES": "1"})
    assert (bound.gpu, bound.nic) == ("GPU1 0000:07:00.0", "mlx5_1")
    uuid = _aff(sysfs, "cuda:0", 0, env={"CUDA_VISIBLE_DEVICES": "GPU-1234"})
    assert "PCI position unknown" in uuid.gpu and uuid.shares_switch is None


def test_user_map_wins_and_bad_maps_are_refused(sysfs: Path) -> None:
    a = _aff(sysfs, "cuda:0", 0, env={NIC_MAP_ENV: "0=mlx5_1,1=mlx5_0"})
    assert (a.nic, a.how, a.shares_switch) == ("mlx5_1", "user map", False)
    assert parse_nic_map("0=mlx5_0, 1=mlx5_1") == {0: "mlx5_0", 1: "mlx5_1"}
    with pytest.raises(ValueError, match="'x=mlx5_0' is not LOCAL_RANK=NIC"):
        parse_nic_map("x=mlx5_0")
    with pytest.raises(ValueError, match="0=mlx5_9: no such NIC on this host; allowed: eth0"):
        _aff(sysfs, "cuda:0", 0, env={NIC_MAP_ENV: "0=mlx5_9"})
    user = _aff(sysfs, "cuda:0", 0, env={"UCX_NET_DEVICES": "mlx5_1:1"})
    assert user.ucx_device == "mlx5_1:1" and "set by the user stands" in user.how


def test_cpu_ranks_spread_over_rdma_nics_and_fall_back_to_their_interface(
    sysfs: Path, tmp_path: Path
) -> None:
    assert [_aff(sysfs, "cpu", r).nic for r in range(3)] == ["mlx5_0", "mlx5_1", "mlx5_0"]
    assert _aff(sysfs, "cpu", 0).gpu == "no GPU"
    plain = fake_sysfs(tmp_path / "plain", rdma=False)
    eth = _aff(plain, "cpu", 0)
    assert (eth.nic, eth.kind, eth.ucx_device, eth.gpu, eth.numa) == (
        "eth0",
        "ip",
        "eth0",
        "no GPU",
        "?",
    )
    veth = _aff(plain, "cuda:0", 0, iface="veth0")
    assert (veth.nic, veth.shares_switch) == ("veth0", None)  # a veth has no PCI device
    lo = _aff(sysfs, "cpu", 0, host="127.0.0.1", iface="lo")
    assert (lo.nic, lo.how) == ("lo", "holds the rank's address")  # loopback needs no RDMA NIC


def test_engines_get_the_rank_nic(sysfs: Path) -> None:
    a = _aff(sysfs, "cuda:1", 1)
    env = engine_env("10.0.0.1", "cuda:1", env={}, affinity=a)
    assert env["UCX_NET_DEVICES"] == "mlx5_1:1" and env[RANK_NIC_ENV] == "mlx5_1"
    kept = engine_env("10.0.0.1", "cuda:1", env={"UCX_NET_DEVICES": "mlx5_0:1"}, affinity=a)
    assert "UCX_NET_DEVICES" not in kept  # the user's value stands


def test_table_and_nvidia_smi_bus_ids(sysfs: Path) -> None:
    rows = {
        "decode0": _aff(sysfs, "cpu", 0).to_wire(),
        "prefill0": _aff(sysfs, "cuda:0", 0).to_wire(),
    }
    lines = table_lines(rows)
    assert lines[0].split()[:6] == ["rank", "host", "GPU", "NUMA", "NIC", "same"]
    assert lines[1].startswith("prefill0") and "GPU0 0000:03:00.0" in lines[1]
    assert "mlx5_0 (rdma)" in lines[1] and " yes " in lines[1]
    assert lines[2].startswith("decode0") and "no GPU" in lines[2] and "unknown" in lines[2]
    assert table_lines({"decode0": None})[1].startswith("decode0")  # a rank that said nothing
    assert parse_smi_bus_ids("0, 00000000:1B:00.0\n1, 00000000:9A:00.0\n") == {
        0: "0000:1b:00.0",
        1: "0000:9a:00.0",
    }
    assert rdma_rate_gbs("200 Gb/sec (4X HDR)") == 25.0 and rdma_rate_gbs("") is None


@pytest.mark.slow
def test_bad_nic_map_at_the_cli_is_one_line(tmp_path: Path) -> None:
    scenario = Path(__file__).parents[1] / "scenarios" / "llama3-8b-p4-d2.toml"
    done = subprocess.run(
        [sys.executable, "-m", "kvstage.cli", "hw", str(scenario), "--nic-map", "zero=mlx5_0"]
        + ["--out", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "--nic-map item 'zero=mlx5_0'" in lines[0], done.stderr
    assert not (tmp_path / "run").exists()
