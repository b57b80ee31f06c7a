"""The rendezvous that introduces the ranks of a hardware-mode run, and keeps track of them.

The rendezvous is a ROUTER socket (run by the launcher, or alone for ranks placed
by srun/mpirun): every rank sends a JSON hello with its control address and its
transfer metadata; when all ranks are there each gets the whole table and a common
start time. At the end every rank sends its report and waits for the go to exit,
so no process disappears while a peer might still write to it. Every message is
authenticated with the run's secret (hw/control/plane.py): a rank's messages carry its
name, incarnation and a sequence number and are signed with that rank's own key
(hw/control/keys.py `rank_key`), so a hello, report or beat can only be signed for the rank it
speaks for, and a message sent again (replayed) is refused. A rank's hello also
carries its control plane's public key (`RankInfo.key`), from which its peers derive
the keys of their frames to and from it (hw/control/keys.py).

During the run each rank says it is alive every RANK_BEAT_S: the launcher's failure
detector for ranks it did not start (`kvstage hw --no-spawn`). A prefill rank that
died may register again under a newer incarnation and rejoin the run
(`RendezvousServer`: its decode peers are told, and say from which room the new
incarnation serves them).
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import os
import re
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvstage.hw.control.keys import MAX_NAME_BYTES, PUBLIC_KEY_BYTES, Identity, rank_key
from kvstage.hw.control.plane import (
    MAX_RENDEZVOUS_BYTES,
    SECRET_ENV,
    TO_LAUNCHER,
    TO_RANK,
    FrameMac,
    Throttled,
    curve_client,
    curve_server,
    frame_header,
    frames_size,
    log,
    run_secret,
)
from kvstage.hw.transport.bandwidth import PROBE_SLOT_S
from kvstage.shared.runtime import rank_name

# connections the rendezvous closes before their CURVE handshake, none completed, before
# a rank concludes that its run secret is not the launcher's (ZMQ reconnects every
# 0.1 s [C] libzmq ZMQ_RECONNECT_IVL default, so about 0.3 s)
REFUSED_HANDSHAKES = 3


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text.encode(), validate=True)


# a rank waiting for an answer says so after this long, then again every so often
WAIT_NOTE_S = 5.0
WAIT_NOTE_EVERY_S = 15.0

_CONTROL_ADDRESS = re.compile(r"tcp://[^\s/]+:\d{1,5}")
_PUBLIC_KEY = re.compile(f"[0-9a-f]{{{2 * PUBLIC_KEY_BYTES}}}")


@dataclass
class RankInfo:
    role: str
    rank: int
    control: str  # tcp://host:port of the rank's PULL socket
    agent: str  # transfer engine agent / session name
    metadata: bytes  # transfer metadata (registered regions)
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. KV pool / ring descriptors
    incarnation: int = 0  # its control plane's incarnation (ControlPlane.incarnation)
    key: str = ""  # its control plane's X25519 public key, hex (ControlPlane.identity)

    @property
    def name(self) -> str:
        return rank_name(self.role, self.rank)

    @property
    def identity(self) -> Identity:
        """What a peer connects its control plane to (hw/control/keys.py)."""
        return Identity(self.name, self.incarnation, bytes.fromhex(self.key))

    def to_json(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "rank": self.rank,
            "control": self.control,
            "agent": self.agent,
            "metadata": _b64(self.metadata),
            "extra": self.extra,
            "incarnation": self.incarnation,
            "key": self.key,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RankInfo:
        return cls(
            d["role"],
            int(d["rank"]),
            d["control"],
            d["agent"],
            _unb64(d["metadata"]),
            d.get("extra", {}),
            int(d.get("incarnation", 0)),
            str(d.get("key", "")),
        )

    @classmethod
    def from_hello(cls, d: dict[str, Any]) -> RankInfo:
        """A hello's RankInfo, every field checked; ValueError naming the first bad one."""
        for key, kind in (
            ("role", str),
            ("rank", int),
            ("control", str),
            ("agent", str),
            ("metadata", str),
        ):
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
        inc = d.get("incarnation", 0)
        if not isinstance(inc, int) or isinstance(inc, bool) or not 0 <= inc < 1 << 63:
            raise ValueError(f"'incarnation' {str(inc)[:40]!r} is not an int in [0, 2**63)")
        key = d.get("key")
        if not isinstance(key, str) or not _PUBLIC_KEY.fullmatch(key):
            raise ValueError(
                f"'key' {str(key)[:80]!r} is not a public key ({2 * PUBLIC_KEY_BYTES} hex digits)"
            )
        try:
            return cls.from_json(d)
        except binascii.Error as exc:
            raise ValueError(f"'metadata' is not base64: {exc}") from None


class RendezvousError(RuntimeError):
    pass


class RendezvousRetry(RendezvousError):
    """Refused for now: asked again later, it may be granted (a live rank's name)."""


# how often a hello refused for now is sent again (RendezvousClient.hello)
RETRY_S = 0.5
# rank names whose last (incarnation, sequence) the rendezvous keeps (replay state): only
# authenticated messages make entries, so this bounds what a flood of names can take
MAX_SPEAKERS = 4096


# What the rendezvous tells a registered rank unasked (RendezvousClient.notices).
NOTICES = frozenset({"rejoin"})
# A registered rank says it is alive this often; one silent for RANK_SILENT_S is down
# (the launcher's failure detector: longer than the peers' 3 s, so its peers' own
# detectors fail its rooms first, with their reason).
RANK_BEAT_S = 0.5
RANK_SILENT_S = 5.0
# How long a rejoin waits for the decode ranks' answers before it goes on without them.
REJOIN_ACK_S = 10.0
# The longest a rank may announce it will be quiet (alive quiet_s: building its report).
MAX_QUIET_S = 600.0


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
        return {
            "clock_offset_s": self.offset_s,
            "clock_uncertainty_s": self.uncertainty_s,
            "clock_rtt_s": self.rtt_s,
            "clock_samples": self.samples,
        }


class RendezvousClient:
    """A rank's side of the rendezvous (a DEALER socket).

    `secret`: the run secret (default: $KVSTAGE_RUN_SECRET). `watch`, if given, is
    called at least twice a second while waiting for an answer (a rank's check that
    its launcher is alive).

    Besides the answers to its own requests, the rendezvous may tell a registered
    rank something at any time (a notice: a peer rejoined, `NOTICES`); those are kept
    in `notices` until the rank takes them (`poll_notices`), never mistaken for an
    answer. A registered rank says it is alive every RANK_BEAT_S (`alive`).

    Every message goes signed for one name and incarnation (`name`, `incarnation`; by
    default a tool's own, drawn here): `hello` takes the registering rank's, so the
    rendezvous can check that a rank speaks only for itself."""

    def __init__(
        self,
        address: str,
        ctx: zmq.Context | None = None,
        *,
        secret: bytes | None = None,
        watch: Callable[[], None] | None = None,
        name: str | None = None,
        incarnation: int | None = None,
    ) -> None:
        secret = self._secret = run_secret(secret)
        self._down = FrameMac(secret, TO_RANK)
        self.speak_as(
            name or f"tool-{os.getpid()}-{secrets.token_hex(4)}",
            time.time_ns() if incarnation is None else incarnation,
        )
        self._seq = 0
        self.watch = watch
        self.ctx = ctx or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_RENDEZVOUS_BYTES)
        curve_client(self.sock, secret)
        if not address.startswith("tcp://"):
            address = f"tcp://{address}"
        # connection events: a rendezvous that closes every connection before the CURVE
        # handshake completes does not hold this rank's run secret
        self._monitor = self.sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
        )
        self._handshakes = self._refused_handshakes = 0
        self.sock.connect(address)
        self.address = address
        self.notices: list[dict[str, Any]] = []
        self._replies: deque[dict[str, Any]] = deque()
        self.rejoin: dict[str, Any] | None = None  # set by hello() when this rank rejoined a run
        self.probe: dict[str, float] | None = None  # set by hello(): the bandwidth probe's slots
        # told, while an answer is long in coming, that this rank still waits (a rank's log)
        self.on_wait: Callable[[str], None] | None = None

    def speak_as(self, name: str, incarnation: int) -> None:
        """Sign every message from now on for rank `name`'s `incarnation`."""
        self.name, self.incarnation = name, incarnation
        self._up = FrameMac(rank_key(self._secret, TO_LAUNCHER, name, incarnation), b"")

    def send(self, msg: dict[str, Any], block: bool = True) -> None:
        """One authenticated JSON message to the rendezvous. `block=False`: dropped if
        it cannot go at once (a rendezvous that is gone must not stall a rank's loop)."""
        self._seq += 1
        frames = [self.name.encode(), frame_header(self.incarnation, self._seq)]
        try:
            self.sock.send_multipart(
                self._up.sign([*frames, json.dumps(msg).encode()]), 0 if block else zmq.NOBLOCK
            )
        except zmq.Again:
            pass

    def _check_handshakes(self) -> None:
        """RendezvousError once the rendezvous closed connections before their handshake
        and never completed one: this rank's secret is not the run's."""
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._handshakes += 1
            elif event == zmq.EVENT_DISCONNECTED and not self._handshakes:
                self._refused_handshakes += 1
        if not self._handshakes and self._refused_handshakes >= REFUSED_HANDSHAKES:
            raise RendezvousError(
                f"the rendezvous at {self.address} refused this rank's connection "
                f"{self._refused_handshakes} times before its handshake: this rank cannot "
                f"authenticate: this rank's run secret is not the launcher's (check "
                f"--secret-file / ${SECRET_ENV})"
            )

    def _pump(self, timeout_ms: int) -> None:
        """Take in what the rendezvous sent (waiting up to `timeout_ms` for the first):
        notices aside, answers in order."""
        self._check_handshakes()
        if not self.sock.poll(timeout_ms):
            return
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            body = (
                self._down.verify(frames) if frames_size(frames) <= MAX_RENDEZVOUS_BYTES else None
            )
            if body is None or len(body) != 1:
                raise RendezvousError(
                    f"the rendezvous at {self.address} answered with a message this rank cannot "
                    f"authenticate: this rank's run secret is not the launcher's (check "
                    f"--secret-file / ${SECRET_ENV})"
                )
            msg = json.loads(body[0])
            if not isinstance(msg, dict):
                raise RendezvousError(
                    f"the rendezvous at {self.address} sent {type(msg).__name__}, not an object"
                )
            if msg.get("kind") in NOTICES:
                self.notices.append(msg)
            else:
                self._replies.append(msg)

    def recv(self, timeout_s: float, what: str) -> dict[str, Any]:
        """The rendezvous' next answer; RendezvousError when none comes, when it cannot be
        authenticated (this rank's secret is not the run's) or when it refuses."""
        start = time.monotonic()
        deadline, say_at = start + timeout_s, start + WAIT_NOTE_S
        while not self._replies:
            if self.watch is not None:
                self.watch()
            now = time.monotonic()
            left = deadline - now
            if left <= 0:
                raise RendezvousError(
                    f"no answer from the rendezvous at {self.address} within {timeout_s:.0f}s "
                    f"while waiting for {what}: is its launcher (kvstage hw) running "
                    f"there, and the address right?"
                )
            if self.on_wait is not None and now >= say_at:
                self.on_wait(
                    f"waiting for the rendezvous at {self.address} ({now - start:.0f}s of "
                    f"{timeout_s:.0f}s, for {what})"
                )
                say_at += WAIT_NOTE_EVERY_S
            self._pump(min(500, math.ceil(left * 1000)))
        msg = self._replies.popleft()
        if msg.get("kind") == "refused":
            kind = RendezvousRetry if msg.get("retry") else RendezvousError
            raise kind(f"the rendezvous at {self.address} refused this rank: {msg.get('reason')}")
        return msg

    def poll_notices(self) -> list[dict[str, Any]]:
        """The notices that came in so far (taken: each is returned once). Never waits."""
        self._pump(0)
        out, self.notices = self.notices, []
        return out

    def alive(self, quiet_s: float = 0.0, rooms: tuple[int, int] | None = None) -> None:
        """Tell the rendezvous this rank is still there (no answer comes); `quiet_s`: it
        may say nothing more for that long (busy building its report); `rooms`: (ended,
        of) the rooms of this rank's workload, for the launcher's progress display."""
        msg: dict[str, Any] = {"kind": "alive"}
        if quiet_s:
            msg["quiet_s"] = quiet_s
        if rooms is not None:
            msg["rooms"] = list(rooms)
        self.send(msg, block=False)

    def ack_rejoin(self, rank: str, incarnation: int, first_room: int | None) -> None:
        """Answer a rejoin notice: this rank serves `rank`'s new incarnation the rooms
        from `first_room` on (None: not a peer of it)."""
        self.send(
            {
                "kind": "rejoin_ack",
                "rank": rank,
                "incarnation": incarnation,
                "first_room": first_room,
            },
            block=False,
        )

    def clock_offset(
        self, samples: int = 8, timeout_s: float = 10.0, clock: Callable[[], float] = time.time
    ) -> ClockOffset:
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
                raise RendezvousError(
                    f"the rendezvous at {self.address} answered a clock probe with {reply.get('kind')!r}"
                )
            rtt = t3 - t1
            if best is None or rtt < best.rtt_s:
                best = ClockOffset(float(reply["t2"]) - (t1 + t3) / 2, rtt, samples)
        assert best is not None
        return best

    def hello(self, me: RankInfo, timeout_s: float) -> tuple[dict[str, RankInfo], float]:
        """Register; returns every rank's info by name, and the run's start time (epoch s).
        A rank that registers again under a newer incarnation while the run goes on
        rejoins it: `rejoin` then holds what the rendezvous decided (first_room: the
        first room this incarnation serves, None: none). A rank registered and still
        live under this name is not replaced: the hello is sent again every RETRY_S
        until the rendezvous saw that one go down (or `timeout_s` passed)."""
        self.speak_as(me.name, me.incarnation)
        deadline = time.monotonic() + timeout_s
        while True:
            self.send({"kind": "hello", **me.to_json()})
            try:
                reply = self.recv(max(1.0, deadline - time.monotonic()), "all ranks to register")
                break
            except RendezvousRetry:
                if time.monotonic() + RETRY_S > deadline:
                    raise
                time.sleep(RETRY_S)
        if reply.get("kind") == "abort":
            raise RendezvousError(f"rendezvous aborted the run: {reply.get('reason')}")
        table = {RankInfo.from_json(d).name: RankInfo.from_json(d) for d in reply["ranks"]}
        self.rejoin = reply.get("rejoin")
        probe = reply.get("probe")  # the bandwidth probe's slots, when the launcher asked for one
        ok = (
            isinstance(probe, dict)
            and all(isinstance(probe.get(k), (int, float)) for k in ("start", "slot_s"))
            and 0 < probe["slot_s"] <= 10
        )
        self.probe = (
            {"start": float(probe["start"]), "slot_s": float(probe["slot_s"])} if ok else None
        )
        return table, float(reply["t0"])

    def report(
        self, report: dict[str, Any], timeout_s: float, serve: Callable[[], None] | None = None
    ) -> None:
        """Send this rank's report and wait until the launcher says every rank is finished.
        `serve` is called meanwhile, again and again (it should block for a few ms at
        most): a rank that finished still answers its peers, whose re-sent messages may
        wait for an acknowledgement only it can give."""
        self.send({"kind": "report", **report})
        if serve is None:
            self.recv(max(1.0, timeout_s), "the other ranks to finish")
            return
        deadline = time.monotonic() + timeout_s
        while not self._replies:
            if self.watch is not None:
                self.watch()
            if time.monotonic() > deadline:
                break  # recv below says so
            serve()
            self._pump(0)
        self.recv(1.0, "the other ranks to finish")

    def query(self, timeout_s: float) -> tuple[dict[str, RankInfo], float | None]:
        """The ranks registered so far and the start time (None before every rank is in):
        for tools that hold the run secret, e.g. to find a rank's control address."""
        self.send({"kind": "query"})
        reply = self.recv(timeout_s, "the rank table")
        return {
            RankInfo.from_json(d).name: RankInfo.from_json(d) for d in reply["ranks"]
        }, reply.get("t0")

    def rejoins(self, timeout_s: float) -> list[dict[str, Any]]:
        """The rejoins the rendezvous completed so far (rank, incarnation, first_room, after)."""
        self.send({"kind": "query"})
        return list(self.recv(timeout_s, "the rank table").get("rejoins", []))

    def close(self) -> None:
        self.sock.disable_monitor()
        self._monitor.close(linger=0)
        self.sock.close(linger=1000)


@dataclass
class _Down:
    """A registered rank that died or went silent during the run, until it rejoins or
    its grace ends (then it is gone)."""

    why: str
    since: float  # time.monotonic()
    deadline: float


@dataclass
class _Rejoin:
    """A restarted rank's re-registration: its decode peers are asked which room the
    new incarnation serves from; it gets its table once all answered (or the wait ends)."""

    ident: bytes
    info: RankInfo
    asked: set[str]
    deadline: float
    after: str  # what happened to the incarnation it replaces
    answers: dict[str, int | None] = field(default_factory=dict)


class RendezvousServer:
    """The launcher's side: collects hellos and reports of `expected` ranks.

    It refuses, logs and answers "refused" to (and never dies of): a message too big,
    unauthenticated or not JSON, a hello with a missing or bad field, for a rank not in
    this run or for one already registered, and a report from anything but a registered
    rank's own connection. `refusals` keeps the reasons (the last 100).

    Liveness (`silent_s`, None: not watched): once the run started, a registered rank
    that has not finished and sent nothing for `silent_s` (ranks say `alive` every
    RANK_BEAT_S) is *down*, as is one the launcher saw die (`mark_down`). A down rank
    is *gone* (`gone`: name -> why; the run fails naming it) once its grace is over:
    `grace_s[name]`, else `rejoin_grace_s` for a prefill rank and 0 for a decode rank.

    Rejoin: a prefill rank of this run that registers again while the run goes on,
    under a newer incarnation (RankInfo.incarnation), down and not yet gone or
    finished, replaces the one registered. A live one is never replaced: the new
    incarnation is refused for now ("retry"; RendezvousClient.hello asks again) until
    the launcher saw the old one die or go silent. Its old connection is unregistered (a report or a beat from it is
    refused), every live decode rank gets the new RankInfo (notice "rejoin") and
    answers with the first room it has not seen arrive; the new incarnation gets the
    table with `rejoin: {incarnation, first_room}`, first_room the smallest answer (None
    when no decode rank answered: it serves nothing). Everything else stays refused: a
    decode rank registering again, an incarnation not newer than the registered one,
    a rank already gone or finished. `rejoins` lists the completed rejoins."""

    def __init__(
        self,
        expected: list[str],
        host: str = "127.0.0.1",
        port: int = 0,
        ctx: zmq.Context | None = None,
        *,
        secret: bytes | None = None,
        advertise: str | None = None,
        silent_s: float | None = None,
        rejoin_grace_s: float = 0.0,
        grace_s: dict[str, float] | None = None,
        probe_slots: int = 0,
    ) -> None:
        secret = self._secret = run_secret(secret)
        self._down = FrameMac(secret, TO_RANK)
        # (name, incarnation) -> the key its messages are signed with; name -> the newest
        # (incarnation, sequence) it sent (replay state)
        self._keys: dict[tuple[str, int], FrameMac] = {}
        self._last: dict[str, tuple[int, int]] = {}
        self.ctx = ctx or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_RENDEZVOUS_BYTES)
        curve_server(self.sock, secret)  # a stranger gets no connection: nothing buffered
        if port:
            self.sock.bind(f"tcp://{host}:{port}")
        else:
            port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"{advertise or host}:{port}"  # what ranks connect to
        self.expected = set(expected)
        self.hellos: dict[str, tuple[bytes, RankInfo]] = {}
        self.reports: dict[str, tuple[bytes, dict[str, Any]]] = {}
        self.gone: dict[str, str] = {}  # ranks that died during the run for good -> why
        self.down: dict[str, _Down] = {}  # ranks dead or silent, within their grace
        self.registered: dict[bytes, str] = {}  # connection identity -> the rank it registered
        self.refusals: list[str] = []
        self.started = False
        self.t0: float | None = None
        self.silent_s = silent_s
        self.rejoin_grace_s = rejoin_grace_s
        self.grace_s: dict[str, float] = dict(
            grace_s or {}
        )  # per rank, instead of the default grace
        self.last_heard: dict[str, float] = {}  # rank -> time.monotonic() of its last message
        self._quiet_until: dict[str, float] = {}  # rank -> silent until then, as it announced
        self.rejoins: list[dict[str, Any]] = []
        self._rejoining: dict[str, _Rejoin] = {}
        self.events: list[
            str
        ] = []  # what happened to ranks (down, gone, rejoined), for the launcher to print
        self.rooms: dict[
            str, tuple[int, int]
        ] = {}  # rank -> (rooms ended, rooms of its workload), as it said
        self._warn = Throttled(log, first=20)
        # the bandwidth probe (hw/transport/bandwidth.py): this many slots of `probe_slot_s` before
        # t0, one per (prefill, decode) pair; 0: no probe
        self.probe_slots = probe_slots
        self.probe_slot_s = PROBE_SLOT_S

    def _send(self, ident: bytes, msg: dict[str, Any]) -> None:
        try:
            self.sock.send_multipart(
                [ident, *self._down.sign([json.dumps(msg).encode()])], zmq.NOBLOCK
            )
        except zmq.ZMQError:
            pass  # the peer is gone: nothing to tell

    def _refuse(self, ident: bytes, reason: str, answer: bool = True, retry: bool = False) -> None:
        """Refuse a message: logged and kept; answered "refused" unless `answer` is False
        (a message a rank sends without waiting for an answer: it would take a
        "refused" for the answer to its next request). `retry`: refused for now only."""
        self.refusals = [*self.refusals[-99:], reason]
        self._warn.warn(
            "refused", "rendezvous: refused a message from connection %s: %s", ident.hex(), reason
        )
        if answer:
            self._send(ident, {"kind": "refused", "reason": reason, "retry": retry})

    def _signed(self, frames: list[bytes]) -> tuple[str, int, bytes] | str:
        """(the name and incarnation a message is signed for, its JSON) when its MAC is
        right for them and it is newer than the last message signed for that name; else
        why it is refused."""
        if len(frames) != 4 or len(frames[1]) != 16 or not 0 < len(frames[0]) <= MAX_NAME_BYTES:
            return "unauthenticated message (no MAC, or not this run's secret)"
        name = bytes(frames[0]).decode(errors="replace")
        inc, seq = int.from_bytes(frames[1][:8], "big"), int.from_bytes(frames[1][8:], "big")
        mac = self._keys.get((name, inc))
        if mac is None:
            mac = FrameMac(rank_key(self._secret, TO_LAUNCHER, name, inc), b"")
        body = mac.verify(frames)
        if body is None:
            return "unauthenticated message (no MAC, or not this run's secret)"
        if (name, inc) not in self._keys:
            if len(self._keys) >= MAX_SPEAKERS:
                self._keys.pop(next(iter(self._keys)))
            self._keys[(name, inc)] = mac
        last = self._last.get(name)
        if last is not None and (inc, seq) <= last:
            return (
                f"replayed message: signed for {name[:40]} incarnation {inc} number {seq}, not "
                f"newer than its last ({last[0]} number {last[1]}): sent again, or from an "
                f"earlier incarnation"
            )
        if last is None and len(self._last) >= MAX_SPEAKERS:
            self._last.pop(next(iter(self._last)))
        self._last[name] = (inc, seq)
        return name, inc, body[2]

    def poll(self, timeout_s: float, start_delay_s: float = 0.5) -> None:
        """Handle what arrived; once all hellos are in, answer them with the table. Then
        tend the ranks: silent ones go down, down ones past their grace are gone,
        rejoins whose peers answered complete."""
        if self.sock.poll(int(timeout_s * 1000)):
            while True:
                try:
                    parts = self.sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    self._handle(parts[0], parts[1:])
                except Exception as exc:  # a stray peer must not take the launcher down
                    self._refuse(
                        parts[0], f"could not handle the message: {type(exc).__name__}: {exc}"
                    )
        if not self.started and set(self.hellos) == self.expected:
            self.started = True
            probe_s = self.probe_slots * self.probe_slot_s
            self.t0 = time.time() + start_delay_s + probe_s
            now = time.monotonic()
            self.last_heard = dict.fromkeys(self.hellos, now)
            table = [info.to_json() for _, info in self.hellos.values()]
            msg: dict[str, Any] = {"kind": "table", "ranks": table, "t0": self.t0}
            if self.probe_slots:
                msg["probe"] = {"start": self.t0 - probe_s, "slot_s": self.probe_slot_s}
            for ident, _ in self.hellos.values():
                self._send(ident, msg)
        if self.started:
            self._tend(time.monotonic())

    def _handle(self, ident: bytes, frames: list[bytes]) -> None:
        if frames_size(frames) > MAX_RENDEZVOUS_BYTES:
            return self._refuse(
                ident, f"message of {frames_size(frames)} bytes (at most {MAX_RENDEZVOUS_BYTES})"
            )
        signed = self._signed(frames)
        if isinstance(signed, str):
            return self._refuse(ident, signed)
        signer, incarnation, raw = signed
        try:
            msg = json.loads(raw)
        except ValueError as exc:
            return self._refuse(ident, f"malformed message: {exc}")
        kind = msg.get("kind") if isinstance(msg, dict) else None
        name = self.registered.get(ident)
        if name is not None and kind != "hello":
            hello = self.hellos[name][1]
            if (signer, incarnation) != (name, hello.incarnation):
                return self._refuse(
                    ident,
                    f"{str(kind)[:40]} signed for {signer[:40]} incarnation {incarnation} from "
                    f"the connection of {name} incarnation {hello.incarnation}: a rank speaks "
                    f"only for itself",
                    answer=kind not in ("alive", "rejoin_ack"),
                )
            self.last_heard[name] = time.monotonic()  # any message is a sign of life
        if kind == "alive":
            if name is None:  # e.g. a replaced incarnation's old connection
                return self._refuse(
                    ident, "alive from a connection that registered no rank", answer=False
                )
            quiet = msg.get("quiet_s")
            if isinstance(quiet, (int, float)) and not isinstance(quiet, bool) and quiet > 0:
                self._quiet_until[name] = time.monotonic() + min(float(quiet), MAX_QUIET_S)
            rooms = msg.get(
                "rooms"
            )  # progress only: a bad value is ignored, never trusted for anything else
            if (
                isinstance(rooms, list)
                and len(rooms) == 2
                and all(type(v) is int for v in rooms)
                and 0 <= rooms[0] <= rooms[1]
            ):
                self.rooms[name] = (rooms[0], rooms[1])
            return None
        if kind == "hello":
            return self._hello(ident, msg, signer, incarnation)
        if kind == "report":
            return self._report(ident, msg)
        if kind == "rejoin_ack":
            return self._rejoin_ack(ident, msg)
        if kind == "clock":  # a rank measuring its offset to this clock (any authenticated peer)
            return self._send(ident, {"kind": "clock", "t1": msg.get("t1"), "t2": time.time()})
        if kind == "query":
            table = [info.to_json() for _, info in self.hellos.values()]
            return self._send(
                ident, {"kind": "table", "ranks": table, "t0": self.t0, "rejoins": self.rejoins}
            )
        return self._refuse(
            ident,
            f"unknown message kind {str(kind)[:40]!r} (allowed: hello, report, query, clock, "
            f"alive, rejoin_ack)",
        )

    def _hello(self, ident: bytes, msg: dict[str, Any], signer: str, incarnation: int) -> None:
        try:
            info = RankInfo.from_hello(msg)
        except ValueError as exc:
            return self._refuse(ident, f"bad hello: {exc}")
        name = info.name
        if name not in self.expected:
            return self._refuse(
                ident,
                f"{name} is not part of this run (expected: {', '.join(sorted(self.expected))})",
            )
        if (signer, incarnation) != (name, info.incarnation):
            return self._refuse(
                ident,
                f"a hello for {name} incarnation {info.incarnation} signed for {signer[:40]} "
                f"incarnation {incarnation}: a rank registers only itself",
            )
        if ident in self.registered:
            return self._refuse(
                ident, f"this connection already registered {self.registered[ident]}"
            )
        if name in self.hellos:
            if self.started and info.role == "prefill":
                return self._rejoin(ident, info)
            why = "" if not self.started else " (only a prefill rank can rejoin a run)"
            return self._refuse(ident, f"{name} is already registered{why}")
        self.hellos[name] = (ident, info)
        self.registered[ident] = name

    # --- rejoin --------------------------------------------------------------------
    def _rejoin(self, ident: bytes, info: RankInfo) -> None:
        name = info.name
        old_ident, old = self.hellos[name]
        if name in self.reports:
            return self._refuse(
                ident, f"{name} is already registered and finished: nothing to rejoin"
            )
        if name in self.gone:
            return self._refuse(
                ident,
                f"{name} is already registered and was declared gone, too late to rejoin: "
                f"{self.gone[name][:200]}",
            )
        if info.incarnation <= old.incarnation:
            return self._refuse(
                ident,
                f"{name} is already registered as incarnation {old.incarnation}; a rejoin "
                f"needs a newer one, not {info.incarnation} (a replayed hello, or a clock behind)",
            )
        if name not in self.down:
            # never a second registration of a live rank (a secret holder taking it over):
            # a restart of a rank nobody saw die yet waits until it goes silent
            return self._refuse(
                ident,
                f"{name} is registered and live (incarnation {old.incarnation}): a new "
                f"incarnation may register once it is down",
                retry=True,
            )
        after = self.down.pop(name).why
        self.registered.pop(old_ident, None)
        self.hellos[name] = (ident, info)
        self.registered[ident] = name
        asked = {
            n
            for n, (_, i) in self.hellos.items()
            if i.role == "decode" and n not in self.gone and n not in self.down
        }
        self._rejoining[name] = _Rejoin(ident, info, asked, time.monotonic() + REJOIN_ACK_S, after)
        self.events.append(
            f"rank {name} registered again as incarnation {info.incarnation}: asking "
            f"{', '.join(sorted(asked)) or 'no decode rank'} which rooms it serves"
        )
        notice = {"kind": "rejoin", "rank": info.to_json()}
        for n in sorted(asked):  # asked only once the rejoin is recorded (as everywhere here)
            self._send(self.hellos[n][0], notice)

    def _rejoin_ack(self, ident: bytes, msg: dict[str, Any]) -> None:
        name = self.registered.get(ident)
        target, inc, first = msg.get("rank"), msg.get("incarnation"), msg.get("first_room")
        pending = self._rejoining.get(target) if isinstance(target, str) else None
        if (
            name is None
            or pending is None
            or pending.info.incarnation != inc
            or name not in pending.asked
            or not (
                first is None
                or (isinstance(first, int) and not isinstance(first, bool) and first >= 0)
            )
        ):
            return self._refuse(
                ident,
                f"rejoin_ack from {name or 'a connection that registered no rank'} for "
                f"{str(target)[:40]} incarnation {str(inc)[:24]}: no such rejoin asked of it",
                answer=False,
            )
        pending.answers[name] = first

    def _tend(self, now: float) -> None:
        for name, r in list(self._rejoining.items()):
            r.asked -= set(self.gone) | set(self.down)
            if r.asked <= set(r.answers) or now >= r.deadline:
                self._rejoined(name, r, now)
        if self.silent_s is not None:
            for name in self.hellos:
                if (
                    name in self.reports
                    or name in self.gone
                    or name in self.down
                    or name in self._rejoining
                ):
                    continue
                silent = now - self.last_heard.get(name, now)
                if silent > self.silent_s and now >= self._quiet_until.get(name, 0.0):
                    self.mark_down(
                        name,
                        f"rank {name} stopped answering the rendezvous (nothing from it for "
                        f"{silent:.1f}s): dead, hung or cut off",
                    )
        for name, d in list(self.down.items()):
            if now >= d.deadline:
                del self.down[name]
                self.gone[name] = d.why
                self.events.append(
                    f"rank {name} is gone{' (it did not rejoin in time)' if d.deadline > d.since else ''}"
                )

    def _rejoined(self, name: str, r: _Rejoin, now: float) -> None:
        del self._rejoining[name]
        answers = [v for v in r.answers.values() if v is not None]
        first = min(answers) if answers else None
        silent = sorted(r.asked - set(r.answers))
        table = [info.to_json() for _, info in self.hellos.values()]
        rejoin = {
            "incarnation": r.info.incarnation,
            "first_room": first,
            "answered": sorted(r.answers),
            "silent": silent,
        }
        # Record first, answer last: the rank's hello returns as soon as the table arrives,
        # and whoever reads `rejoins` next (a query, the launcher) must find the rejoin.
        self.last_heard[name] = now
        self.rejoins.append(
            {
                "rank": name,
                "incarnation": r.info.incarnation,
                "first_room": first,
                "after": self.headline(r.after),
            }
        )
        self.events.append(
            f"rank {name} rejoined the run as incarnation {r.info.incarnation}, serving rooms "
            f"{'from ' + str(first) if first is not None else 'none'}"
            f"{' (no answer from ' + ', '.join(silent) + ')' if silent else ''}"
        )
        self._send(r.ident, {"kind": "table", "ranks": table, "t0": self.t0, "rejoin": rejoin})

    def mark_down(self, name: str, why: str, grace_s: float | None = None) -> bool:
        """`name` died or went silent during the run (`why` says how): down, and gone
        once its grace is over unless it rejoins first. False if it had finished, or
        was down or gone already."""
        if name in self.reports or name in self.gone or name in self.down:
            return False
        if grace_s is None:
            default = self.rejoin_grace_s if name.startswith("prefill") else 0.0
            grace_s = self.grace_s.get(name, default)
        now = time.monotonic()
        self._rejoining.pop(name, None)  # a rank that dies while rejoining rejoins no more
        self.down[name] = _Down(why, now, now + max(0.0, grace_s))
        self.events.append(
            f"rank {name} is down: {self.headline(why)}"
            + (f"; it may rejoin within {grace_s:.0f}s" if grace_s > 0 else "")
        )
        if grace_s <= 0:
            del self.down[name]
            self.gone[name] = why
        return True

    @staticmethod
    def headline(why: str) -> str:
        """A reason's first line, without the log tail a launcher appends."""
        return why.splitlines()[0].split("; its log ")[0] if why else why

    def take_events(self) -> list[str]:
        out, self.events = self.events, []
        return out

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
        self.down.pop(name, None)  # a rank thought silent that finished after all

    @property
    def all_reported(self) -> bool:
        """Every rank reported, or is gone (died during the run and did not rejoin)."""
        return set(self.reports) | set(self.gone) == self.expected

    def release(self) -> None:
        """Tell every reported rank that it may exit."""
        for ident, _ in self.reports.values():
            self._send(ident, {"kind": "bye"})

    def abort(self, reason: str) -> None:
        for ident, _ in list(self.hellos.values()):
            self._send(ident, {"kind": "abort", "reason": reason})

    def close(self) -> None:
        self.sock.close(linger=500)
