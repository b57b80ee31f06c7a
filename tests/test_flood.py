"""Bounded before authenticated: a flood of a run's ranks and its rendezvous, on real
transfers with every byte verified (issue 25, item 5).

Once, one 256 x 1 MiB message took a decode rank from 308 to 572 MB, and 300 MiB to the
rendezvous took the launcher from 538 to 890 MB: the bytes were buffered before
anything looked at them. Now every listening socket is a CURVE server keyed by the run
secret (hw/control/plane.py `curve_server`): a process without the secret never completes
the handshake, so nothing it sends is buffered. A holder of the secret whose key is no
rank's of the table gets no connection to a rank either (ZAP: hw/control/zap.py), however
many it opens (issue 39: 64 connections grew a decode by 68 MiB); a rank of the table
is held to 4 KiB a frame (ZMQ `MAXMSGSIZE`, cut off on the frame's header), 8 frames a
message (dropped unread) and MAX_CONNECTIONS_PER_KEY connections. docs/hardware-mode.md states the bound asserted here: a
rank's and the launcher's resident memory grow by at most FLOOD_RSS_BOUND_MIB under
the flood.

Flooded, while the run is under way: a raw TCP client that speaks ZMTP's NULL
handshake to every rank's control port and the rendezvous port and then sends one
message without end (reconnecting whenever it is cut off), and a secret holder's sockets that send messages of too many frames
and frames over the bound. Asserted: the resident memory bound, every room done, 0
bytes wrong, no invariant violated, and the holder's connections refused at the ranks.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
import zmq
from conftest import require_engine
from test_control_auth import assert_every_room_right
from test_hw import write_scenario

from kvstage.hw.control.plane import (
    MAX_CONTROL_FRAMES,
    ZMQ_MAX_CONTROL_FRAME,
    curve_client,
    read_secret_file,
)
from kvstage.hw.launch.launcher import launch
from kvstage.shared.scenario import load_scenario

pytestmark = [pytest.mark.hw, pytest.mark.timeout(420)]

FLOOD_RSS_BOUND_MIB = 64  # docs/hardware-mode.md, "Bounded before authenticated"
FLOOD_S = 6.0
MIB = 1 << 20
# A stranger speaks ZMTP 3.0 by hand [C] rfc.zeromq.org/spec/23: a greeting with the
# NULL mechanism (signature, version 3.0, mechanism padded to 20 bytes, as-server 0,
# 31 bytes of filler), a READY command naming its socket type, then one message that
# never ends: 1 KiB frames (well under MAXMSGSIZE), each flagged MORE|LONG. ZMQ holds a
# message until its last frame has come, so a server that accepted the handshake would
# buffer all of it: on a plain PULL socket with MAXMSGSIZE 4 KiB, 300 MiB of it grew
# the process by 519 MiB (measured 2026-12-02 on this test's host).
GREETING = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + bytes(32)
FRAME = b"\x03" + (1024).to_bytes(8, "big") + b"y" * 1024


def _ready(socket_type: bytes) -> bytes:
    body = b"\x05READY" + b"\x0bSocket-Type" + len(socket_type).to_bytes(4, "big") + socket_type
    return b"\x04" + bytes([len(body)]) + body


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _pour(host: str, port: int, socket_type: bytes, until: float, sent: dict) -> None:
    """A stranger: TCP straight to the port, a handshake, then frames without end."""
    junk = FRAME * 1024  # 1 MiB and a bit
    while time.monotonic() < until:
        try:
            with socket.create_connection((host, port), timeout=1) as s:
                s.sendall(GREETING)
                time.sleep(0.05)
                s.sendall(_ready(socket_type))
                while time.monotonic() < until:
                    s.sendall(junk)
                    sent["stranger_bytes"] += len(junk)
        except OSError:
            sent["cut_off"] += 1  # the server closed the connection: try again
            time.sleep(0.01)


def _holder(address: str, secret: bytes, until: float, sent: dict) -> None:
    """A secret holder without a pair key: messages of too many frames, frames too big."""
    ctx = zmq.Context.instance()
    # frames well under ZMQ's bound (which counts CURVE's few dozen bytes of overhead)
    many = [b"x" * (ZMQ_MAX_CONTROL_FRAME // 4)] * (MAX_CONTROL_FRAMES + 1)
    while time.monotonic() < until:
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 100)
        curve_client(sock, secret)
        sock.connect(address)
        for _ in range(200):
            try:
                sock.send_multipart(many, zmq.NOBLOCK)
                sent["holder_messages"] += 1
            except zmq.Again:
                time.sleep(0.005)
        try:
            sock.send(b"x" * MIB, zmq.NOBLOCK)  # ZMQ cuts this connection off
        except zmq.Again:
            pass
        time.sleep(0.05)
        sock.close()


def _flood(run_dir, table: dict, address: str, procs: dict, sent: dict, rss: dict) -> None:
    secret = read_secret_file(run_dir / "run.secret")
    pids = {name: proc.pid for name, proc in procs.items()} | {"launcher": os.getpid()}
    rss["before"] = {name: _rss_mib(pid) for name, pid in pids.items()}
    until = time.monotonic() + FLOOD_S
    host, port = address.rsplit(":", 1)
    targets = [(host.removeprefix("tcp://"), int(port), b"DEALER")]
    for info in table.values():
        h, p = info.control.removeprefix("tcp://").rsplit(":", 1)
        targets.append((h, int(p), b"PUSH"))
    threads = [
        threading.Thread(target=_pour, args=(*target, until, sent), daemon=True)
        for target in targets
    ]
    threads += [
        threading.Thread(target=_holder, args=(info.control, secret, until, sent), daemon=True)
        for info in table.values()
    ]
    for t in threads:
        t.start()
    peak = dict(rss["before"])
    while any(t.is_alive() for t in threads):
        for name, pid in pids.items():
            try:
                peak[name] = max(peak[name], _rss_mib(pid))
            except (OSError, RuntimeError):
                pass  # the rank finished
        time.sleep(0.05)
    rss["peak"] = peak


@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
@pytest.mark.slow
def test_a_flood_is_refused_before_it_is_buffered(tmp_path, backend):
    require_engine(backend)
    s = load_scenario(
        # 160 rooms at 20 a second [C] tests/test_hw.py: arrivals last 8 s, past the flood
        write_scenario(tmp_path, 2, 1, 8, requests=160),
        overrides=[f"hardware.backend={backend}"],
    )
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "scenario.toml").write_text(s.to_toml())
    sent = {"stranger_bytes": 0, "cut_off": 0, "holder_messages": 0}
    rss: dict = {}
    done = threading.Event()
    seen: dict = {}  # the whole table, to learn the ports (launch's on_table: no rank gets it)

    def on_started(address, procs):
        def run() -> None:
            try:
                _flood(run_dir, seen["table"], address, procs, sent, rss)
            finally:
                done.set()

        threading.Thread(target=run, daemon=True).start()

    result = launch(
        run_dir / "scenario.toml",
        2,
        1,
        run_dir / "logs",
        backend=backend,
        device="cpu",
        timeout_s=300,
        on_started=on_started,
        on_table=lambda table, t0: seen.update(table=table),
    )
    assert done.wait(60)
    assert result.ok, result.errors
    growth = {name: rss["peak"][name] - rss["before"][name] for name in rss["before"]}
    print(f"flood: {sent}, RSS growth MiB {growth}")
    assert sent["cut_off"] > 100 and sent["holder_messages"] > 100, sent
    assert max(growth.values()) <= FLOOD_RSS_BOUND_MIB, growth
    reports = result.reports
    assert all(r["refused_connections"] > 0 for r in reports.values()), {
        n: r["refused_connections"] for n, r in reports.items()
    }
    assert sum(r["oversize"] for r in reports.values()) == 0  # it never got a connection
    assert all(r["unauthenticated"] == 0 and r["malformed"] == 0 for r in reports.values())
    assert_every_room_right(s, reports)
