"""The ZMQ control plane of one rank, and the rendezvous that introduces ranks.

Protocol messages travel as the `shared.protocol` codec's multipart frames over
PUSH/PULL sockets: each rank binds one PULL socket and keeps one PUSH per peer.
A frame list that does not decode is logged and dropped; it never reaches the
state machine and never raises out of `receive`.

The rendezvous is a ROUTER socket (run by the launcher, or alone for ranks placed
by srun/mpirun): every rank sends a JSON hello with its control address and its
transfer metadata; when all ranks are there each gets the whole table and a common
start time. At the end every rank sends its report and waits for the go to exit,
so no process disappears while a peer might still write to it.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from kvstage.shared.protocol import Message, ProtocolError, decode, encode
from kvstage.shared.runtime import rank_name

log = logging.getLogger("kvstage.hw.control")


class ControlPlane:
    """This rank's inbox (PULL, bound on an ephemeral port) and outboxes (PUSH)."""

    def __init__(self, host: str = "127.0.0.1", ctx: zmq.Context | None = None) -> None:
        self.ctx = ctx or zmq.Context.instance()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.LINGER, 0)
        port = self.inbox.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._out: dict[str, zmq.Socket] = {}
        self.poller = zmq.Poller()
        self.poller.register(self.inbox, zmq.POLLIN)
        self.malformed = 0
        self.sent = 0
        self.received = 0

    def connect(self, peer: str, address: str) -> None:
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(address)
        self._out[peer] = sock

    def send(self, peer: str, msg: Message) -> None:
        sock = self._out.get(peer)
        if sock is None:
            raise KeyError(f"no control connection to {peer} (known: {sorted(self._out)})")
        sock.send_multipart(encode(msg), copy=False)
        self.sent += 1

    def receive(self, timeout_s: float) -> list[Message]:
        """Every message waiting (after at most `timeout_s` of waiting for the first)."""
        out: list[Message] = []
        # round up: a sub-millisecond wait truncated to 0 would spin and starve the
        # other ranks sharing this machine's cores
        if not self.poller.poll(max(0, math.ceil(timeout_s * 1000))):
            return out
        while True:
            try:
                frames = self.inbox.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            try:
                out.append(decode(frames))
                self.received += 1
            except ProtocolError as exc:
                self.malformed += 1
                log.warning("dropped a malformed control message: %s", exc)

    def close(self) -> None:
        for sock in self._out.values():
            sock.close(linger=500)
        self.inbox.close(linger=0)


# --- rendezvous ---------------------------------------------------------------------


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text.encode())


@dataclass
class RankInfo:
    role: str
    rank: int
    control: str  # tcp://host:port of the rank's PULL socket
    agent: str  # transfer engine agent / session name
    metadata: bytes  # transfer metadata (registered regions)
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. KV pool / ring descriptors

    @property
    def name(self) -> str:
        return rank_name(self.role, self.rank)

    def to_json(self) -> dict[str, Any]:
        return {"role": self.role, "rank": self.rank, "control": self.control, "agent": self.agent,
                "metadata": _b64(self.metadata), "extra": self.extra}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RankInfo:
        return cls(d["role"], int(d["rank"]), d["control"], d["agent"], _unb64(d["metadata"]), d.get("extra", {}))


class RendezvousError(RuntimeError):
    pass


class RendezvousClient:
    """A rank's side of the rendezvous (a DEALER socket)."""

    def __init__(self, address: str, ctx: zmq.Context | None = None) -> None:
        self.ctx = ctx or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 2000)
        if not address.startswith("tcp://"):
            address = f"tcp://{address}"
        self.sock.connect(address)
        self.address = address

    def _recv(self, timeout_s: float, what: str) -> dict[str, Any]:
        if not self.sock.poll(int(timeout_s * 1000)):
            raise RendezvousError(f"no answer from the rendezvous at {self.address} within {timeout_s:.0f}s while waiting for {what}")
        return json.loads(self.sock.recv())

    def hello(self, me: RankInfo, timeout_s: float) -> tuple[dict[str, RankInfo], float]:
        """Register; returns every rank's info by name, and the run's start time (epoch s)."""
        self.sock.send(json.dumps({"kind": "hello", **me.to_json()}).encode())
        reply = self._recv(timeout_s, "all ranks to register")
        if reply.get("kind") == "abort":
            raise RendezvousError(f"rendezvous aborted the run: {reply.get('reason')}")
        table = {RankInfo.from_json(d).name: RankInfo.from_json(d) for d in reply["ranks"]}
        return table, float(reply["t0"])

    def report(self, report: dict[str, Any], timeout_s: float) -> None:
        """Send this rank's report and wait until the launcher says every rank is finished."""
        self.sock.send(json.dumps({"kind": "report", **report}).encode())
        self._recv(timeout_s, "the other ranks to finish")

    def close(self) -> None:
        self.sock.close(linger=1000)


class RendezvousServer:
    """The launcher's side: collects hellos and reports of `expected` ranks."""

    def __init__(self, expected: list[str], host: str = "127.0.0.1", port: int = 0,
                 ctx: zmq.Context | None = None) -> None:
        self.ctx = ctx or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 1000)
        if port:
            self.sock.bind(f"tcp://{host}:{port}")
        else:
            port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"{host}:{port}"
        self.expected = set(expected)
        self.hellos: dict[str, tuple[bytes, RankInfo]] = {}
        self.reports: dict[str, tuple[bytes, dict[str, Any]]] = {}
        self.started = False

    def poll(self, timeout_s: float, start_delay_s: float = 0.5) -> None:
        """Handle what arrived; once all hellos are in, answer them with the table."""
        if not self.sock.poll(int(timeout_s * 1000)):
            return
        while True:
            try:
                ident, payload = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            except ValueError:
                continue
            try:
                msg = json.loads(payload)
                kind = msg.get("kind")
                name = rank_name(msg["role"], int(msg["rank"]))
            except Exception as exc:  # a stray peer must not take the launcher down
                log.warning("rendezvous: dropped a malformed message: %s", exc)
                continue
            if name not in self.expected:
                self.sock.send_multipart([ident, json.dumps({"kind": "abort", "reason": f"{name} is not part of this run"}).encode()])
                continue
            if kind == "hello":
                self.hellos[name] = (ident, RankInfo.from_json(msg))
            elif kind == "report":
                self.reports[name] = (ident, msg)
        if not self.started and set(self.hellos) == self.expected:
            self.started = True
            t0 = time.time() + start_delay_s
            table = [info.to_json() for _, info in self.hellos.values()]
            for ident, _ in self.hellos.values():
                self.sock.send_multipart([ident, json.dumps({"kind": "table", "ranks": table, "t0": t0}).encode()])

    @property
    def all_reported(self) -> bool:
        return set(self.reports) == self.expected

    def release(self) -> None:
        """Tell every reported rank that it may exit."""
        for ident, _ in self.reports.values():
            self.sock.send_multipart([ident, json.dumps({"kind": "bye"}).encode()])

    def abort(self, reason: str) -> None:
        for ident, _ in list(self.hellos.values()):
            try:
                self.sock.send_multipart([ident, json.dumps({"kind": "abort", "reason": reason}).encode()], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def close(self) -> None:
        self.sock.close(linger=500)
