"""Who is in a hardware run: the rendezvous's membership, as a pure machine.

The rendezvous (hw/control/rendezvous.py) owns the sockets, CURVE and the MACs; once a
message's MAC holds it hands the machine the message, who signed it (name, incarnation,
sequence number), the connection it came on, and the time. The machine keeps the rest:
registrations, incarnations, beats, down and gone with their grace, rejoins and their
acks, the report barrier, and each name's replay floor. What it says goes to its
outbox (connection, message) for the rendezvous to sign and send; what happened to
ranks goes to `events`, refusals to `refusals`. No socket, no clock, no log: every
ordering of messages and time is a unit test (tests/test_membership.py).

Who may speak for a name is decided before anything of that name's state is touched:
a message signed for a rank of this run must prove that rank's own credential
(hw/control/credentials.py: `proven`; the run secret alone proves nothing about a
name); a rank speaks for itself from the connection it registered on, under the
incarnation it registered, and from any other connection only to register (a hello).
Other messages signed for a rank's name are refused without moving its replay floor
(else three `query`s signed for it with the largest sequence number would make every
later message of the real rank look replayed), and a hello moves the floor only when it
is taken (a registration, or a rejoin begun). A second claim of a registered name
that is no rejoin (before the run started, or of a decode rank) means two processes hold
that rank's credential: it is refused, and kept in `duplicates` (the launcher fails the
run with it), naming both claimants: where each connected from, its control address,
incarnation and key. The replay floors of the run's ranks are kept apart from tools'
(bounded, the oldest dropped): no flood of tool names evicts a rank's.

What one sender makes it hold is bounded: a report too big for one message comes in
parts (`report_part`) on the rank's own connection, in order, held up to
`max_report_bytes` for that rank (MAX_REPORT_BYTES); anything else is one message.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass, field
from typing import Any

from kvstage.hw.control.keys import PUBLIC_KEY_BYTES, Identity
from kvstage.hw.transport.bandwidth import PROBE_SLOT_S
from kvstage.shared.runtime import rank_name

# tools' names (outside the run) whose last (incarnation, sequence) the rendezvous keeps
# (replay state): only authenticated messages make entries, so this bounds what a flood
# of names can take. The ranks' own floors are kept apart: a tool's flood never evicts one.
MAX_SPEAKERS = 4096
# A report carries the rank's whole trace: it goes in parts (`report_part`, each within
# the rendezvous's bound a message, hw/control/plane.py MAX_RENDEZVOUS_BYTES), which the
# rendezvous holds for the registered rank that sends them (its own connection, its own
# credential) up to this many bytes in all: the most one sender makes it hold.
MAX_REPORT_BYTES = 512 << 20
# How long a rejoin waits for the decode ranks' answers before it goes on without them.
REJOIN_ACK_S = 10.0
# The longest a rank may announce it will be quiet (alive quiet_s: building its report).
MAX_QUIET_S = 600.0
# a message a rank sends without waiting for an answer: a refusal is not answered (it
# would take the "refused" for the answer to its next request)
UNANSWERED = frozenset({"alive", "rejoin_ack"})
KINDS = ("hello", "report", "report_part", "query", "clock", "alive", "rejoin_ack")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text.encode(), validate=True)


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


@dataclass
class _Down:
    """A registered rank that died or went silent during the run, until it rejoins or
    its grace ends (then it is gone)."""

    why: str
    since: float  # `now` when it went down
    deadline: float


@dataclass
class _Rejoin:
    """A restarted rank's re-registration: its decode peers are asked which room the
    new incarnation serves from; it gets its table once all answered (or the wait ends)."""

    conn: bytes
    info: RankInfo
    asked: set[str]
    deadline: float
    after: str  # what happened to the incarnation it replaces
    answers: dict[str, int | None] = field(default_factory=dict)


class Membership:
    """The rendezvous's membership of `expected` ranks (the rules: RendezvousServer).

    In: `message(conn, signer, incarnation, seq, msg, now, wall)` for each authenticated
    message (`msg` its parsed JSON), `tick(now, wall)` at least every poll, `mark_down`,
    `release`, `abort`; `now` is a monotonic clock (s), `wall` the epoch (s). Out:
    `take_sends()` (connection, message) pairs, `take_refused()` (connection, reason)
    pairs for the log, `take_events()` lines for the launcher; and the state below."""

    def __init__(
        self,
        expected: list[str],
        *,
        silent_s: float | None = None,
        rejoin_grace_s: float = 0.0,
        grace_s: dict[str, float] | None = None,
        probe_slots: int = 0,
        probe_slot_s: float = PROBE_SLOT_S,
        max_report_bytes: int = MAX_REPORT_BYTES,
        peers: dict[str, set[str]] | None = None,
    ) -> None:
        self.expected = set(expected)
        # each rank -> the ranks whose table entries it gets (its own besides): the ranks it
        # exchanges messages and bytes with (Sessions.peers); None: every rank
        self.peers = {n: set((peers or {}).get(n, self.expected)) - {n} for n in self.expected}
        self.hellos: dict[str, tuple[bytes, RankInfo]] = {}
        self.reports: dict[str, tuple[bytes, dict[str, Any]]] = {}
        self.gone: dict[str, str] = {}  # ranks that died during the run for good -> why
        self.down: dict[str, _Down] = {}  # ranks dead or silent, within their grace
        self.registered: dict[bytes, str] = {}  # connection -> the rank it registered
        self.refusals: list[str] = []
        self.started = False
        self.t0: float | None = None
        self.silent_s = silent_s
        self.rejoin_grace_s = rejoin_grace_s
        self.grace_s: dict[str, float] = dict(grace_s or {})  # per rank, instead of the default
        self.last_heard: dict[str, float] = {}  # rank -> `now` of its last message
        self._quiet_until: dict[str, float] = {}  # rank -> silent until then, as it announced
        self.rejoins: list[dict[str, Any]] = []
        self._rejoining: dict[str, _Rejoin] = {}
        self.events: list[str] = []  # what happened to ranks (down, gone, rejoined)
        self.rooms: dict[str, tuple[int, int]] = {}  # rank -> (rooms ended, of its workload)
        # the bandwidth probe (hw/transport/bandwidth.py): this many slots of
        # `probe_slot_s` before t0, one per (prefill, decode) pair; 0: no probe
        self.probe_slots = probe_slots
        self.probe_slot_s = probe_slot_s
        self._last: dict[str, tuple[int, int]] = {}  # a rank -> newest (incarnation, seq)
        self._tools: dict[str, tuple[int, int]] = {}  # a tool's name -> the same, bounded
        # a registered rank's connection -> the parts of its report received so far
        # (`report_part`), held up to `max_report_bytes` of text: the most one sender
        # makes this hold
        self.max_report_bytes = max_report_bytes
        self._parts: dict[bytes, list[str]] = {}
        self._sends: list[tuple[bytes, dict[str, Any]]] = []
        self._refused: list[tuple[bytes, str]] = []
        self.origins: dict[bytes, str] = {}  # a registered connection -> where it came from
        self.duplicates: list[str] = []  # second claims of a registered name, both named

    # --- out --------------------------------------------------------------------------
    def take_sends(self) -> list[tuple[bytes, dict[str, Any]]]:
        out, self._sends = self._sends, []
        return out

    def take_refused(self) -> list[tuple[bytes, str]]:
        out, self._refused = self._refused, []
        return out

    def take_events(self) -> list[str]:
        out, self.events = self.events, []
        return out

    def _send(self, conn: bytes, msg: dict[str, Any]) -> None:
        self._sends.append((conn, msg))

    def refuse(self, conn: bytes, reason: str, answer: bool = True, retry: bool = False) -> None:
        """Refuse a message: kept, and answered "refused" unless `answer` is False.
        `retry`: refused for now only."""
        self.refusals = [*self.refusals[-99:], reason]
        self._refused.append((conn, reason))
        if answer:
            self._send(conn, {"kind": "refused", "reason": reason, "retry": retry})

    # --- in ---------------------------------------------------------------------------
    def message(
        self,
        conn: bytes,
        signer: str,
        incarnation: int,
        seq: int,
        msg: Any,
        now: float,
        wall: float,
        *,
        proven: bool = True,
        origin: str = "",
    ) -> None:
        """An authenticated message, signed for `signer`'s `incarnation`, number `seq`;
        `proven`: with the signer's own credential (not the run secret alone); `origin`:
        the address it came from (for the log, and a duplicate's claimants)."""
        kind = msg.get("kind") if isinstance(msg, dict) else None
        answer = kind not in UNANSWERED
        why = self._who_may_speak(conn, signer, incarnation, seq, kind, proven)
        if why is None:
            why = self._replayed(signer, incarnation, seq)
        if why is not None:
            return self.refuse(conn, why, answer=answer)
        if kind != "hello":  # a hello moves the floor once it is taken (`_hello`)
            self._floor(signer, incarnation, seq)
        name = self.registered.get(conn)
        if name is not None and kind != "hello":
            self.last_heard[name] = now  # any message is a sign of life
        if kind == "alive":
            return self._alive(conn, name, msg, now)
        if kind == "hello":
            return self._hello(conn, msg, signer, incarnation, seq, now, origin)
        if kind == "report":
            return self._report(conn, msg)
        if kind == "report_part":
            return self._report_part(conn, msg)
        if kind == "rejoin_ack":
            return self._rejoin_ack(conn, msg)
        if kind == "clock":  # a rank measuring its offset to this clock (any authenticated peer)
            return self._send(conn, {"kind": "clock", "t1": msg.get("t1"), "t2": wall})
        if kind == "query":  # the entries of a registered rank's view; to others none
            incarnations = {n: info.incarnation for n, (_, info) in self.hellos.items()}
            return self._send(
                conn,
                {
                    "kind": "table",
                    "ranks": self.view(name) if name is not None else [],
                    "incarnations": incarnations,
                    "t0": self.t0,
                    "rejoins": self.rejoins,
                },
            )
        return self.refuse(
            conn,
            f"unknown message kind {str(kind)[:40]!r} (allowed: {', '.join(KINDS)})",
        )

    def view(self, name: str) -> list[dict[str, Any]]:
        """The table entries rank `name` gets: its own and its peers' (least exposure:
        no rank learns the addresses, keys and memory of ranks it never talks to)."""
        seen = self.peers.get(name, set()) | {name}
        return [info.to_json() for n, (_, info) in self.hellos.items() if n in seen]

    def _who_may_speak(
        self, conn: bytes, signer: str, incarnation: int, seq: int, kind: Any, proven: bool
    ) -> str | None:
        """Why this connection may not speak for `signer` (None: it may). Asked before
        anything of the signer's state is touched."""
        if signer in self.expected and not proven:
            return (
                f"{str(kind)[:40]} signed for {signer} incarnation {incarnation} with the run "
                f"secret but not {signer}'s own credential: holding run.secret does not make a "
                f"process a rank (a rank's credential comes from whoever started it)"
            )
        name = self.registered.get(conn)
        if name is not None and kind != "hello":
            registered = self.hellos[name][1].incarnation
            if (signer, incarnation) != (name, registered):
                return (
                    f"{str(kind)[:40]} signed for {signer[:40]} incarnation {incarnation} from "
                    f"the connection of {name} incarnation {registered}: a rank speaks "
                    f"only for itself"
                )
        if signer in self.expected and kind != "hello" and name != signer:
            return (
                f"{str(kind)[:40]} signed for {signer} incarnation {incarnation} number {seq} "
                f"from a connection that is not {signer}'s registered one: a rank of this run "
                f"speaks only from its own connection (or registers, with a hello)"
            )
        return None

    def _replayed(self, signer: str, incarnation: int, seq: int) -> str | None:
        last = (self._last if signer in self.expected else self._tools).get(signer)
        if last is not None and (incarnation, seq) <= last:
            return (
                f"replayed message: signed for {signer[:40]} incarnation {incarnation} number "
                f"{seq}, not newer than its last ({last[0]} number {last[1]}): sent again, or "
                f"from an earlier incarnation"
            )
        return None

    def _floor(self, signer: str, incarnation: int, seq: int) -> None:
        if signer in self.expected:
            self._last[signer] = (incarnation, seq)
            return
        if signer not in self._tools and len(self._tools) >= MAX_SPEAKERS:
            self._tools.pop(next(iter(self._tools)))
        self._tools[signer] = (incarnation, seq)

    def _alive(self, conn: bytes, name: str | None, msg: dict[str, Any], now: float) -> None:
        if name is None:  # e.g. a replaced incarnation's old connection
            return self.refuse(
                conn, "alive from a connection that registered no rank", answer=False
            )
        quiet = msg.get("quiet_s")
        if isinstance(quiet, (int, float)) and not isinstance(quiet, bool) and quiet > 0:
            self._quiet_until[name] = now + min(float(quiet), MAX_QUIET_S)
        rooms = msg.get("rooms")  # progress only: a bad value is ignored, never trusted
        if (
            isinstance(rooms, list)
            and len(rooms) == 2
            and all(type(v) is int for v in rooms)
            and 0 <= rooms[0] <= rooms[1]
        ):
            self.rooms[name] = (rooms[0], rooms[1])
        return None

    def tick(self, now: float, wall: float, start_delay_s: float = 0.5) -> None:
        """Once all hellos are in, answer them with the table (t0: `start_delay_s` and
        the probe's slots after `wall`). Then tend the ranks: silent ones go down, down
        ones past their grace are gone, rejoins whose peers answered complete."""
        if not self.started and set(self.hellos) == self.expected:
            self.started = True
            probe_s = self.probe_slots * self.probe_slot_s
            self.t0 = wall + start_delay_s + probe_s
            self.last_heard = dict.fromkeys(self.hellos, now)
            msg: dict[str, Any] = {"kind": "table", "t0": self.t0}
            if self.probe_slots:
                msg["probe"] = {"start": self.t0 - probe_s, "slot_s": self.probe_slot_s}
            for name, (conn, _) in self.hellos.items():
                self._send(conn, {**msg, "ranks": self.view(name)})
        if self.started:
            self._tend(now)

    def _hello(
        self,
        conn: bytes,
        msg: dict[str, Any],
        signer: str,
        incarnation: int,
        seq: int,
        now: float,
        origin: str = "",
    ) -> None:
        try:
            info = RankInfo.from_hello(msg)
        except ValueError as exc:
            return self.refuse(conn, f"bad hello: {exc}")
        name = info.name
        if name not in self.expected:
            return self.refuse(
                conn,
                f"{name} is not part of this run (expected: {', '.join(sorted(self.expected))})",
            )
        if (signer, incarnation) != (name, info.incarnation):
            return self.refuse(
                conn,
                f"a hello for {name} incarnation {info.incarnation} signed for {signer[:40]} "
                f"incarnation {incarnation}: a rank registers only itself",
            )
        if conn in self.registered:
            return self.refuse(conn, f"this connection already registered {self.registered[conn]}")
        if name in self.hellos:
            if self.started and info.role == "prefill":
                return self._rejoin(conn, info, seq, now, origin)
            why = "" if not self.started else " (only a prefill rank can rejoin a run)"
            claim = f"{name} claimed twice{why}: {self.claimants(name, conn, info, origin)}"
            self.duplicates.append(claim)
            self.events.append(claim)
            return self.refuse(conn, f"{name} is already registered{why}; {claim}")
        self.hellos[name] = (conn, info)
        self.registered[conn] = name
        self.origins[conn] = origin
        self._floor(signer, incarnation, seq)

    def claimants(self, name: str, conn: bytes, info: RankInfo, origin: str) -> str:
        """Both claimants of `name`, as truthfully as the rendezvous knows them."""
        held_conn, held = self.hellos[name]

        def who(c: bytes, i: RankInfo, at: str) -> str:
            return (
                f"connection {c.hex()[:16]} from {at or 'an unknown address'} (control "
                f"{i.control}, incarnation {i.incarnation}, key {i.key[:16]})"
            )

        return (
            f"registered: {who(held_conn, held, self.origins.get(held_conn, ''))}; "
            f"refused: {who(conn, info, origin)}; both proved {name}'s credential"
        )

    # --- rejoin --------------------------------------------------------------------
    def _rejoin(self, conn: bytes, info: RankInfo, seq: int, now: float, origin: str) -> None:
        name = info.name
        old_conn, old = self.hellos[name]
        if name in self.reports:
            return self.refuse(
                conn, f"{name} is already registered and finished: nothing to rejoin"
            )
        if name in self.gone:
            return self.refuse(
                conn,
                f"{name} is already registered and was declared gone, too late to rejoin: "
                f"{self.gone[name][:200]}",
            )
        if info.incarnation <= old.incarnation:
            return self.refuse(
                conn,
                f"{name} is already registered as incarnation {old.incarnation}; a rejoin "
                f"needs a newer one, not {info.incarnation} (a replayed hello, or a clock behind)",
            )
        if name not in self.down:
            # never a second registration of a live rank (a secret holder taking it over):
            # a restart of a rank nobody saw die yet waits until it goes silent
            return self.refuse(
                conn,
                f"{name} is registered and live (incarnation {old.incarnation}): a new "
                f"incarnation may register once it is down ("
                f"{self.claimants(name, conn, info, origin)})",
                retry=True,
            )
        after = self.down.pop(name).why
        self._floor(name, info.incarnation, seq)
        self.registered.pop(old_conn, None)
        self.origins.pop(old_conn, None)
        self._parts.pop(old_conn, None)
        self.hellos[name] = (conn, info)
        self.registered[conn] = name
        self.origins[conn] = origin
        asked = {
            n
            for n, (_, i) in self.hellos.items()
            if i.role == "decode"
            and n not in self.gone
            and n not in self.down
            and n in self.peers[name]
        }
        self._rejoining[name] = _Rejoin(conn, info, asked, now + REJOIN_ACK_S, after)
        self.events.append(
            f"rank {name} registered again as incarnation {info.incarnation}: asking "
            f"{', '.join(sorted(asked)) or 'no decode rank'} which rooms it serves"
        )
        notice = {"kind": "rejoin", "rank": info.to_json()}
        for n in sorted(asked):  # asked only once the rejoin is recorded (as everywhere here)
            self._send(self.hellos[n][0], notice)

    def _rejoin_ack(self, conn: bytes, msg: dict[str, Any]) -> None:
        name = self.registered.get(conn)
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
            return self.refuse(
                conn,
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
                        now,
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
        table = self.view(name)
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
        self._send(r.conn, {"kind": "table", "ranks": table, "t0": self.t0, "rejoin": rejoin})

    def mark_down(self, name: str, why: str, now: float, grace_s: float | None = None) -> bool:
        """`name` died or went silent during the run (`why` says how): down, and gone
        once its grace is over unless it rejoins first. False if it had finished, or
        was down or gone already."""
        if name in self.reports or name in self.gone or name in self.down:
            return False
        if grace_s is None:
            default = self.rejoin_grace_s if name.startswith("prefill") else 0.0
            grace_s = self.grace_s.get(name, default)
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

    def _report(self, conn: bytes, msg: dict[str, Any]) -> None:
        name = self.registered.get(conn)
        if name is None:
            return self.refuse(conn, "report from a connection that registered no rank")
        try:
            claimed = rank_name(msg["role"], int(msg["rank"]))
        except (KeyError, TypeError, ValueError):
            claimed = None
        if claimed != name:
            return self.refuse(conn, f"report for {claimed} from the connection of {name}")
        if name in self.reports:
            return self.refuse(conn, f"{name} has already reported")
        self.reports[name] = (conn, msg)
        self.down.pop(name, None)  # a rank thought silent that finished after all

    def _report_part(self, conn: bytes, msg: dict[str, Any]) -> None:
        """One part of a registered rank's report (RendezvousClient.send_report): parts
        come in order on its own connection; the last one makes the report. Held up to
        `max_report_bytes` for that rank; refused (and the parts so far dropped) when a
        part is out of order, not text, or over that bound."""
        name = self.registered.get(conn)
        if name is None:
            return self.refuse(conn, "report_part from a connection that registered no rank")
        held = self._parts.pop(conn, [])
        part, parts, text = msg.get("part"), msg.get("parts"), msg.get("text")
        size = sum(map(len, held)) + (len(text) if isinstance(text, str) else 0)
        why = None
        if not (type(part) is int and type(parts) is int and isinstance(text, str)):
            why = "'part' and 'parts' must be ints, 'text' a string"
        elif part != len(held) or not 0 <= part < parts:
            why = f"part {part} of {parts} after {len(held)} parts: parts come in order"
        elif size > self.max_report_bytes:
            why = f"{size} bytes of report: at most {self.max_report_bytes} a rank"
        elif name in self.reports:
            why = f"{name} has already reported"
        if why is not None:
            return self.refuse(conn, f"report_part from {name} refused, its parts dropped: {why}")
        held.append(text)
        if part + 1 < parts:
            self._parts[conn] = held
            return None
        try:
            report = json.loads("".join(held))
        except ValueError as exc:
            return self.refuse(conn, f"report of {name} in {parts} parts is not JSON: {exc}")
        if not isinstance(report, dict):
            return self.refuse(conn, f"report of {name} is {type(report).__name__}, not an object")
        return self._report(conn, report)

    @property
    def all_reported(self) -> bool:
        """Every rank reported, or is gone (died during the run and did not rejoin)."""
        return set(self.reports) | set(self.gone) == self.expected

    def release(self) -> None:
        """Tell every reported rank that it may exit."""
        for conn, _ in self.reports.values():
            self._send(conn, {"kind": "bye"})

    def abort(self, reason: str) -> None:
        for conn, _ in list(self.hellos.values()):
            self._send(conn, {"kind": "abort", "reason": reason})
