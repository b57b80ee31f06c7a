"""The rendezvous under a flood, bounded per sender (issue 39, item 4).

Before, any holder of the run secret could send the rendezvous messages of up to 512 MiB,
on as many connections as it liked: two 256 MiB messages grew the launcher by 512 MiB.
Now (docs/hardware-mode.md, "Bounded per sender") a message is at most
MAX_RENDEZVOUS_BYTES (ZMQ cuts the connection off on a bigger frame's header), at most
RENDEZVOUS_RCVHWM of them wait per connection, a rank connects with the CURVE key of its
own credential a few times, tools (keys of no rank) share MAX_TOOL_CONNECTIONS
connections, and a rank's report comes in parts, held for it alone.

The rendezvous runs in a process of its own (`SERVER`), so that its resident memory is
its own; this process floods it (the issue's two 256 MiB messages, 64 connections of
fresh keys sending messages at the bound) while two honest ranks register and report,
one report of several parts. Asserted: the rendezvous's growth stays within
ROUTER_BOUND_MIB, only MAX_TOOL_CONNECTIONS of the 64 connections are admitted, and
the honest reports arrive whole.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import zmq
from test_flood import _rss_mib

from kvstage.hw.control.membership import RankInfo
from kvstage.hw.control.plane import (
    MAX_RENDEZVOUS_BYTES,
    RENDEZVOUS_RCVHWM,
    curve_client,
    new_secret,
)
from kvstage.hw.control.rendezvous import (
    MAX_TOOL_CONNECTIONS,
    REPORT_PART_CHARS,
    RendezvousClient,
)

pytestmark = pytest.mark.timeout(300)

MIB = 1 << 20
# docs/hardware-mode.md, "Bounded per sender": what the tools' connections may have
# queued (MAX_TOOL_CONNECTIONS x RENDEZVOUS_RCVHWM x MAX_RENDEZVOUS_BYTES = 64 MiB) and
# 32 MiB for the rest (a report being joined, the interpreter's own churn)
ROUTER_BOUND_MIB = 96
assert MAX_TOOL_CONNECTIONS * RENDEZVOUS_RCVHWM * MAX_RENDEZVOUS_BYTES <= 64 * MIB
FLOOD_CONNECTIONS = 64

# The rendezvous alone: its address and the ranks' credentials on the first line, then
# it serves until every rank reported, and prints what it saw as the last line.
SERVER = """
import json, sys, time
from kvstage.hw.control.rendezvous import MAX_TOOL_CONNECTIONS, RendezvousServer
server = RendezvousServer(
    ["prefill0", "decode0"], secret=bytes.fromhex(sys.argv[1]), tools=MAX_TOOL_CONNECTIONS
)
creds = {n: server.credential(n).hex() for n in ("prefill0", "decode0")}
print(json.dumps({"address": server.address, "credentials": creds}), flush=True)
while not server.all_reported:
    server.poll(0.05)
server.release()
for _ in range(20):
    server.poll(0.05)
print(json.dumps({
    "reports": {n: m for n, (_, m) in server.reports.items()},
    "refused_connections": server.gate.refused,
    "tools_admitted": server.gate.others_admitted,
    "refusals": server.refusals[-5:],
}), flush=True)
server.close()
"""


def _huge(address: str, secret: bytes, sent: dict) -> None:
    """The issue's attack: a message of 256 MiB on each of two connections, each sent
    until the rendezvous cut the connection off (on the frame's header)."""
    ctx = zmq.Context.instance()
    for _ in range(2):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, 60_000)
        curve_client(sock, secret)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(f"tcp://{address}")
        sock.send(b"x" * (256 * MIB))  # queued once the connection is up
        sent["huge"] += 1
        if monitor.poll(60_000):
            sent["cut_off"] += 1
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close()


def _flood(address: str, secret: bytes, sent: dict, on: threading.Event, stop: threading.Event):
    _huge(address, secret, sent)
    _many(address, secret, sent, on, stop)


def _many(
    address: str, secret: bytes, sent: dict, on: threading.Event, stop: threading.Event
) -> None:
    """64 connections, each with a key of its own, each sending messages at the bound,
    round after round (`on` set after the first) until `stop`."""
    ctx = zmq.Context.instance()
    socks = []
    body = b"y" * (MAX_RENDEZVOUS_BYTES - 1024)
    for _ in range(FLOOD_CONNECTIONS):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 8)
        curve_client(sock, secret)
        sock.connect(f"tcp://{address}")
        socks.append(sock)
    while not stop.is_set():
        for sock in socks:
            try:
                # one frame: refused unread (a multipart message from a socket closed with
                # linger 0 mid-send trips an assertion of libzmq 4.3.5 in the sender,
                # session_base.cpp:233: the attacker's own process, not the rendezvous)
                sock.send(body, zmq.NOBLOCK)
                sent["messages"] += 1
            except zmq.Again:
                pass
        on.set()
        time.sleep(0.02)
    for sock in socks:
        sock.close()


def _rank(address: str, secret: bytes, cred: bytes, role: str, report: dict, out: dict) -> None:
    client = RendezvousClient(address, secret=secret, credential=cred)
    try:
        me = RankInfo(role, 0, "tcp://127.0.0.1:1", f"agent-{role}", b"meta", key="ab" * 32)
        table, _ = client.hello(me, timeout_s=120)
        out[role] = sorted(table)
        client.report(report, timeout_s=120)
    finally:
        client.close()


def test_a_flood_of_the_rendezvous_is_bounded_per_sender():
    secret = new_secret()
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER, secret.hex()],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        first = json.loads(proc.stdout.readline())
        address, creds = first["address"], first["credentials"]
        before = _rss_mib(proc.pid)
        peak = [before]
        watching = threading.Event()
        watching.set()

        def watch() -> None:
            while watching.is_set():
                try:
                    peak[0] = max(peak[0], _rss_mib(proc.pid))
                except (OSError, RuntimeError):
                    return
                time.sleep(0.02)

        sent = {"huge": 0, "cut_off": 0, "messages": 0}
        on, stop = threading.Event(), threading.Event()
        flood = threading.Thread(target=_flood, args=(address, secret, sent, on, stop), daemon=True)
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        flood.start()
        assert on.wait(120)  # the huge messages cut off, the 64 connections sending
        # one report of several parts, one of one message
        big = {"role": "decode", "rank": 0, "records": [[i, "r" * 2000] for i in range(1500)]}
        assert len(json.dumps(big)) > 2 * REPORT_PART_CHARS
        small = {"role": "prefill", "rank": 0, "records": [[1, "p"]]}
        tables: dict = {}
        ranks = [
            threading.Thread(
                target=_rank,
                args=(address, secret, bytes.fromhex(creds[f"{r}0"]), r, rep, tables),
                daemon=True,
            )
            for r, rep in (("prefill", small), ("decode", big))
        ]
        for t in ranks:
            t.start()
        for t in ranks:
            t.join(240)
            assert not t.is_alive()
        stop.set()
        flood.join(60)
        last = json.loads(proc.stdout.readline())
        assert proc.wait(30) == 0
        watching.clear()
        watcher.join(5)
    finally:
        proc.kill()
        proc.wait()
    growth = peak[0] - before
    print(f"rendezvous flood: sent {sent}, RSS {before:.0f} -> peak {peak[0]:.0f} MiB")
    assert sent["cut_off"] == 2 and sent["messages"] >= MAX_TOOL_CONNECTIONS, sent
    assert growth <= ROUTER_BOUND_MIB, growth
    assert last["tools_admitted"] == MAX_TOOL_CONNECTIONS, last
    assert last["refused_connections"] >= FLOOD_CONNECTIONS + 2 - MAX_TOOL_CONNECTIONS, last
    assert tables == {"prefill": ["decode0", "prefill0"], "decode": ["decode0", "prefill0"]}
    got = {n: {k: v for k, v in m.items() if k != "kind"} for n, m in last["reports"].items()}
    assert got == {"decode0": big, "prefill0": small}
