"""Placement of ranks: identity from SLURM/torchrun, addresses the engines are told, clocks.

No processes here except the clock test's rendezvous (in this process) and the skewed
hardware run at the end.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from kvstage.hw.control.plane import new_secret
from kvstage.hw.control.rendezvous import RendezvousClient, RendezvousServer
from kvstage.hw.transport.affinity import interface_of
from kvstage.hw.transport.placement import (
    Identity,
    PlacementError,
    engine_env,
    identity,
    rank_device,
    rendezvous_address,
    role_of,
    transport_options,
    visible_gpus,
)
from kvstage.shared.scenario import load_scenario


def test_global_rank_mapping():
    assert [role_of(g, 4, 2) for g in range(6)] == [
        ("prefill", 0),
        ("prefill", 1),
        ("prefill", 2),
        ("prefill", 3),
        ("decode", 0),
        ("decode", 1),
    ]
    with pytest.raises(PlacementError, match="outside 0..5"):
        role_of(6, 4, 2)


def test_identity_from_torchrun():
    env = {
        "RANK": "5",
        "WORLD_SIZE": "6",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "10.0.0.7",
        "MASTER_PORT": "29500",
    }
    assert identity(None, None, 4, 2, env) == Identity("decode", 1, 5, 1, "torchrun")
    assert rendezvous_address(None, env) == "10.0.0.7:29500"
    assert rendezvous_address("h:1", env) == "h:1"  # the flag wins
    assert rank_device("cuda", 1, {}) == "cuda:1"
    assert rank_device("cuda:3", 1, {}) == "cuda:3" and rank_device("cpu", 1, {}) == "cpu"


def test_rank_device_follows_cuda_visible_devices():
    # every GPU visible: the local rank's ordinal
    assert rank_device("cuda", 3, {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}) == "cuda:3"
    # SLURM --gpus-per-task=1: each task sees its own GPU only, as cuda:0
    assert rank_device("cuda", 3, {"CUDA_VISIBLE_DEVICES": "3"}) == "cuda:0"
    assert rank_device("cuda", 0, {"CUDA_VISIBLE_DEVICES": "GPU-5c1e"}) == "cuda:0"
    # an explicit ordinal is the user's word
    assert rank_device("cuda:1", 3, {"CUDA_VISIBLE_DEVICES": "3"}) == "cuda:1"
    with pytest.raises(PlacementError, match="local rank 5 but CUDA_VISIBLE_DEVICES lists 2 GPUs"):
        rank_device("cuda", 5, {"CUDA_VISIBLE_DEVICES": "4,5"})
    with pytest.raises(PlacementError, match="hides every GPU"):
        rank_device("cuda", 0, {"CUDA_VISIBLE_DEVICES": "-1"})
    assert visible_gpus({}) is None and visible_gpus({"CUDA_VISIBLE_DEVICES": "0,1,-1,2"}) == 2


def test_identity_from_slurm():
    env = {"SLURM_PROCID": "2", "SLURM_NTASKS": "6", "SLURM_LOCALID": "2"}
    assert identity(None, None, 2, 4, env) == Identity("decode", 0, 2, 2, "slurm")
    assert identity(None, None, 4, 2, env) == Identity("prefill", 2, 2, 2, "slurm")


def test_flags_win_and_keep_the_local_rank():
    env = {"RANK": "0", "WORLD_SIZE": "99", "LOCAL_RANK": "3"}
    assert identity("decode", 1, 4, 2, env) == Identity("decode", 1, None, 3, "flags")


@pytest.mark.parametrize(
    "env, message",
    [
        (
            {"RANK": "0", "WORLD_SIZE": "5"},
            r"\$WORLD_SIZE = 5 but the scenario has prefill TP4 \+ decode TP2 = 6",
        ),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "8"}, r"\$SLURM_NTASKS = 8 but"),
        ({"RANK": "x", "WORLD_SIZE": "6"}, r"\$RANK = 'x' is not an integer"),
        ({"RANK": "6", "WORLD_SIZE": "6"}, "global rank 6 outside 0..5"),
        ({}, "neither torchrun .* nor SLURM"),
        ({"RANK": "1"}, "neither torchrun"),
    ],
)
def test_bad_environments_one_clear_error(env, message):
    with pytest.raises(PlacementError, match=message):
        identity(None, None, 4, 2, env)


def test_half_flags_and_no_rendezvous():
    with pytest.raises(PlacementError, match="both --role and --rank"):
        identity("prefill", None, 4, 2, {})
    with pytest.raises(PlacementError, match="MASTER_ADDR"):
        rendezvous_address(None, {"MASTER_ADDR": "h"})


def test_engines_keep_to_the_rank_address():
    assert interface_of("127.0.0.1") == "lo"
    assert engine_env("127.0.0.1", "cpu", {}) == {
        "MC_TCP_BIND_ADDRESS": "127.0.0.1",
        "UCX_NET_DEVICES": "lo",
    }
    assert engine_env("127.0.0.1", "cuda:0", {}) == {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}
    # an address this host does not have: no device guessed (and never lo)
    assert engine_env("192.0.2.1", "cpu", {}) == {"MC_TCP_BIND_ADDRESS": "192.0.2.1"}
    # what the user set stays
    assert engine_env("127.0.0.1", "cpu", {"UCX_NET_DEVICES": "eth0"}) == {
        "MC_TCP_BIND_ADDRESS": "127.0.0.1"
    }


def test_an_rdma_host_never_gets_its_ip_interface_as_the_ucx_device():
    """UCX names RDMA devices mlx5_N:1: UCX_NET_DEVICES=eth0 would rule them out silently."""
    import fcntl
    import socket
    import struct

    def address_of(name: str) -> str | None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                raw = fcntl.ioctl(
                    s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15])
                )  # SIOCGIFADDR
            except OSError:
                return None
        return socket.inet_ntoa(raw[20:24])

    found = [
        (a, n)
        for _, n in socket.if_nameindex()
        if (a := address_of(n)) and not a.startswith("127.")
    ]
    if not found:
        pytest.skip("no network interface here holds a routable IPv4 address")
    routable, iface = found[0]
    assert interface_of(routable) == iface
    assert engine_env(routable, "cpu", {}, rdma=[]) == {
        "MC_TCP_BIND_ADDRESS": routable,
        "UCX_NET_DEVICES": iface,
    }
    assert engine_env(routable, "cuda:0", {}, rdma=["mlx5_0", "mlx5_1"]) == {
        "MC_TCP_BIND_ADDRESS": routable
    }


def test_mooncake_protocol_and_devices_from_the_scenario(tmp_path):
    from test_hw import write_scenario

    f = write_scenario(tmp_path, 2, 1, 8)
    s = load_scenario(f)
    assert transport_options(s.hardware, "mooncake", "10.1.2.3") == {
        "protocol": "tcp",
        "device_name": "",
        "host": "10.1.2.3",
    }
    s = load_scenario(
        f, overrides=["hardware.mooncake_protocol=rdma", "hardware.mooncake_device=mlx5_0,mlx5_1"]
    )
    assert transport_options(s.hardware, "mooncake", "h") == {
        "protocol": "rdma",
        "device_name": "mlx5_0,mlx5_1",
        "host": "h",
    }
    assert transport_options(s.hardware, "nixl", "h") == {}
    with pytest.raises(Exception, match="mooncake_protocol"):
        load_scenario(f, overrides=["hardware.mooncake_protocol=ib"])


def test_clock_offset_measured_at_the_rendezvous():
    secret = new_secret()
    server = RendezvousServer(["prefill0"], secret=secret, advertise="127.0.0.1", tools=1)
    stop = threading.Event()
    thread = threading.Thread(
        target=lambda: [server.poll(0.01) for _ in iter(stop.is_set, True)], daemon=True
    )
    thread.start()
    try:
        client = RendezvousClient(server.address, secret=secret)
        measured = client.clock_offset(
            samples=8, clock=lambda: time.time() - 7.25
        )  # this "rank" runs 7.25 s late
        client.close()
    finally:
        stop.set()
        thread.join(5)
        server.close()
    assert measured.samples == 8 and measured.rtt_s < 0.5
    assert abs(measured.offset_s - 7.25) <= measured.uncertainty_s + 1e-3


@pytest.mark.hw
@pytest.mark.timeout(300)
def test_skewed_rank_clock_is_corrected_trace_stays_causal(tmp_path):
    """decode0's clock runs 5 s behind; the offset it measures at the rendezvous puts its
    trace back on the launcher's clock: every decode `req` follows the prefill `req` it
    answers, and the summary names the offsets."""
    from conftest import require_engine
    from rich.console import Console
    from test_hw import write_scenario

    from kvstage.run.hwrun import run_hardware
    from kvstage.run.rundir import read_summary
    from kvstage.run.tracefile import read_records

    require_engine("nixl")
    s = load_scenario(write_scenario(tmp_path, 2, 1, 8), overrides=["hardware.backend=nixl"])
    helper = Path(__file__).parent / "helpers" / "skewed_rank.py"
    code, run_dir = run_hardware(
        s,
        out=tmp_path / "run",
        timeout_s=120,
        console=Console(width=120),
        rank_wrapper=[sys.executable, str(helper), "decode0=-5.0"],
    )
    summary = read_summary(run_dir)
    assert code == 0, summary.get("errors")
    clocks = summary["clocks"]
    assert abs(clocks["decode0"]["clock_offset_s"] - 5.0) < 0.05, clocks
    assert abs(clocks["prefill0"]["clock_offset_s"]) < 0.05, clocks
    _, records = read_records(run_dir)
    assert_causal(records, clocks)


def clock_error_s(clocks: dict, name: str) -> float:
    """How far rank `name`'s trace clock may be from the launcher's, by its own
    measurement (summary.json "clocks"): the true offset lies within the measured one
    +- its uncertainty, so an applied offset leaves at most the uncertainty, and one
    left unapplied (within its uncertainty) at most |offset| + uncertainty."""
    c = clocks.get(name, {})
    u = c.get("clock_uncertainty_s", 0.0)
    return u if c.get("clock_applied_s") else abs(c.get("clock_offset_s", 0.0)) + u


def assert_causal(records, clocks: dict) -> int:
    """Every decode `req` row at or after the first prefill `req` of the same chunk and
    writer pair, to within the two ranks' clock errors as the run measured them (on two
    hosts, or two namespaces, a trace time is only as good as its clock offset's
    measurement); the number of pairs checked."""
    sent: dict[tuple, float] = {}
    for r in records:
        if r.role == "prefill" and r.phase == "req":
            key = (r.room, r.chunk, r.rank, r.peer)
            sent[key] = min(sent.get(key, r.start), r.start)
    checked = 0
    for r in records:
        if r.role == "decode" and r.phase == "req":
            key = (r.room, r.chunk, r.peer, r.rank)
            assert key in sent, f"decode req without its prefill req: {r}"
            slack = clock_error_s(clocks, f"decode{r.rank}") + clock_error_s(
                clocks, f"prefill{r.peer}"
            )
            assert r.start >= sent[key] - slack, (
                f"decode req at {r.start:.6f} before its prefill req at {sent[key]:.6f}, "
                f"beyond the clocks' measured error of {slack * 1e6:.0f} us: {r}"
            )
            checked += 1
    assert checked > 0
    return checked


def test_launcher_addresses():
    from kvstage.hw.transport.placement import launch_addresses

    assert launch_addresses(None, None, None, {}) == ("127.0.0.1", "127.0.0.1", "127.0.0.1")
    assert launch_addresses(None, "10.77.0.1", None, {}) == ("10.77.0.1", "10.77.0.1", "10.77.0.1")
    assert launch_addresses(None, "0.0.0.0", "10.0.0.5", {}) == ("0.0.0.0", "10.0.0.5", "10.0.0.5")
    assert launch_addresses("10.0.0.9", None, None, {"KVSTAGE_HOST": "x"}) == ("10.0.0.9",) * 3
