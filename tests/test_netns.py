"""Ranks on two "nodes": two network namespaces joined by a veth pair, nothing shared but it.

Namespace A (10.77.0.1/24) runs the rendezvous (`kvstage hw --no-spawn --bind 10.77.0.1`)
and the prefill ranks, which take their identity from torchrun's variables (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and pick their address from the route
to MASTER_ADDR. Namespace B (10.77.0.2/24) runs the decode ranks, started by flags, with
their clocks set 3 s behind: the offset they measure at the rendezvous must put their
trace back in order. Real bytes move with NIXL (UCX forced onto TCP, so they cross the
veth) and with Mooncake over TCP; every byte is verified, and the veth's counters show
that they crossed. Only the two veth addresses are ever used. The namespaces are
deleted whatever happens.

Needs root and `ip`: skipped otherwise, except in CI (CI=true), where it must run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import IN_CI, require_engine
from test_hw import write_scenario
from test_placement import assert_causal

from kvstage.hw.transport.bandwidth import probe_pairs
from kvstage.run.rundir import read_summary
from kvstage.run.tracefile import read_records
from kvstage.shared.cluster import hardware_sessions
from kvstage.shared.layout import room_pages
from kvstage.shared.scenario import load_scenario
from kvstage.shared.workload import generate_requests

pytestmark = [pytest.mark.hw, pytest.mark.timeout(300), pytest.mark.xdist_group("netns")]

ADDR_A, ADDR_B = "10.77.0.1", "10.77.0.2"
PORT = 29555
SKEW_S = -3.0  # the decode ranks' clocks read 3 s less than the launcher's
BIN = Path(sys.executable).parent
HELPER = Path(__file__).parent / "helpers" / "skewed_rank.py"


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root (to create network namespaces)"
    if shutil.which("ip") is None:
        return "needs the `ip` command (iproute2)"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


@pytest.fixture
def namespaces():
    why = _why_not()
    if why:
        if IN_CI:
            pytest.fail(f"the two-namespace test must run in CI: {why}")
        pytest.skip(why)
    tag = f"{os.getpid() % 100000}"
    a, b = f"kvsA{tag}", f"kvsB{tag}"
    va, vb = f"kva{tag}", f"kvb{tag}"
    try:
        _ip("netns", "add", a)
        _ip("netns", "add", b)
        _ip("link", "add", va, "type", "veth", "peer", "name", vb)
        _ip("link", "set", va, "netns", a)
        _ip("link", "set", vb, "netns", b)
        for ns, dev, addr in ((a, va, ADDR_A), (b, vb, ADDR_B)):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield a, b, va
    finally:
        for ns in (a, b):  # deleting a namespace deletes its end of the veth, and the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
        subprocess.run(["ip", "link", "del", va], capture_output=True, timeout=20)


def _veth_tx(ns: str, dev: str) -> int:
    out = subprocess.run(
        ["ip", "netns", "exec", ns, "cat", f"/sys/class/net/{dev}/statistics/tx_bytes"],
        check=True,
        capture_output=True,
        text=True,
        timeout=20,
    ).stdout
    return int(out)


def _rank_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("KVSTAGE_", "UCX_", "MC_TCP_", "MASTER_", "SLURM_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    }
    env["UCX_TLS"] = "tcp"  # no shared memory between the "nodes": UCX goes over the veth
    return env


def _wait_for(path: Path, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, f"the launcher exited ({proc.returncode}) before writing {path}"
        assert time.monotonic() < deadline, f"no {path} after {timeout_s}s"
        time.sleep(0.05)


@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
@pytest.mark.parametrize("P, D", [(4, 2), (2, 4)])
@pytest.mark.slow
def test_ranks_in_two_namespaces_move_every_byte(tmp_path, namespaces, backend, P, D):
    require_engine(backend)
    ns_a, ns_b, veth_a = namespaces
    scenario = write_scenario(tmp_path, P, D, 8)
    run_dir = tmp_path / "run"
    env = _rank_env()
    t = time.monotonic()
    launcher = subprocess.Popen(
        [
            "ip",
            "netns",
            "exec",
            ns_a,
            str(BIN / "kvstage"),
            "hw",
            str(scenario),
            "--backend",
            backend,
            "--no-spawn",
            "--bind",
            ADDR_A,
            "--port",
            str(PORT),
            "--out",
            str(run_dir),
            "--timeout",
            "90",
            "--trace-format",
            "jsonl",
            "--target",
            "0.5",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    ranks: list[subprocess.Popen] = []
    try:
        _wait_for(run_dir / "run.secret", launcher, 30)
        common = [str(run_dir / "scenario.toml"), "--secret-file", str(run_dir / "run.secret")]
        tx_before = _veth_tx(ns_a, veth_a)
        logs = tmp_path / "ranklogs"
        logs.mkdir()
        for g in range(P):  # prefill: identity, rendezvous and address from torchrun's variables
            torchrun = {
                "RANK": str(g),
                "WORLD_SIZE": str(P + D),
                "LOCAL_RANK": str(g),
                "MASTER_ADDR": ADDR_A,
                "MASTER_PORT": str(PORT),
            }
            with (logs / f"prefill{g}.log").open("w") as fh:
                ranks.append(
                    subprocess.Popen(
                        ["ip", "netns", "exec", ns_a, str(BIN / "kvstage"), "hw-rank", *common],
                        env={**env, **torchrun},
                        stdout=fh,
                        stderr=subprocess.STDOUT,
                    )
                )
        for d in range(D):  # decode: by flags, in the other namespace, clock skewed
            cmd = [
                "ip",
                "netns",
                "exec",
                ns_b,
                sys.executable,
                str(HELPER),
                ",".join(f"decode{i}={SKEW_S}" for i in range(D)),
                sys.executable,
                "-m",
                "kvstage.hw.rank.main",
                *common,
                "--role",
                "decode",
                "--rank",
                str(d),
                "--rendezvous",
                f"{ADDR_A}:{PORT}",
                "--host",
                ADDR_B,
            ]
            with (logs / f"decode{d}.log").open("w") as fh:
                ranks.append(subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT))
        out, _ = launcher.communicate(timeout=120)
        wall = time.monotonic() - t
        tx = _veth_tx(ns_a, veth_a) - tx_before
        rank_logs = "\n".join(
            f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(logs.iterdir())
        )
        # the run's own outcome is good (every byte, below); the exit code follows the verdict
        verdict_passed = "bandwidth: PASS" in " ".join(out.split())
        assert launcher.returncode == (0 if verdict_passed else 1), f"{out[-3000:]}\n{rank_logs}"
        for p in ranks:
            assert p.wait(timeout=30) == 0, rank_logs
    finally:
        for p in [launcher, *ranks]:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    summary = read_summary(run_dir)
    s = load_scenario(run_dir / "scenario.toml")
    g = s.geometry()
    expected = sum(
        g.decode_tp
        * room_pages(r.prompt_tokens, r.prefix_tokens, g.page_size)
        * g.page_size
        * 2
        * g.layers
        * g.decode_heads
        * g.head_dim
        * g.dtype_bytes
        for r in generate_requests(s)
    )
    assert summary["bytes_verified"] == expected and summary["bytes_wrong"] == 0
    assert (
        summary["requests_done"] == 3
        and summary["requests_failed"] == 0
        and summary["errors"] == []
    )
    clocks = summary["clocks"]
    assert {clocks[f"prefill{p}"]["host"] for p in range(P)} == {ADDR_A}
    assert {clocks[f"decode{d}"]["host"] for d in range(D)} == {ADDR_B}
    for d in range(D):
        assert abs(clocks[f"decode{d}"]["clock_offset_s"] + SKEW_S) < 0.05, clocks
    _, records = read_records(run_dir)
    pairs = assert_causal(records, clocks)
    # the KV bytes left namespace A through its veth (plus control traffic)
    assert tx >= expected, f"only {tx} bytes left {veth_a}, {expected} verified"
    # and each rank says so: its engine wrote over TCP (UCX on the veth; Mooncake's tcp)
    used = summary["transport_used"]
    for p in range(P):
        u = used[f"prefill{p}"]
        assert u["over"] == "tcp", u
        if backend == "nixl":
            assert any(t.startswith("tcp/") for ts in u["writes"].values() for t in ts), u
    # the ranks are not the launcher's children, yet their CPU is the run's own, not "others"
    assert summary["conditions"]["cpu_ranks_here_s"] > 0, summary["conditions"]
    # each rank's NIC: the veth end that holds its address (no GPU, no RDMA here), printed
    # as a table at the start of the run and kept in summary.json
    veth_b = veth_a.replace("kva", "kvb", 1)
    aff = summary["affinity"]
    for name, a in aff.items():
        nic = veth_a if name.startswith("prefill") else veth_b
        assert (a["nic"], a["kind"], a["gpu"], a["ucx_device"]) == (nic, "ip", "no GPU", nic), a
        assert a["shares_switch"] is None and a["how"] == "holds the rank's address", a
    table = out[out.index("rank       host") :]
    for name, a in aff.items():
        row = next(ln for ln in table.splitlines() if ln.startswith(name + " "))
        assert a["host"] in row and "no GPU" in row and a["nic"] in row and "unknown" in row, row
    assert out.index("rank       host") < out.index("pair "), out[-3000:]
    # per pair, GB/s against the ceiling measured in this run across the veth, and the verdict
    pairs = summary["bandwidth"]["pairs"]
    sessions, _ = hardware_sessions(s, generate_requests(s))
    assert [(p["prefill"], p["decode"]) for p in pairs] == [
        (f"prefill{a}", f"decode{b}") for a, b in probe_pairs(sessions)
    ]
    for p in pairs:
        assert p["ceiling_gbs"] > 0 and 0 < p["achieved_gbs"], p
    # the chunks of this small scenario are a few KiB: latency-bound, far below the ceiling
    # of one large write (seen here: 1-2%), so the verdict fails, and says by how much
    assert verdict_passed is all(p["ratio"] >= 0.5 for p in pairs), out[-2000:]
    assert ("bandwidth: PASS" if verdict_passed else "bandwidth: FAIL") in " ".join(out.split())
    assert any(f"{p['prefill']} -> {p['decode']}" in out for p in pairs)
    print(
        f"\n{backend} P{P}->D{D} across namespaces: {expected} bytes verified, {tx} bytes on the veth, "
        f"wall {wall:.1f}s, decode clock offsets "
        f"{[round(clocks[f'decode{d}']['clock_offset_s'], 6) for d in range(D)]} "
        f"(+-{max(c['clock_uncertainty_s'] for c in clocks.values()) * 1e6:.0f} us), {pairs} req pairs causal"
    )
