"""Fault injection, decided once for both modes.

`FaultPlan` is a seeded, pure decision maker: drivers ask it, at the message and
action boundary, what happens to a message (dropped, duplicated, delayed) and
whether a room is aborted at a phase, a scatter starts late or stalls, a session starts late or
a rank dies (and is started again). Every rank has its own plan, drawn from the seed and the rank
(`shared.runtime.fault_stream`). A message's fate is drawn from its identity (type,
room, chunk, ranks, writer) and how many times this rank sent that identity before, not
from its place in the rank's sending order: the order of a rank's messages depends on
timing in hardware mode, so an order-keyed stream dropped different messages there than
in the simulator (a STAGING_RSP and its three resends dropped in a row, a room lost, in
one hardware run of drop-rsp-watermark whose simulation lost none). So a scenario
injects the same faults on the same messages in both modes.
The schema (`FaultsConfig`) is the scenario's `[faults]` table.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvstage.shared.protocol import (
    Abort,
    Bootstrap,
    ChunkReady,
    DoneAck,
    Message,
    ReadyAck,
    StagingReq,
    StagingRsp,
    Watermark,
    WriterDone,
)

MESSAGE_NAMES: dict[type, str] = {
    StagingReq: "STAGING_REQ",
    StagingRsp: "STAGING_RSP",
    Watermark: "WATERMARK",
    ChunkReady: "CHUNK_READY",
    WriterDone: "WRITER_DONE",
    Bootstrap: "BOOTSTRAP",
    Abort: "ABORT",
    ReadyAck: "READY_ACK",
    DoneAck: "DONE_ACK",
}
MessageName = Literal[
    "STAGING_REQ",
    "STAGING_RSP",
    "WATERMARK",
    "CHUNK_READY",
    "WRITER_DONE",
    "BOOTSTRAP",
    "ABORT",
    "READY_ACK",
    "DONE_ACK",
]
Probability = Annotated[float, Field(ge=0.0, le=1.0)]
AbortPhase = Literal["open", "rsp", "gather", "write", "scatter"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class MessageMatch(_Strict):
    """One exact message to act on: type plus any of room / chunk / writer."""

    type: MessageName
    action: Literal["drop", "duplicate", "delay"] = "drop"
    room: int | None = None
    chunk: int | None = None
    writer: int | None = None
    times: Annotated[int, Field(ge=1)] = 1  # how many matching messages (first ones)


class AbortAt(_Strict):
    room: Annotated[int, Field(ge=0)]
    phase: AbortPhase = "write"


class StallScatter(_Strict):
    room: Annotated[int, Field(ge=0)]
    chunk: Annotated[int, Field(ge=0)] = 0
    seconds: Annotated[float, Field(gt=0, le=3600)] = 1.0


class LateScatter(_Strict):
    """The decode starts the scatter of (room, chunk) `seconds` after the chunk is
    complete (every writer's CHUNK_READY in): the written region waits that long in the
    staging ring, where any holder of the engine's address can still write it, before
    the decode copies it out and checks it (transfer.verify_writes). On the slice path
    (and for an OVERSIZED chunk) the check of its writer blocks in the KV pages starts
    late instead. The window an attack on verify_writes has to land in, held open."""

    room: Annotated[int, Field(ge=0)]
    chunk: Annotated[int, Field(ge=0)] = 0
    seconds: Annotated[float, Field(gt=0, le=3600)] = 1.0


class LateSession(_Strict):
    prefill_rank: Annotated[int, Field(ge=0)]
    delay_s: Annotated[float, Field(gt=0, le=3600)]


class KillRank(_Strict):
    """A rank dies at `at_s` (as if SIGKILLed). With `restart_after_s` (prefill ranks
    only) it is started again that long after: its peers learn of the new incarnation
    (hardware mode: the launcher spawns it again and it re-registers with the
    rendezvous) and it serves the rooms that had not arrived yet; the rooms it left in
    flight fail as for a kill alone (PeerLost), the later ones finish."""

    role: Literal["prefill", "decode"]
    rank: Annotated[int, Field(ge=0)]
    at_s: Annotated[float, Field(ge=0, le=86400)]
    restart_after_s: Annotated[float, Field(gt=0, le=86400)] | None = None

    @model_validator(mode="after")
    def _only_prefill_restarts(self) -> KillRank:
        if self.restart_after_s is not None and self.role != "prefill":
            raise ValueError(
                "only a prefill rank can restart (restart_after_s): a decode rank's staging ring "
                "and KV pool would come back empty under its writers"
            )
        return self


class FaultsConfig(_Strict):
    """[faults] of a scenario. Probabilities are per message of that type."""

    seed: int | None = None  # default: the workload seed
    drop: dict[MessageName, Probability] = Field(default_factory=dict)
    duplicate: dict[MessageName, Probability] = Field(default_factory=dict)
    delay: dict[MessageName, Probability] = Field(default_factory=dict)
    delay_s: Annotated[float, Field(ge=0, le=3600)] = (
        0.002  # extra latency of a delayed message (reorders it)
    )
    match: list[MessageMatch] = Field(default_factory=list)
    abort: list[AbortAt] = Field(default_factory=list)
    stall_scatter: list[StallScatter] = Field(default_factory=list)
    late_scatter: list[LateScatter] = Field(default_factory=list)
    late_session: list[LateSession] = Field(default_factory=list)
    kill: list[KillRank] = Field(default_factory=list)

    @model_validator(mode="after")
    def _one_entry_per_chunk(self) -> FaultsConfig:
        """stall_scatter and late_scatter hold one entry per (room, chunk): a second one
        would silently replace the first."""
        for key, entries in (
            ("stall_scatter", self.stall_scatter),
            ("late_scatter", self.late_scatter),
        ):
            seen: set[tuple[int, int]] = set()
            for entry in entries:
                chunk = (entry.room, entry.chunk)
                if chunk in seen:
                    raise ValueError(
                        f"faults.{key} names room {entry.room} chunk {entry.chunk} twice "
                        f"(allowed: one entry per (room, chunk))"
                    )
                seen.add(chunk)
        return self

    @property
    def any_message_fault(self) -> bool:
        return bool(self.drop or self.duplicate or self.delay or self.match)


@dataclass(frozen=True, slots=True)
class Delivery:
    """One copy of a message to deliver, `extra_delay_s` after its normal latency."""

    extra_delay_s: float
    msg: Message


# the fields that make a message's identity for its fault draw (those it has): not its
# nonce, tag, offset or watermark position, which differ between modes and runs
_IDENTITY = ("room", "chunk", "prefill_rank", "decode_rank", "writer", "from_decode")


class FaultPlan:
    def __init__(self, config: FaultsConfig, seed: int, stream: int = 0) -> None:
        self.config = config
        self._key = f"{config.seed if config.seed is not None else seed}:{stream}"
        self._sent: dict[tuple, int] = {}  # a message identity -> times sent so far
        self._match_left = [m.times for m in config.match]
        self._aborts = {(a.room, a.phase) for a in config.abort}
        self._stalls = {(s.room, s.chunk): s.seconds for s in config.stall_scatter}
        self._late_scatters = {(s.room, s.chunk): s.seconds for s in config.late_scatter}
        self._late = {s.prefill_rank: s.delay_s for s in config.late_session}
        self.injected: dict[str, int] = {}

    def count(self, what: str) -> None:
        """Note one injected fault (for the run's summary)."""
        self.injected[what] = self.injected.get(what, 0) + 1

    def on_send(self, msg: Message) -> list[Delivery]:
        """What becomes of one message: [] dropped, one copy, or two (duplicated)."""
        c = self.config
        if not c.any_message_fault:
            return [Delivery(0.0, msg)]
        name = MESSAGE_NAMES[type(msg)]
        action = self._exact(name, msg)
        ident = (name, *(getattr(msg, f, None) for f in _IDENTITY))
        n = self._sent[ident] = self._sent.get(ident, -1) + 1
        if action is None:
            r = self._draw(ident, n, "fate")
            p_drop, p_dup, p_delay = (
                c.drop.get(name, 0.0),
                c.duplicate.get(name, 0.0),
                c.delay.get(name, 0.0),
            )
            if r < p_drop:
                action = "drop"
            elif r < p_drop + p_dup:
                action = "duplicate"
            elif r < p_drop + p_dup + p_delay:
                action = "delay"
        if action is None:
            return [Delivery(0.0, msg)]
        self.count(f"{action}:{name}")
        if action == "drop":
            return []
        if action == "duplicate":
            return [Delivery(0.0, msg), Delivery(c.delay_s * self._draw(ident, n, "delay"), msg)]
        return [Delivery(c.delay_s, msg)]

    def _draw(self, ident: tuple, n: int, what: str) -> float:
        """A uniform draw in [0, 1) for the `n`-th send of message identity `ident`:
        keyed BLAKE2b of the plan's seed and stream, the identity, `n` and `what`."""
        h = hashlib.blake2b(repr((self._key, ident, n, what)).encode(), digest_size=8)
        return int.from_bytes(h.digest(), "big") / 2**64

    def _exact(self, name: str, msg: Message) -> str | None:
        for i, m in enumerate(self.config.match):
            if self._match_left[i] <= 0 or m.type != name:
                continue
            if m.room is not None and getattr(msg, "room", None) != m.room:
                continue
            if m.chunk is not None and getattr(msg, "chunk", None) != m.chunk:
                continue
            if m.writer is not None and getattr(msg, "writer", None) != m.writer:
                continue
            self._match_left[i] -= 1
            return m.action
        return None

    def abort_at(self, room: int, phase: str) -> bool:
        """True once for a (room, phase) the scenario aborts (then forgotten)."""
        key = (room, phase)
        if key in self._aborts:
            self._aborts.discard(key)
            self.count(f"abort:{phase}")
            return True
        return False

    def scatter_stall_s(self, room: int, chunk: int) -> float:
        stall = self._stalls.pop((room, chunk), 0.0)
        if stall:
            self.count("stall_scatter")
        return stall

    def scatter_delay_s(self, room: int, chunk: int) -> float:
        """How late the scatter (or slice check) of (room, chunk) starts: once, then 0."""
        delay = self._late_scatters.pop((room, chunk), 0.0)
        if delay:
            self.count("late_scatter")
        return delay

    def session_delay_s(self, prefill_rank: int) -> float:
        delay = self._late.get(prefill_rank, 0.0)
        if delay:
            self.count("late_session")
        return delay
