"""`kvstage hw` refuses, before it writes a file or starts a rank, what would fail later:
a port in use, RDMA asked for on a host without it, pools that do not fit the host's
memory. Each is one line and exit 2, with no run directory or secret left behind. A
rank with no rendezvous to reach says that it waits, then gives up in one line."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
from test_hw import write_scenario
from test_outcome import kvstage_cmd

from kvstage.hw.control.credentials import Credentials, key_file, write_key_files
from kvstage.hw.control.plane import new_secret, write_secret_file
from kvstage.hw.rank.preflight import MIB, memory_problem, port_problem, rank_bytes
from kvstage.hw.transport.used import rdma_devices
from kvstage.shared.scenario import load_scenario


def _refused(tmp_path, *args: str) -> str:
    out = tmp_path / "run"
    proc = subprocess.run(
        [*kvstage_cmd(), "hw", *args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text
    assert "Traceback" not in text and not out.exists(), text
    (line,) = [ln for ln in text.splitlines() if ln.startswith("error:")]
    return line


def test_a_port_in_use_is_one_line_and_leaves_nothing(tmp_path):
    scenario = write_scenario(tmp_path, 1, 1, 8, requests=2)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert port_problem("127.0.0.1", port).startswith(f"--port {port}: the port is in use")
        line = _refused(tmp_path, str(scenario), "--port", str(port))
    assert (
        f"--port {port}: the port is in use on 127.0.0.1" in line and "allowed: a free port" in line
    )
    assert port_problem("127.0.0.1", 0) is None


@pytest.mark.skipif(
    bool(rdma_devices()), reason="this host has RDMA devices: asking for RDMA is fine here"
)
def test_asking_for_rdma_where_there_is_none_is_one_line(tmp_path):
    scenario = write_scenario(tmp_path, 1, 1, 8, requests=2)
    line = _refused(
        tmp_path, str(scenario), "--backend", "mooncake", "--set", "hardware.mooncake_protocol=rdma"
    )
    assert 'hardware.mooncake_protocol = "rdma" but this host has no RDMA device' in line


@pytest.mark.slow
def test_pools_that_do_not_fit_the_host_are_refused_before_a_rank_starts(tmp_path):
    scenario = write_scenario(tmp_path, 2, 1, 8, requests=2)
    s = load_scenario(scenario)
    # what the ranks allocate: the decode's ring is its staging pool, on top of its KV pool
    assert rank_bytes(s, "decode", 0) >= s.pool_bytes
    problem = memory_problem(
        s, [("prefill", 0), ("prefill", 1), ("decode", 0)], available=600 * MIB
    )
    assert (
        problem.startswith("3 ranks need")
        and "MiB of host memory" in problem
        and "allowed:" in problem
    )
    assert memory_problem(s, [("decode", 0)], available=1 << 40) is None
    line = _refused(
        tmp_path, str(scenario), "--no-scaled", "--set", "decode.staging_pool_mb=4000000"
    )
    assert (
        "ranks need" in line and "a smaller hardware.kv_pool_mb or decode.staging_pool_mb" in line
    )


@pytest.mark.slow
def test_a_rank_with_no_rendezvous_says_it_waits_then_gives_up_in_one_line(tmp_path):
    scenario = write_scenario(tmp_path, 1, 1, 8, requests=2)
    secret = tmp_path / "run.secret"
    write_secret_file(secret, new_secret())
    # the rank's own credential, as `kvstage hw --no-spawn` writes one per rank
    write_key_files(tmp_path, Credentials(), ["decode0"])
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvstage.hw.rank.main",
            str(scenario),
            "--role",
            "decode",
            "--rank",
            "0",
            "--rendezvous",
            f"127.0.0.1:{port}",
            "--secret-file",
            str(secret),
            "--key-file",
            str(key_file(tmp_path, "decode0")),
            "--rendezvous-timeout",
            "6",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr
    assert f"decode0: waiting for the rendezvous at tcp://127.0.0.1:{port} (5s of 6s" in err, err
    assert (
        f"decode0: error: no answer from the rendezvous at tcp://127.0.0.1:{port} within 6s" in err
    ), err
    assert "Traceback" not in err
