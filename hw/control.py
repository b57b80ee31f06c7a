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

Every frame list, control or rendezvous, is authenticated with the run's secret
(32 random bytes the launcher draws per run): an HMAC-SHA256 over the frame count
and every frame with its length goes as one extra, last frame; the key is bound to
its channel and direction, so a frame signed for one cannot pass as another. A
frame list that is too big is dropped before anything looks into it; one whose MAC
is missing or wrong is dropped before it is decoded. Both are counted
(`ControlPlane.oversize`, `.unauthenticated`, in the rank's report) and logged.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import logging
import math
import os
import re
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from kvstage.shared.protocol import Message, ProtocolError, decode, encode
from kvstage.shared.runtime import rank_name

log = logging.getLogger("kvstage.hw.control")

SECRET_ENV = "KVSTAGE_RUN_SECRET"  # the run secret, hex, for ranks the launcher spawns
SECRET_BYTES = 32
MIN_SECRET_BYTES = 16
# The largest legitimate control message is a few dozen bytes (a reason string is cut
# at MAX_REASON_BYTES): anything over 64 KiB is dropped and counted, unread. ZMQ itself
# cuts off a peer that sends a single frame over 1 MiB (not counted: never delivered).
MAX_CONTROL_BYTES = 64 << 10
MAX_CONTROL_FRAMES = 8
ZMQ_MAX_CONTROL_FRAME = 1 << 20
# A report carries the rank's whole trace; a hello its transfer metadata.
MAX_RENDEZVOUS_BYTES = 512 << 20

_CONTROL = b"kvstage control v2"  # v2: frames carry sender, incarnation and sequence
# senders whose last (incarnation, sequence) a control plane remembers (replay state);
# only authenticated frames create entries, so this bounds a secret holder's flood
MAX_SENDERS = 4096
_TO_LAUNCHER = b"kvstage rendezvous rank->launcher v1"
_TO_RANK = b"kvstage rendezvous launcher->rank v1"


class RunSecretError(RuntimeError):
    """No usable run secret: a rank never runs unauthenticated."""


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def parse_secret(text: str, where: str) -> bytes:
    try:
        secret = bytes.fromhex(text.strip())
    except ValueError:
        raise RunSecretError(f"{where}: not a run secret (expected {2 * SECRET_BYTES} hex digits)") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise RunSecretError(f"{where}: a run secret of {len(secret)} bytes is too short "
                             f"(at least {MIN_SECRET_BYTES}; kvstage hw draws {SECRET_BYTES})")
    return secret


def run_secret(secret: bytes | None = None) -> bytes:
    """`secret` if given, else the one in $KVSTAGE_RUN_SECRET; RunSecretError if neither."""
    if secret is not None:
        if len(secret) < MIN_SECRET_BYTES:
            raise RunSecretError(f"a run secret of {len(secret)} bytes is too short (at least {MIN_SECRET_BYTES})")
        return bytes(secret)
    text = os.environ.get(SECRET_ENV, "")
    if not text.strip():
        raise RunSecretError(
            f"no run secret: give --secret-file RUN_DIR/run.secret (written by `kvstage hw`) or set "
            f"{SECRET_ENV} (hex); control and rendezvous messages are authenticated with it")
    return parse_secret(text, f"${SECRET_ENV}")


def read_secret_file(path: str | Path) -> bytes:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise RunSecretError(f"cannot read the run secret file {path}: {exc.strerror or exc}") from None
    return parse_secret(text, str(path))


def write_secret_file(path: Path, secret: bytes) -> None:
    """Write `secret` (hex) to `path`, readable by its owner only (0600)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # an existing file keeps its mode otherwise
        os.write(fd, (secret.hex() + "\n").encode())
    finally:
        os.close(fd)


class _Mac:
    """HMAC-SHA256 of a frame list under one key and channel label."""

    def __init__(self, secret: bytes, label: bytes) -> None:
        self._base = hmac.new(secret, label, hashlib.sha256)

    def of(self, frames: Sequence[bytes]) -> bytes:
        h = self._base.copy()
        h.update(len(frames).to_bytes(4, "big"))
        for f in frames:
            h.update(len(f).to_bytes(8, "big"))
            h.update(f)
        return h.digest()

    def sign(self, frames: Sequence[bytes]) -> list[bytes]:
        return [*frames, self.of(frames)]

    def verify(self, frames: Sequence[bytes]) -> list[bytes] | None:
        """The frames without their MAC, or None when it is missing or wrong."""
        if len(frames) < 2:
            return None
        body = list(frames[:-1])
        return body if hmac.compare_digest(self.of(body), frames[-1]) else None


class _Throttled:
    """Logs the first few of a kind of drop, then every 1000th (a flood stays readable)."""

    def __init__(self, logger: logging.Logger, first: int = 5) -> None:
        self.log = logger
        self.first = first
        self.seen: dict[str, int] = {}

    def warn(self, kind: str, fmt: str, *args: Any) -> None:
        n = self.seen[kind] = self.seen.get(kind, 0) + 1
        if n <= self.first or n % 1000 == 0:
            self.log.warning(f"{fmt} ({kind} #{n})", *args)


_by_hand = iter(range(1, 1 << 62))


def signed(frames: Sequence[bytes], secret: bytes, *, sender: bytes = b"by-hand",
           incarnation: int | None = None, seq: int | None = None) -> list[bytes]:
    """`frames` as `ControlPlane.send` sends them, header and MAC included (for tools and
    tests that build frames by hand). By default each call is a fresh frame: the next
    sequence number of an incarnation that starts now."""
    inc = time.time_ns() if incarnation is None else incarnation
    header = _header(inc, next(_by_hand) if seq is None else seq)
    return _Mac(run_secret(secret), _CONTROL).sign([sender, header, *frames])


def _header(incarnation: int, seq: int) -> bytes:
    return incarnation.to_bytes(8, "big") + seq.to_bytes(8, "big")


def _size(frames: Sequence[bytes]) -> int:
    return sum(len(f) for f in frames)


class ControlPlane:
    """This rank's inbox (PULL, bound on an ephemeral port) and outboxes (PUSH).

    `secret`: the run secret (default: $KVSTAGE_RUN_SECRET; RunSecretError without one).

    Replay protection: every frame carries its sender's name, the sender's incarnation
    (the wall clock in ns when its control plane started) and a sequence number, under
    the MAC. A receiver keeps the last (incarnation, sequence) of each sender and drops,
    as replayed, a frame that is not newer: a captured frame sent again, or a late frame
    of a sender's earlier incarnation after the restarted process has spoken (PUSH/PULL
    over TCP keeps one sender's frames in order, so honest frames are always newer)."""

    def __init__(self, host: str = "127.0.0.1", ctx: zmq.Context | None = None, *,
                 secret: bytes | None = None, name: str | None = None) -> None:
        self._mac = _Mac(run_secret(secret), _CONTROL)
        self._incarnation = time.time_ns()
        self._seq = 0
        self._last: dict[bytes, tuple[int, int]] = {}  # sender -> its newest (incarnation, seq)
        self.ctx = ctx or zmq.Context.instance()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.LINGER, 0)
        self.inbox.setsockopt(zmq.MAXMSGSIZE, ZMQ_MAX_CONTROL_FRAME)
        port = self.inbox.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._name = (name or self.address).encode()
        self.replayed = 0
        self._out: dict[str, zmq.Socket] = {}
        self.poller = zmq.Poller()
        self.poller.register(self.inbox, zmq.POLLIN)
        self.malformed = 0
        self.unauthenticated = 0
        self.oversize = 0
        self.sent = 0
        self.received = 0
        self._warn = _Throttled(log)

    def connect(self, peer: str, address: str) -> None:
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(address)
        self._out[peer] = sock

    def send(self, peer: str, msg: Message) -> None:
        sock = self._out.get(peer)
        if sock is None:
            raise KeyError(f"no control connection to {peer} (known: {sorted(self._out)})")
        self._seq += 1
        sock.send_multipart(self._mac.sign([self._name, _header(self._incarnation, self._seq), *encode(msg)]),
                            copy=False)
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
            if len(frames) > MAX_CONTROL_FRAMES or _size(frames) > MAX_CONTROL_BYTES:
                self.oversize += 1
                self._warn.warn("oversize", "dropped a control message of %d frames, %d bytes (at most %d, %d)",
                                len(frames), _size(frames), MAX_CONTROL_FRAMES, MAX_CONTROL_BYTES)
                continue
            body = self._mac.verify(frames)
            if body is None:
                self.unauthenticated += 1
                self._warn.warn("unauthenticated", "dropped a control message whose MAC is missing or wrong")
                continue
            if not self._fresh(body):
                continue
            try:
                out.append(decode(body[2:]))
                self.received += 1
            except ProtocolError as exc:
                self.malformed += 1
                log.warning("dropped a malformed control message: %s", exc)

    def _fresh(self, body: list) -> bool:
        """An authenticated frame newer than its sender's last one (False: dropped)."""
        if len(body) < 3 or len(body[1]) != 16:
            self.malformed += 1
            self._warn.warn("malformed", "dropped a control message without its sender header")
            return False
        sender = bytes(body[0])
        stamp = (int.from_bytes(body[1][:8], "big"), int.from_bytes(body[1][8:], "big"))
        last = self._last.get(sender)
        if last is not None and stamp <= last:
            self.replayed += 1
            self._warn.warn("replayed", "dropped a control message not newer than its sender's last "
                            "(replayed, or from an earlier incarnation of a restarted rank)")
            return False
        if last is None and len(self._last) >= MAX_SENDERS:
            self._last.pop(next(iter(self._last)))
        self._last[sender] = stamp
        return True

    def counters(self) -> dict[str, int]:
        """Messages dropped, by why (the rank's report carries them)."""
        return {"malformed": self.malformed, "unauthenticated": self.unauthenticated, "oversize": self.oversize,
                "replayed": self.replayed}

    def close(self) -> None:
        for sock in self._out.values():
            sock.close(linger=500)
        self.inbox.close(linger=0)


# --- rendezvous ---------------------------------------------------------------------


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text.encode(), validate=True)


_CONTROL_ADDRESS = re.compile(r"tcp://[^\s/]+:\d{1,5}")


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

    @classmethod
    def from_hello(cls, d: dict[str, Any]) -> RankInfo:
        """A hello's RankInfo, every field checked; ValueError naming the first bad one."""
        for key, kind in (("role", str), ("rank", int), ("control", str), ("agent", str), ("metadata", str)):
            if key not in d:
                raise ValueError(f"no {key!r}")
            if not isinstance(d[key], kind) or isinstance(d[key], bool):
                raise ValueError(f"{key!r} is {type(d[key]).__name__}, not {kind.__name__}")
        if d["role"] not in ("prefill", "decode") or d["rank"] < 0:
            raise ValueError(f"no such rank: role {d['role']!r}, rank {d['rank']}")
        if not _CONTROL_ADDRESS.fullmatch(d["control"]):
            raise ValueError(f"'control' {d['control'][:80]!r} is not tcp://HOST:PORT")
        if not isinstance(d.get("extra", {}), dict):
            raise ValueError("'extra' is not an object")
        try:
            return cls.from_json(d)
        except binascii.Error as exc:
            raise ValueError(f"'metadata' is not base64: {exc}") from None


class RendezvousError(RuntimeError):
    pass


@dataclass(frozen=True)
class ClockOffset:
    """A rank's clock against the launcher's: launcher time = rank time + offset_s,
    within +- uncertainty_s (half the round trip of the best sample)."""

    offset_s: float
    rtt_s: float
    samples: int

    @property
    def uncertainty_s(self) -> float:
        return self.rtt_s / 2

    def to_wire(self) -> dict[str, float]:
        return {"clock_offset_s": self.offset_s, "clock_uncertainty_s": self.uncertainty_s,
                "clock_rtt_s": self.rtt_s, "clock_samples": self.samples}


class RendezvousClient:
    """A rank's side of the rendezvous (a DEALER socket).

    `secret`: the run secret (default: $KVSTAGE_RUN_SECRET). `watch`, if given, is
    called at least twice a second while waiting for an answer (a rank's check that
    its launcher is alive)."""

    def __init__(self, address: str, ctx: zmq.Context | None = None, *, secret: bytes | None = None,
                 watch: Callable[[], None] | None = None) -> None:
        secret = run_secret(secret)
        self._up = _Mac(secret, _TO_LAUNCHER)
        self._down = _Mac(secret, _TO_RANK)
        self.watch = watch
        self.ctx = ctx or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 2000)
        if not address.startswith("tcp://"):
            address = f"tcp://{address}"
        self.sock.connect(address)
        self.address = address

    def send(self, msg: dict[str, Any]) -> None:
        """One authenticated JSON message to the rendezvous."""
        self.sock.send_multipart(self._up.sign([json.dumps(msg).encode()]))

    def recv(self, timeout_s: float, what: str) -> dict[str, Any]:
        """The rendezvous' next answer; RendezvousError when none comes, when it cannot be
        authenticated (this rank's secret is not the run's) or when it refuses."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.watch is not None:
                self.watch()
            left = deadline - time.monotonic()
            if left <= 0:
                raise RendezvousError(f"no answer from the rendezvous at {self.address} within {timeout_s:.0f}s "
                                      f"while waiting for {what}")
            if self.sock.poll(min(500, math.ceil(left * 1000))):
                break
        frames = self.sock.recv_multipart()
        body = self._down.verify(frames) if _size(frames) <= MAX_RENDEZVOUS_BYTES else None
        if body is None or len(body) != 1:
            raise RendezvousError(f"the rendezvous at {self.address} answered with a message this rank cannot "
                                  f"authenticate: this rank's run secret is not the launcher's (check "
                                  f"--secret-file / ${SECRET_ENV})")
        msg = json.loads(body[0])
        if msg.get("kind") == "refused":
            raise RendezvousError(f"the rendezvous at {self.address} refused this rank: {msg.get('reason')}")
        return msg

    def clock_offset(self, samples: int = 8, timeout_s: float = 10.0,
                     clock: Callable[[], float] = time.time) -> ClockOffset:
        """This rank's offset to the launcher's clock (launcher time = `clock()` + offset):
        `samples` round trips, the one with the smallest round-trip time; its half RTT
        bounds the error."""
        best: ClockOffset | None = None
        for _ in range(samples):
            t1 = clock()
            self.send({"kind": "clock", "t1": t1})
            reply = self.recv(timeout_s, "a clock answer")
            t3 = clock()
            if reply.get("kind") != "clock" or reply.get("t1") != t1:
                raise RendezvousError(f"the rendezvous at {self.address} answered a clock probe with {reply.get('kind')!r}")
            rtt = t3 - t1
            if best is None or rtt < best.rtt_s:
                best = ClockOffset(float(reply["t2"]) - (t1 + t3) / 2, rtt, samples)
        assert best is not None
        return best

    def hello(self, me: RankInfo, timeout_s: float) -> tuple[dict[str, RankInfo], float]:
        """Register; returns every rank's info by name, and the run's start time (epoch s)."""
        self.send({"kind": "hello", **me.to_json()})
        reply = self.recv(timeout_s, "all ranks to register")
        if reply.get("kind") == "abort":
            raise RendezvousError(f"rendezvous aborted the run: {reply.get('reason')}")
        table = {RankInfo.from_json(d).name: RankInfo.from_json(d) for d in reply["ranks"]}
        return table, float(reply["t0"])

    def report(self, report: dict[str, Any], timeout_s: float, serve: Callable[[], None] | None = None) -> None:
        """Send this rank's report and wait until the launcher says every rank is finished.
        `serve` is called meanwhile, again and again (it should block for a few ms at
        most): a rank that finished still answers its peers, whose re-sent messages may
        wait for an acknowledgement only it can give."""
        self.send({"kind": "report", **report})
        if serve is not None:
            deadline = time.monotonic() + timeout_s
            while not self.sock.poll(0):
                if self.watch is not None:
                    self.watch()
                if time.monotonic() > deadline:
                    break  # recv below says so
                serve()
        self.recv(max(1.0, timeout_s if serve is None else 1.0), "the other ranks to finish")

    def query(self, timeout_s: float) -> tuple[dict[str, RankInfo], float | None]:
        """The ranks registered so far and the start time (None before every rank is in):
        for tools that hold the run secret, e.g. to find a rank's control address."""
        self.send({"kind": "query"})
        reply = self.recv(timeout_s, "the rank table")
        return {RankInfo.from_json(d).name: RankInfo.from_json(d) for d in reply["ranks"]}, reply.get("t0")

    def close(self) -> None:
        self.sock.close(linger=1000)


class RendezvousServer:
    """The launcher's side: collects hellos and reports of `expected` ranks.

    It refuses, logs and answers "refused" to (and never dies of): a message too big,
    unauthenticated or not JSON, a hello with a missing or bad field, for a rank not in
    this run or for one already registered, and a report from anything but a registered
    rank's own connection. `refusals` keeps the reasons (the last 100)."""

    def __init__(self, expected: list[str], host: str = "127.0.0.1", port: int = 0,
                 ctx: zmq.Context | None = None, *, secret: bytes | None = None,
                 advertise: str | None = None) -> None:
        secret = run_secret(secret)
        self._up = _Mac(secret, _TO_LAUNCHER)
        self._down = _Mac(secret, _TO_RANK)
        self.ctx = ctx or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 1000)
        if port:
            self.sock.bind(f"tcp://{host}:{port}")
        else:
            port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"{advertise or host}:{port}"  # what ranks connect to
        self.expected = set(expected)
        self.hellos: dict[str, tuple[bytes, RankInfo]] = {}
        self.reports: dict[str, tuple[bytes, dict[str, Any]]] = {}
        self.gone: set[str] = set()  # ranks that died during the run (the launcher says so)
        self.registered: dict[bytes, str] = {}  # connection identity -> the rank it registered
        self.refusals: list[str] = []
        self.started = False
        self.t0: float | None = None
        self._warn = _Throttled(log, first=20)

    def _send(self, ident: bytes, msg: dict[str, Any]) -> None:
        try:
            self.sock.send_multipart([ident, *self._down.sign([json.dumps(msg).encode()])], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the peer is gone: nothing to tell

    def _refuse(self, ident: bytes, reason: str) -> None:
        self.refusals = [*self.refusals[-99:], reason]
        self._warn.warn("refused", "rendezvous: refused a message from connection %s: %s", ident.hex(), reason)
        self._send(ident, {"kind": "refused", "reason": reason})

    def poll(self, timeout_s: float, start_delay_s: float = 0.5) -> None:
        """Handle what arrived; once all hellos are in, answer them with the table."""
        if not self.sock.poll(int(timeout_s * 1000)):
            return
        while True:
            try:
                parts = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                self._handle(parts[0], parts[1:])
            except Exception as exc:  # a stray peer must not take the launcher down
                self._refuse(parts[0], f"could not handle the message: {type(exc).__name__}: {exc}")
        if not self.started and set(self.hellos) == self.expected:
            self.started = True
            self.t0 = time.time() + start_delay_s
            table = [info.to_json() for _, info in self.hellos.values()]
            for ident, _ in self.hellos.values():
                self._send(ident, {"kind": "table", "ranks": table, "t0": self.t0})

    def _handle(self, ident: bytes, frames: list[bytes]) -> None:
        if _size(frames) > MAX_RENDEZVOUS_BYTES:
            return self._refuse(ident, f"message of {_size(frames)} bytes (at most {MAX_RENDEZVOUS_BYTES})")
        body = self._up.verify(frames)
        if body is None or len(body) != 1:
            return self._refuse(ident, "unauthenticated message (no MAC, or not this run's secret)")
        try:
            msg = json.loads(body[0])
        except ValueError as exc:
            return self._refuse(ident, f"malformed message: {exc}")
        kind = msg.get("kind") if isinstance(msg, dict) else None
        if kind == "hello":
            return self._hello(ident, msg)
        if kind == "report":
            return self._report(ident, msg)
        if kind == "clock":  # a rank measuring its offset to this clock (any authenticated peer)
            return self._send(ident, {"kind": "clock", "t1": msg.get("t1"), "t2": time.time()})
        if kind == "query":
            table = [info.to_json() for _, info in self.hellos.values()]
            return self._send(ident, {"kind": "table", "ranks": table, "t0": self.t0})
        return self._refuse(ident, f"unknown message kind {str(kind)[:40]!r} (allowed: hello, report, query, clock)")

    def _hello(self, ident: bytes, msg: dict[str, Any]) -> None:
        try:
            info = RankInfo.from_hello(msg)
        except ValueError as exc:
            return self._refuse(ident, f"bad hello: {exc}")
        name = info.name
        if name not in self.expected:
            return self._refuse(ident, f"{name} is not part of this run (expected: {', '.join(sorted(self.expected))})")
        if name in self.hellos:
            return self._refuse(ident, f"{name} is already registered")
        if ident in self.registered:
            return self._refuse(ident, f"this connection already registered {self.registered[ident]}")
        self.hellos[name] = (ident, info)
        self.registered[ident] = name

    def _report(self, ident: bytes, msg: dict[str, Any]) -> None:
        name = self.registered.get(ident)
        if name is None:
            return self._refuse(ident, "report from a connection that registered no rank")
        try:
            claimed = rank_name(msg["role"], int(msg["rank"]))
        except (KeyError, TypeError, ValueError):
            claimed = None
        if claimed != name:
            return self._refuse(ident, f"report for {claimed} from the connection of {name}")
        if name in self.reports:
            return self._refuse(ident, f"{name} has already reported")
        self.reports[name] = (ident, msg)

    @property
    def all_reported(self) -> bool:
        """Every rank reported, or died during the run (`gone`, noted by the launcher)."""
        return set(self.reports) | self.gone == self.expected

    def release(self) -> None:
        """Tell every reported rank that it may exit."""
        for ident, _ in self.reports.values():
            self._send(ident, {"kind": "bye"})

    def abort(self, reason: str) -> None:
        for ident, _ in list(self.hellos.values()):
            self._send(ident, {"kind": "abort", "reason": reason})

    def close(self) -> None:
        self.sock.close(linger=500)
