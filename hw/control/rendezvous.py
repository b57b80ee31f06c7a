"""The rendezvous that introduces the ranks of a hardware-mode run, and keeps track of them.

The rendezvous is a ROUTER socket (run by the launcher, or alone for ranks placed
by srun/mpirun): every rank sends a JSON hello with its control address and its
transfer metadata; when all ranks are there each gets the whole table and a common
start time. At the end every rank sends its report and waits for the go to exit,
so no process disappears while a peer might still write to it. Every message is
authenticated with the run's secret (hw/control/plane.py): a rank's messages carry its
name, incarnation and a sequence number and are signed with that rank's own key
(hw/control/keys.py `rank_key`), derived from the run secret *and* the rank's own
credential (hw/control/credentials.py), which the rendezvous's master key derives and
whoever starts the rank hands to that process alone: a hello, report or beat can only be
signed for the rank it speaks for by that rank, and a message sent again (replayed) is
refused. A rank's hello also
carries its control plane's public key (`RankInfo.key`), from which its peers derive
the keys of their frames to and from it (hw/control/keys.py).

Who is in the run (registrations, incarnations, beats, down and gone, rejoins, the
report barrier, each name's replay floor) is a pure machine, hw/control/membership.py;
`RendezvousServer` holds the ROUTER socket, CURVE and the MACs around it, and hands the
machine each authenticated message with the time.

During the run each rank says it is alive every RANK_BEAT_S: the launcher's failure
detector for ranks it did not start (`kvstage hw --no-spawn`). A prefill rank that
died may register again under a newer incarnation and rejoin the run
(`RendezvousServer`: its decode peers are told, and say from which room the new
incarnation serves them).
"""

from __future__ import annotations

import json
import math
import os
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvstage.hw.control.credentials import Credentials, curve_keys
from kvstage.hw.control.keys import MAX_NAME_BYTES, rank_key
from kvstage.hw.control.membership import MAX_REPORT_BYTES, Membership, RankInfo
from kvstage.hw.control.plane import (
    MAX_RENDEZVOUS_BYTES,
    MAX_TABLE_BYTES,
    RENDEZVOUS_RCVHWM,
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
from kvstage.hw.control.zap import Gate, ZapHandler

# connections the rendezvous closes before their CURVE handshake, none completed, before
# a rank concludes that its run secret is not the launcher's (ZMQ reconnects every
# 0.1 s [C] libzmq ZMQ_RECONNECT_IVL default, so about 0.3 s)
REFUSED_HANDSHAKES = 3


# a rank waiting for an answer says so after this long, then again every so often
WAIT_NOTE_S = 5.0
WAIT_NOTE_EVERY_S = 15.0


class RendezvousError(RuntimeError):
    pass


class RendezvousRetry(RendezvousError):
    """Refused for now: asked again later, it may be granted (a live rank's name)."""


# how often a hello refused for now is sent again (RendezvousClient.hello)
RETRY_S = 0.5
# [A] how long a send to the rendezvous may wait for a connection to queue it on: it
# queues at once on one being made; only a connection whose handshake was refused, and not
# made again, leaves none (RendezvousClient.send)
SEND_TIMEOUT_MS = 10_000
# Connections the rendezvous admits, all together over a run, of keys that are no rank's
# (tools that hold only the run secret: diagnostics, tests; no rank needs one). None by
# default (`tools`, `kvstage hw --tool-connections`): ZAP then admits only the ranks'
# own keys, so holding the run secret alone opens no connection, and no message of a
# non-rank is queued at all (libzmq holds an admitted peer's message of endless small
# frames whole: docs/hardware-mode.md). At most MAX_TOOL_CONNECTIONS when asked for:
# one sender, held to 16 x RENDEZVOUS_RCVHWM x MAX_RENDEZVOUS_BYTES = 64 MiB queued.
MAX_TOOL_CONNECTIONS = 16
# the characters of a report's JSON text in one `report_part`: escaped as a JSON string
# (a quote or backslash takes 2 bytes) with its envelope, within MAX_RENDEZVOUS_BYTES
REPORT_PART_CHARS = (MAX_RENDEZVOUS_BYTES - 4096) // 2
# What the rendezvous tells a registered rank unasked (RendezvousClient.notices).
NOTICES = frozenset({"rejoin"})
# A registered rank says it is alive this often; one silent for RANK_SILENT_S is down
# (the launcher's failure detector: longer than the peers' 3 s, so its peers' own
# detectors fail its rooms first, with their reason).
RANK_BEAT_S = 0.5
RANK_SILENT_S = 5.0


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

    `secret`: the run secret (default: $KVSTAGE_RUN_SECRET); `credential`: the rank's own
    (hw/control/credentials.py), what its `hello` and later messages are signed with
    (without one a client speaks only as a tool). `watch`, if given, is
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
        credential: bytes = b"",
    ) -> None:
        secret = self._secret = run_secret(secret)
        self._credential = credential
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
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_TABLE_BYTES)
        # a DEALER blocks a send while it has no connection to queue it on: after a refused
        # handshake libzmq may not connect again, and a send would wait for ever
        self.sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
        # a rank connects with the key of its credential (the rendezvous counts its
        # connections); a tool with a key of its own, drawn here
        curve_client(self.sock, secret, curve_keys(credential) if credential else None)
        if not address.startswith("tcp://"):
            address = f"tcp://{address}"
        # connection events: a rendezvous that closes every connection before the CURVE
        # handshake completes does not hold this rank's run secret; one whose ZAP handler
        # refused this connection's key (hw/control/zap.py) does not admit it
        self._monitor = self.sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
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

    def speak_as(self, name: str, incarnation: int, credential: bytes = b"") -> None:
        """Sign every message from now on for rank `name`'s `incarnation`, with
        `credential` (a rank's own; none: a tool's name)."""
        self.name, self.incarnation = name, incarnation
        key = rank_key(self._secret, TO_LAUNCHER, name, incarnation, credential)
        self._up = FrameMac(key, b"")

    def send(self, msg: dict[str, Any], block: bool = True) -> None:
        """One authenticated JSON message to the rendezvous. `block=False`: dropped if
        it cannot go at once (a rendezvous that is gone must not stall a rank's loop).
        RendezvousError, naming the bound, for one over MAX_RENDEZVOUS_BYTES (the
        rendezvous would cut the connection off)."""
        self._seq += 1
        frames = self._up.sign(
            [
                self.name.encode(),
                frame_header(self.incarnation, self._seq),
                json.dumps(msg).encode(),
            ]
        )
        if frames_size(frames) > MAX_RENDEZVOUS_BYTES:
            raise RendezvousError(
                f"a {str(msg.get('kind'))[:40]} message of {frames_size(frames)} bytes is over "
                f"the rendezvous's bound of {MAX_RENDEZVOUS_BYTES} bytes a message (a report "
                f"goes in parts; a hello's transfer metadata must fit)"
            )
        self._check_handshakes()  # a refusal already seen is said, not sent into
        try:
            self.sock.send_multipart(frames, 0 if block else zmq.NOBLOCK)
        except zmq.Again:
            if block:
                self._check_handshakes()
                raise RendezvousError(
                    f"could not send to the rendezvous at {self.address} within "
                    f"{SEND_TIMEOUT_MS / 1000:.0f}s: no connection to it is open (its "
                    f"handshake was refused, or it is gone)" + self._tool_hint()
                ) from None

    def send_report(self, report: dict[str, Any]) -> None:
        """`report` as one message if it fits, else in parts of at most
        MAX_RENDEZVOUS_BYTES (`report_part`: a slice of its JSON text each, in order);
        RendezvousError, naming the bound, for one over MAX_REPORT_BYTES."""
        text = json.dumps(report)  # ASCII: as a JSON string each character takes <= 2 bytes
        if len(text) > MAX_REPORT_BYTES:
            raise RendezvousError(
                f"a report of {len(text)} bytes is over the rendezvous's bound of "
                f"{MAX_REPORT_BYTES} bytes a rank"
            )
        if len(text) + 4096 <= MAX_RENDEZVOUS_BYTES:
            return self.send({"kind": "report", **report})
        step = REPORT_PART_CHARS
        parts = -(-len(text) // step)
        for i in range(parts):
            self.send(
                {
                    "kind": "report_part",
                    "part": i,
                    "parts": parts,
                    "text": text[i * step : (i + 1) * step],
                }
            )

    def _check_handshakes(self) -> None:
        """RendezvousError once the rendezvous closed connections before their handshake
        and never completed one: this rank's secret is not the run's."""
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._handshakes += 1
            elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH and not self._credential:
                # the secret is right (CURVE got as far as asking ZAP); a tool's key is not
                # let in. (A rank's key may be refused for now: a restarted rank that
                # connects before its old incarnation was seen down; it tries again.)
                raise RendezvousError(
                    f"the rendezvous at {self.address} refused this connection's key: "
                    "holding the run secret but no rank's credential, this is a tool, and "
                    "the rendezvous admits tools only when its launcher was started with "
                    "--tool-connections (none by default), that many"
                )
            elif event == zmq.EVENT_DISCONNECTED and not self._handshakes:
                self._refused_handshakes += 1
        if not self._handshakes and self._refused_handshakes >= REFUSED_HANDSHAKES:
            raise RendezvousError(
                f"the rendezvous at {self.address} refused this rank's connection "
                f"{self._refused_handshakes} times before its handshake: this rank cannot "
                f"authenticate: this rank's run secret is not the launcher's (check "
                f"--secret-file / ${SECRET_ENV})" + self._tool_hint()
            )

    def _tool_hint(self) -> str:
        """For a client with no rank's credential that never completed a handshake: the
        other reason it may have been refused (libzmq does not always report a refused
        key as such, nor connect again after one)."""
        if self._credential or self._handshakes:
            return ""
        return (
            "; or, holding no rank's credential, this is a tool, and the rendezvous admits "
            "tools only when its launcher was started with --tool-connections (none by "
            "default), that many"
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
                    f"there, and the address right?" + self._tool_hint()
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
        self.speak_as(me.name, me.incarnation, self._credential)
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
        self.send_report(report)
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
        """The start time (None before every rank is in) and the table entries this
        client may see: a registered rank's own and its peers' (Membership.view); none
        for anyone else (a tool, a rank before its hello)."""
        reply = self._query(timeout_s)
        return {
            RankInfo.from_json(d).name: RankInfo.from_json(d) for d in reply["ranks"]
        }, reply.get("t0")

    def incarnations(self, timeout_s: float) -> dict[str, int]:
        """The incarnation of every rank registered so far, by name (what a rank started
        again needs before its hello, to take a newer one); told to any client."""
        return {str(k): int(v) for k, v in self._query(timeout_s)["incarnations"].items()}

    def _query(self, timeout_s: float) -> dict[str, Any]:
        self.send({"kind": "query"})
        return self.recv(timeout_s, "the rank table")

    def rejoins(self, timeout_s: float) -> list[dict[str, Any]]:
        """The rejoins the rendezvous completed so far (rank, incarnation, first_room, after)."""
        return list(self._query(timeout_s).get("rejoins", []))

    def close(self) -> None:
        self.sock.disable_monitor()
        self._monitor.close(linger=0)
        self.sock.close(linger=1000)


def check_tool_connections(tools: int) -> None:
    """A bad `tools` (--tool-connections) in one line: what it was and what is allowed."""
    if not 0 <= tools <= MAX_TOOL_CONNECTIONS:
        raise ValueError(
            f"tool connections = {tools}: allowed 0 (the default: only ranks connect) to "
            f"{MAX_TOOL_CONNECTIONS}"
        )


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
    a rank already gone or finished. `rejoins` lists the completed rejoins.

    Credentials: the server draws the run's master key (`credentials`, never sent) and
    checks every message signed for a rank of the run against that rank's credential
    (`credential(name)`: for whoever starts the rank to hand it to that process alone);
    one signed with the run secret alone reaches the membership unproven and is refused
    there, naming why. A second claim of a registered name is in `duplicates`.

    Least exposure: each rank gets the table entries of the ranks it exchanges messages
    and bytes with (`peers`: name -> names; None: every rank) and its own; a query from
    anyone else (a tool, a rank before its hello) gets every rank's incarnation, t0 and
    the rejoins, no entry (Membership.view).

    Bounded per sender (docs/hardware-mode.md): a message is at most
    MAX_RENDEZVOUS_BYTES (ZMQ cuts off a connection on a bigger frame's header; a frame
    list over it is refused unread), at most RENDEZVOUS_RCVHWM of them queued per
    connection; a rank connects with the CURVE key of its credential, admitted a few times
    (`gate`, hw/control/zap.py), and its report comes in parts held up to MAX_REPORT_BYTES
    for it alone; keys of no rank (tools) share `tools` connections (none by default, at
    most MAX_TOOL_CONNECTIONS)."""

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
        peers: dict[str, set[str]] | None = None,
        tools: int = 0,
    ) -> None:
        check_tool_connections(tools)
        secret = self._secret = run_secret(secret)
        self._down = FrameMac(secret, TO_RANK)
        self.credentials = Credentials()
        # a rank of the run -> (incarnation, the key its messages are signed with): kept
        # only once a message proved it, one per rank (a tool's key is derived each time)
        self._keys: dict[str, tuple[int, FrameMac]] = {}
        self.ctx = ctx or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_RENDEZVOUS_BYTES)
        self.sock.setsockopt(zmq.RCVHWM, RENDEZVOUS_RCVHWM)
        curve_server(self.sock, secret)  # a stranger gets no connection: nothing buffered
        # per sender: each rank's key (of its credential) a few connections, tools together
        # `tools` (hw/control/zap.py)
        self.gate = Gate(others=tools)
        self._curve_keys = {name: curve_keys(self.credentials.of(name))[0] for name in expected}
        for key in self._curve_keys.values():
            self.gate.admit(key)
        self.gate.seal()
        self._granted: set[tuple[str, float]] = set()  # (rank, went down at): one more each
        ZapHandler.of(self.ctx).guard(self.sock, self.gate)
        if port:
            self.sock.bind(f"tcp://{host}:{port}")
        else:
            port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"{advertise or host}:{port}"  # what ranks connect to
        # who is in the run, and what each rank said: the pure machine (membership.py)
        self.members = Membership(
            expected,
            silent_s=silent_s,
            rejoin_grace_s=rejoin_grace_s,
            grace_s=grace_s,
            probe_slots=probe_slots,
            peers=peers,
        )
        self._warn = Throttled(log, first=20)

    # the membership's state, as the launcher and tools read it
    expected = property(lambda self: self.members.expected)
    hellos = property(lambda self: self.members.hellos)
    reports = property(lambda self: self.members.reports)
    gone = property(lambda self: self.members.gone)
    down = property(lambda self: self.members.down)
    registered = property(lambda self: self.members.registered)
    refusals = property(lambda self: self.members.refusals)
    started = property(lambda self: self.members.started)
    t0 = property(lambda self: self.members.t0)
    rejoins = property(lambda self: self.members.rejoins)
    rooms = property(lambda self: self.members.rooms)
    all_reported = property(lambda self: self.members.all_reported)
    duplicates = property(lambda self: self.members.duplicates)
    headline = staticmethod(Membership.headline)

    def _flush(self) -> None:
        """Sign and send what the membership said; log what it refused."""
        for conn, reason in self.members.take_refused():
            self._warn.warn(
                "refused",
                "rendezvous: refused a message from connection %s: %s",
                conn.hex(),
                reason,
            )
        for conn, msg in self.members.take_sends():
            try:
                self.sock.send_multipart(
                    [conn, *self._down.sign([json.dumps(msg).encode()])], zmq.NOBLOCK
                )
            except zmq.ZMQError:
                pass  # the peer is gone: nothing to tell

    def credential(self, name: str) -> bytes:
        """Rank `name`'s credential, for whoever starts it to hand to it alone."""
        return self.credentials.of(name)

    def _verify(self, name: str, inc: int, frames: list[bytes]) -> list[bytes] | None:
        """The frames of a message signed for `name`'s `inc` without their MAC, or None:
        checked with its credential for a rank of the run, with the run secret alone
        for any other name (a tool's). Keys are kept only once a message proved them."""
        rank = name in self.members.expected
        known = self._keys.get(name)
        if known is not None and known[0] == inc:
            mac = known[1]
        else:
            cred = self.credentials.of(name) if rank else b""
            mac = FrameMac(rank_key(self._secret, TO_LAUNCHER, name, inc, cred), b"")
        body = mac.verify(frames)
        if body is not None and rank:
            self._keys[name] = (inc, mac)
        return body

    def _signed(self, frames: list[bytes]) -> tuple[str, int, int, bytes, bool] | str:
        """(the name and incarnation a message is signed for, its number, its JSON,
        whether it proved that name's credential) when its MAC is right for them; else
        why it is refused. Whether that signer may speak here, and whether the message
        is new, the membership decides."""
        if len(frames) != 4 or len(frames[1]) != 16 or not 0 < len(frames[0]) <= MAX_NAME_BYTES:
            return "unauthenticated message (no MAC, or not this run's secret)"
        name = bytes(frames[0]).decode(errors="replace")
        inc, seq = int.from_bytes(frames[1][:8], "big"), int.from_bytes(frames[1][8:], "big")
        body = self._verify(name, inc, frames)
        if body is not None:
            return name, inc, seq, body[2], True
        if name in self.members.expected:  # signed with the run secret alone? say so
            bare = FrameMac(rank_key(self._secret, TO_LAUNCHER, name, inc), b"").verify(frames)
            if bare is not None:
                return name, inc, seq, bare[2], False
        return "unauthenticated message (no MAC, or not this run's secret)"

    def poll(self, timeout_s: float, start_delay_s: float = 0.5) -> None:
        """Handle what arrived; then let the membership start the run once every rank is
        in, and tend the ranks (Membership.tick)."""
        if self.sock.poll(int(timeout_s * 1000)):
            while True:
                try:
                    frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                origin = _peer_address(frames[-1])
                parts = [f.bytes for f in frames]
                try:
                    self._handle(parts[0], parts[1:], origin)
                except Exception as exc:  # a stray peer must not take the launcher down
                    self.members.refuse(
                        parts[0], f"could not handle the message: {type(exc).__name__}: {exc}"
                    )
        self.members.tick(time.monotonic(), time.time(), start_delay_s)
        self._grant()
        self._flush()

    def _grant(self) -> None:
        """A rank that went down may connect once more (its next incarnation)."""
        for name, down in list(self.members.down.items()):
            if (name, down.since) not in self._granted:
                self._granted.add((name, down.since))
                self.gate.grant(self._curve_keys[name])

    def _handle(self, conn: bytes, frames: list[bytes], origin: str = "") -> None:
        if frames_size(frames) > MAX_RENDEZVOUS_BYTES:
            return self.members.refuse(
                conn,
                f"message of {frames_size(frames)} bytes: at most {MAX_RENDEZVOUS_BYTES} a "
                f"message (a report goes in parts)",
            )
        signed = self._signed(frames)
        if isinstance(signed, str):
            return self.members.refuse(conn, signed)
        signer, incarnation, seq, raw, proven = signed
        try:
            msg = json.loads(raw)
        except ValueError as exc:
            return self.members.refuse(conn, f"malformed message: {exc}")
        self.members.message(
            conn,
            signer,
            incarnation,
            seq,
            msg,
            time.monotonic(),
            time.time(),
            proven=proven,
            origin=origin,
        )
        return None

    def mark_down(self, name: str, why: str, grace_s: float | None = None) -> bool:
        """`name` died or went silent during the run (Membership.mark_down)."""
        down = self.members.mark_down(name, why, time.monotonic(), grace_s)
        self._grant()
        self._flush()
        return down

    def take_events(self) -> list[str]:
        return self.members.take_events()

    def release(self) -> None:
        """Tell every reported rank that it may exit."""
        self.members.release()
        self._flush()

    def abort(self, reason: str) -> None:
        self.members.abort(reason)
        self._flush()

    def close(self) -> None:
        ZapHandler.of(self.ctx).release(self.sock)
        self.sock.close(linger=500)


def _peer_address(frame: zmq.Frame) -> str:
    """The TCP address a message came from (ZMQ's Peer-Address), "" if unknown."""
    try:
        return str(frame.get("Peer-Address"))
    except (zmq.ZMQError, AttributeError, ValueError):
        return ""
