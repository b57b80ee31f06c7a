"""The sans-I/O state machine of one decode rank: staging ring owner and fan-in.

A room's state is created by whichever comes first, the local OpenRoom or a
writer's message, so clock skew between processes cannot lose a request. A chunk
is scattered exactly once, when all its writers arrived (counted by identity), and
its region is freed only after the scatter completed. A room is done when it was
opened, every writer said done and every chunk was scattered (or, on the slice
path, landed), in any arrival order. A chunk's state is a `DecodeChunk`; its legal
moves are `DECODE_TRANSITIONS` (any other raises `LocalProtocolError`):

    COLLECTING (writers arriving) -> SCATTERING -> COMPLETE
    COLLECTING -> COMPLETE (slice path or OVERSIZED: the bytes are already in the pool)

A writer the driver declares lost (PeerLost) fails every live room that needs it, and
every later one when it opens; its staging regions are released as for any failed
room (quarantined until the other writers confirm, a scatter's region when it ends),
so nothing of a dead writer's rooms stays in the ring. A lost prefill rank that
restarts rejoins as a new incarnation (PeerRejoined): which rooms it serves is one
number, `first_room`, the first room that had not arrived here when this rank learnt
of the rejoin. Rooms before it are the lost incarnation's and stay so: those that
failed stay failed (each room ends exactly once), one still waiting for it fails as
PeerLost fails it (the rejoin came before the loss was detected), and one that opens
later fails at once; the new incarnation is neither aborted to nor waited for about
them (it never knew them). Rooms from `first_room` on open with it and finish. A loss
of an incarnation older than the one that rejoined is stale and ignored.
"""

from __future__ import annotations

import math

from kvstage.shared.capability import Capabilities
from kvstage.shared.cluster import Sessions
from kvstage.shared.decode_state import (
    MAX_EARLY_REQS,
    DecodeChunk,
    DecodeRoom,
    InFlightScatter,
    Quarantine,
    chunk_state,
    move_chunk,
)
from kvstage.shared.events import (
    AbortRoom,
    Action,
    CheckSlice,
    Event,
    OpenRoom,
    PeerLost,
    PeerRejoined,
    ReleaseRoom,
    RoomDone,
    RoomFailed,
    Scatter,
    ScatterDone,
    Send,
    SliceChecked,
    Tick,
)
from kvstage.shared.layout import Geometry, LayoutError, room_pages
from kvstage.shared.machine import MachineBase, ProtocolConfig, TransferPath
from kvstage.shared.protocol import (
    Abort,
    Bootstrap,
    ChunkReady,
    DoneAck,
    ReadyAck,
    StagingReq,
    StagingRsp,
    Watermark,
    WriterDone,
)
from kvstage.shared.ring import StagingRing, WatermarkPos


class DecodeMachine(MachineBase):
    role = "decode"
    peer_role = "prefill"

    def __init__(
        self,
        rank: int,
        geometry: Geometry,
        pool_bytes: int,
        config: ProtocolConfig | None = None,
        sessions: Sessions | None = None,
        capabilities: Capabilities | None = None,
    ) -> None:
        super().__init__(rank, geometry, config or ProtocolConfig())
        # the nonces this rank hands its writers and checks in their answers
        self.caps = capabilities or Capabilities.for_simulation(rank)
        # rank is global (instance * TP + local rank); one instance: the local rank
        self.sessions = sessions or Sessions(geometry)
        if not 0 <= rank < self.sessions.decode_ranks:
            raise ValueError(f"decode rank {rank} out of range 0..{self.sessions.decode_ranks - 1}")
        self.ring = StagingRing(pool_bytes)
        # every session that may write here, over all prefill instances sharing the ring
        self._all_writers = frozenset(self.sessions.all_writers(rank))
        self._rooms: dict[int, DecodeRoom] = {}
        # Prefill ranks told of every watermark move, in order: those with a live room
        # here. A rank whose last room here ended is dropped, so that a ring shared by
        # many prefill instances (a load-aware router) does not send each move to every
        # session it ever saw; its next STAGING_REQ subscribes it again with the
        # current watermark.
        self._subscribers: dict[int, None] = {}
        self._live_rooms_of: dict[int, int] = {}  # prefill rank -> live rooms it writes here
        self._scatters: dict[tuple[int, int], InFlightScatter] = {}
        # slice-path chunks being checked against their write tags: (room, chunk) -> since
        self._checks: dict[tuple[int, int], float] = {}
        self._last_wm = self.ring.watermark
        self._ring_changed = False  # an assign or free since the last watermark check
        self._region_cache: dict[int, int] = {}
        # failed rooms whose staging regions and KV pages are kept out of reuse
        self._quarantine: dict[int, Quarantine] = {}
        # since when a fenced writer's regions are quarantined (None: none are): room
        # clocks stop meanwhile
        self._fenced_since: float | None = None
        self.scatters_issued = 0
        self.writes_rejected = 0  # staging regions that failed their write checksum
        # writers that were lost and rejoined as a new incarnation: (role, rank) ->
        # (incarnation, first room it serves); rooms before it stay the lost one's
        self._rejoined: dict[tuple[str, int], tuple[int, int]] = {}
        self._incarnation: dict[tuple[str, int], int] = {}  # the newest incarnation known

    # --- public -------------------------------------------------------------------------
    @property
    def live_rooms(self) -> int:
        return len(self._rooms)

    @property
    def settled(self) -> bool:
        """No room live, no scatter running, no failed room's regions quarantined."""
        return not self._rooms and not self._quarantine and not self._scatters and not self._checks

    def holding(self) -> list[str]:
        """What keeps the machine from being settled, in words."""
        out = [f"room {r} live" for r in sorted(self._rooms)[:5]]
        out += [
            f"room {r} quarantined until {q.until:.2f}s (waiting for prefill {sorted(q.waiting)})"
            for r, q in sorted(self._quarantine.items())[:5]
        ]
        out += [f"scatter {k} since {f.start:.2f}s" for k, f in sorted(self._scatters.items())[:5]]
        out += [f"check of {k} since {t:.2f}s" for k, t in sorted(self._checks.items())[:5]]
        return out

    def handle(self, event: Event, now: float) -> list[Action]:
        out: list[Action] = []
        handler = self._HANDLERS.get(type(event))
        if handler is None:
            self._drop(out, now, f"decode cannot handle {type(event).__name__}")
        else:
            handler(self, event, now, out)
        if self._deadline_due(now):
            self._fire_timeouts(now, out)
        if self._ring_changed:
            self._broadcast_if_moved(now, out)
        return out

    # --- local events -------------------------------------------------------------------
    def _on_open(self, ev: OpenRoom, now: float, out: list[Action]) -> None:
        if self.is_finished(ev.room):
            self._drop(out, now, "OpenRoom for a finished room", ev.room)
            return
        room = self._rooms.get(ev.room)
        if room is not None and room.chunks is not None:
            self._drop(out, now, "room opened twice", ev.room)
            return
        try:
            pages = room_pages(ev.prompt_tokens, ev.prefix_tokens, self.geometry.page_size)
        except LayoutError as exc:
            if room is None:
                room = self._new_room(ev.room, now)
            self._fail(room, str(exc), now, out)
            return
        if room is None:
            room = self._new_room(ev.room, now)
        else:  # made by a message before the open: its timeout runs from now
            room.deadline = self._arm_deadline(ev.room, now)
        dead_writers = [
            (r, k) for (r, k) in self.dead_peers if k in room.writers and self._gone_for(k, ev.room)
        ]
        if dead_writers:
            dead = ", ".join(f"{r}{k}" for (r, k) in dead_writers)
            self._fail(room, f"decode rank {self.rank}: writer {dead} is gone", now, out)
            return
        room.chunks = self.geometry.chunks(pages)
        room.dst_page_base = ev.dst_page_base
        self._record(out, "room_open", now, now, room=ev.room, chunk=len(room.chunks))
        for p in room.writers:
            out.append(Send(self._peer(p), self._bootstrap(room, p)))
        self._arm_deadline(ev.room, now, self.config.retry_s)  # BOOTSTRAP re-sends
        # What came before the open is handled now, checked against the room's grid.
        early, room.early = room.early, []
        for msg in early:
            self._HANDLERS[type(msg)](self, msg, now, out)
            if room.room not in self._rooms:
                return  # a bad early message cannot fail the room; but a done room ends here
        self._maybe_done(room, now, out)

    def _on_scatter_done(self, ev: ScatterDone, now: float, out: list[Action]) -> None:
        flight = self._scatters.pop((ev.room, ev.chunk), None)
        if flight is None:
            self._drop(out, now, "ScatterDone for no scatter in flight", ev.room, ev.chunk)
            return
        alloc = self.ring.get(flight.alloc_id)
        self._record(
            out,
            "scatter",
            flight.start,
            now,
            room=ev.room,
            chunk=ev.chunk,
            offset=alloc.offset if alloc else -1,
            bytes=alloc.nbytes if alloc else 0,
        )
        self._free(ev.room, ev.chunk, flight.alloc_id, now, out)
        if ev.rejected:
            self.writes_rejected += 1
        room = self._rooms.get(ev.room)
        if room is None:
            return  # the room failed while its scatter ran; the region is free now
        if ev.rejected:  # none of it reached the KV cache: the room fails
            room.allocs.pop(ev.chunk, None)
            self._fail(room, f"chunk {ev.chunk}: write rejected: {ev.rejected}", now, out)
            return
        move_chunk(room, ev.chunk, DecodeChunk.COMPLETE)
        self._maybe_done(room, now, out)

    def _on_slice_checked(self, ev: SliceChecked, now: float, out: list[Action]) -> None:
        if self._checks.pop((ev.room, ev.chunk), None) is None:
            self._drop(out, now, "SliceChecked for no check in flight", ev.room, ev.chunk)
            return
        if ev.rejected:
            self.writes_rejected += 1
        room = self._rooms.get(ev.room)
        if room is None:
            return  # the room failed while its check ran
        if ev.rejected:  # the pages hold bytes no writer sent: the room fails
            self._fail(room, f"chunk {ev.chunk}: write rejected: {ev.rejected}", now, out)
            return
        move_chunk(room, ev.chunk, DecodeChunk.COMPLETE)
        self._maybe_done(room, now, out)

    def _on_abort_local(self, ev: AbortRoom, now: float, out: list[Action]) -> None:
        room = self._rooms.get(ev.room)
        if room is not None:
            self._fail(room, ev.reason, now, out)

    def _on_tick(self, ev: Tick, now: float, out: list[Action]) -> None:
        pass

    def _on_peer_lost(self, ev: PeerLost, now: float, out: list[Action]) -> None:
        """A writer is gone: every room needs it, so fail them and stop sending to it."""
        if ev.role != "prefill" or ev.rank not in self._all_writers:
            return
        key = (ev.role, ev.rank)
        if 0 <= ev.incarnation < self._incarnation.get(key, -1):
            return  # an earlier incarnation than the one that rejoined since: stale
        self._rejoined.pop(key, None)  # a new incarnation lost too: every room needs it
        self._lose(ev.rank, ev.reason or "lost", now, out)

    def _lose(
        self, rank: int, reason: str, now: float, out: list[Action], before: int | None = None
    ) -> None:
        """Writer `rank` is gone: fail its live rooms (those before room `before` only,
        when given) and stop sending it watermarks."""
        self.dead_peers[("prefill", rank)] = reason
        self._subscribers.pop(rank, None)
        for room in list(self._rooms.values()):
            if rank not in room.writers:
                continue  # a room of another prefill instance: it does not need this writer
            if before is not None and room.room >= before:
                continue  # the rejoining incarnation's to serve
            self._fail(
                room,
                f"writer prefill rank {rank} is gone: {reason}",
                now,
                out,
                skip_writer=rank,
                fence=True,
            )

    def _on_peer_rejoined(self, ev: PeerRejoined, now: float, out: list[Action]) -> None:
        """A lost writer rejoined as a new incarnation: rooms from `ev.first_room` on may
        open with it. Rooms before it are the lost incarnation's: those that failed stay
        failed, a room still waiting for it (the loss was not detected yet) fails now as
        PeerLost fails it, and a later one fails when it opens."""
        if ev.role != "prefill" or ev.rank not in self._all_writers:
            return
        key = (ev.role, ev.rank)
        if ev.incarnation <= self._incarnation.get(key, -1):
            return  # not newer than what rejoined already: stale or repeated
        self._incarnation[key] = ev.incarnation
        if key not in self.dead_peers or key in self._rejoined:
            # the incarnation it replaces was not declared lost (it restarted within the
            # failure detector's timeout, or a rejoined one restarted again): lost now
            self._rejoined.pop(key, None)
            self._lose(
                ev.rank,
                f"prefill rank {ev.rank} restarted as a new incarnation: its earlier "
                f"incarnation is gone",
                now,
                out,
                before=ev.first_room,
            )
        self._rejoined[key] = (ev.incarnation, ev.first_room)

    def _gone_for(self, prefill_rank: int, room: int) -> bool:
        """Whether a writer declared lost is still gone for `room` (no incarnation of
        it that rejoined serves the room)."""
        rejoined = self._rejoined.get(("prefill", prefill_rank))
        return rejoined is None or room < rejoined[1]

    def _replaced(self, prefill_rank: int, room: int) -> bool:
        """The writer rejoined as a new incarnation that does not serve `room`: nothing
        of it will ever write into the room, nor answer about it."""
        rejoined = self._rejoined.get(("prefill", prefill_rank))
        return rejoined is not None and room < rejoined[1]

    # --- messages -----------------------------------------------------------------------
    def _writer_for(self, msg, now: float, out: list[Action]) -> int | None:
        """The writer index of the message's prefill rank, or None (dropped) if not ours."""
        writers = self.sessions.writers(msg.room, self.rank)
        w = writers.index(msg.prefill_rank) if msg.prefill_rank in writers else None
        if msg.decode_rank != self.rank or w is None:
            self._drop(
                out,
                now,
                f"{type(msg).__name__} from prefill rank {msg.prefill_rank} to decode rank "
                f"{msg.decode_rank}: not a writer of room {msg.room} at decode rank {self.rank} "
                f"(writers {writers})",
                getattr(msg, "room", -1),
            )
            return None
        if hasattr(msg, "writer") and msg.writer != w:
            self._drop(
                out,
                now,
                f"{type(msg).__name__} claims writer {msg.writer} but prefill rank "
                f"{msg.prefill_rank} is writer {w}",
                msg.room,
            )
            return None
        return w

    def _live_room(self, msg, now: float, out: list[Action]) -> DecodeRoom | None:
        """The message's room, created if unknown; None if it already finished (a late
        message about a failed room is answered with the ABORT it may have missed)."""
        if self.is_finished(msg.room):
            if not self._finished[msg.room]:
                out.append(
                    Send(
                        self._peer(msg.prefill_rank),
                        self._abort(msg.room, msg.prefill_rank, "the room failed at the decode"),
                    )
                )
            elif type(msg) is ChunkReady:
                out.append(
                    Send(
                        self._peer(msg.prefill_rank),
                        ReadyAck(msg.room, msg.chunk, msg.prefill_rank, self.rank),
                    )
                )
            elif type(msg) is WriterDone:
                out.append(
                    Send(
                        self._peer(msg.prefill_rank), DoneAck(msg.room, msg.prefill_rank, self.rank)
                    )
                )
            return None
        room = self._rooms.get(msg.room)
        if room is None:
            room = self._new_room(msg.room, now, opened=False)
        return room

    def _keep_early(self, room: DecodeRoom, msg, now: float, out: list[Action]) -> bool:
        """Keep a writer's message that came before the room opened here (clock skew, or
        a KV pool that is full); False if too many are kept (then it is dropped)."""
        if len(room.early) < MAX_EARLY_REQS:
            room.early.append(msg)
            return True
        self._drop(
            out,
            now,
            f"too many messages before room {room.room} opened",
            msg.room,
            getattr(msg, "chunk", -1),
            peer=msg.prefill_rank,
        )
        return False

    def _on_req(self, msg: StagingReq, now: float, out: list[Action]) -> None:
        w = self._writer_for(msg, now, out)
        if w is None:
            return
        room = self._live_room(msg, now, out)
        if room is None:
            return
        if room.chunks is not None and (
            msg.chunk >= len(room.chunks) or room.chunks[msg.chunk].num_pages != msg.num_pages
        ):
            self._drop(
                out,
                now,
                f"STAGING_REQ chunk {msg.chunk} of {msg.num_pages} pages does not "
                f"match the room's grid ({len(room.chunks)} chunks)",
                msg.room,
                msg.chunk,
            )
            return
        if room.chunks is None:
            # Not opened here yet: answered at OpenRoom. Staging is only ever reserved
            # for rooms this rank knows, so stray or forged requests cannot pin the ring.
            self._keep_early(room, msg, now, out)
            return
        # A re-sent REQ from the same writer (not the first REQ of another writer of
        # the same chunk) means that writer may have lost our RSP or a WATERMARK.
        asked = room.asked.setdefault(msg.chunk, set())
        duplicate = w in asked
        asked.add(w)
        if msg.chunk not in room.allocs:
            room.allocs[msg.chunk] = self.ring.assign(self._region_bytes(msg.num_pages))
            self._ring_changed = True
        alloc = room.allocs[msg.chunk]
        nonce = self.caps.grant(msg.room, msg.chunk, msg.prefill_rank, alloc.id if alloc else -1)
        if alloc is None:
            rsp = StagingRsp(msg.room, msg.chunk, 0, 0, 0, True, msg.prefill_rank, self.rank, nonce)
        else:
            rsp = StagingRsp(
                msg.room,
                msg.chunk,
                alloc.offset,
                alloc.round,
                alloc.end,
                False,
                msg.prefill_rank,
                self.rank,
                nonce,
            )
        out.append(Send(self._peer(msg.prefill_rank), rsp))
        # Subscribed after the RSP: a writer back after a while would hold a watermark
        # of a round newer than any region it was handed as implausible until the RSP.
        if not self._subscribe(msg.prefill_rank, out) and duplicate:
            # a re-sent REQ means the writer may have lost our RSP or a WATERMARK
            wm = self.ring.watermark
            out.append(
                Send(
                    self._peer(msg.prefill_rank),
                    Watermark(wm.round, wm.tail, msg.prefill_rank, self.rank),
                )
            )
        self._record(
            out,
            "req",
            now,
            now,
            room=msg.room,
            chunk=msg.chunk,
            writer=w,
            peer=msg.prefill_rank,
            offset=alloc.offset if alloc else -1,
            bytes=alloc.nbytes if alloc else 0,
            ring_used=self.ring.used_bytes,
            detail="" if alloc else "oversized",
        )

    def _opened_room(
        self, msg, now: float, out: list[Action], ack
    ) -> tuple[int, DecodeRoom] | None:
        """The writer and its room for a writer's CHUNK_READY or WRITER_DONE, or None:
        not a writer of a live room, or a room not opened here yet (then the message is
        kept for the open and acknowledged with `ack`, so the writer stops re-sending)."""
        w = self._writer_for(msg, now, out)
        if w is None:
            return None
        room = self._live_room(msg, now, out)
        if room is None:
            return None
        if room.chunks is None:
            if self._keep_early(room, msg, now, out):
                out.append(Send(self._peer(msg.prefill_rank), ack))
            return None
        return w, room

    def _on_ready(self, msg: ChunkReady, now: float, out: list[Action]) -> None:
        ack = ReadyAck(msg.room, msg.chunk, msg.prefill_rank, self.rank)
        found = self._opened_room(msg, now, out, ack)
        if found is None:
            return
        w, room = found
        problem = self._implausible_ready(room, msg, w)
        if problem:
            self._drop(
                out, now, f"CHUNK_READY {problem}", msg.room, msg.chunk, peer=msg.prefill_rank
            )
            return
        out.append(Send(self._peer(msg.prefill_rank), ack))
        arrived = room.arrived.setdefault(msg.chunk, set())
        if w in arrived:
            return  # duplicate CHUNK_READY: acknowledged again, never scattered twice
        if not arrived:
            room.first_arrival[msg.chunk] = now
        arrived.add(w)
        room.checksums.setdefault(msg.chunk, {})[w] = (msg.prefill_rank, msg.checksum, msg.nonce)
        self._chunk_maybe_complete(room, msg.chunk, now, out)
        self._maybe_done(room, now, out)

    def _implausible_ready(self, room: DecodeRoom, msg: ChunkReady, w: int) -> str:
        """Why a CHUNK_READY cannot be a true one from writer `w` ('' if it can be)."""
        if not msg.chunk < len(room.chunks):
            return f"for chunk {msg.chunk} beyond the room's {len(room.chunks)} chunks"
        c = room.chunks[msg.chunk]
        if (msg.page_start, msg.num_pages) != (c.page_start, c.num_pages):
            return (
                f"pages [{msg.page_start}, +{msg.num_pages}) disagree with the chunk's "
                f"[{c.page_start}, +{c.num_pages})"
            )
        if self.config.path is TransferPath.STAGING:
            if msg.chunk not in room.allocs:
                return "for a chunk with no staging region"
            if w not in room.asked.get(msg.chunk, ()):
                return f"from writer {w}, which never asked for the chunk's region"
        if msg.nonce != self.nonce_for(ChunkReady, msg.room, msg.chunk, msg.prefill_rank):
            staging = self.config.path is TransferPath.STAGING
            handed = "region granted to it" if staging else "room, in its BOOTSTRAP"
            return f"from writer {w} does not echo the nonce of the {handed}"
        return ""

    def _on_writer_done(self, msg: WriterDone, now: float, out: list[Action]) -> None:
        if self._writer_for(msg, now, out) is None or self._unproven(msg, now, out):
            return
        ack = DoneAck(msg.room, msg.prefill_rank, self.rank)
        found = self._opened_room(msg, now, out, ack)
        if found is None:
            return
        w, room = found
        if msg.num_chunks != len(room.chunks):
            self._drop(
                out,
                now,
                f"WRITER_DONE claims {msg.num_chunks} chunks, the room has {len(room.chunks)}",
                msg.room,
                peer=msg.prefill_rank,
            )
            return
        out.append(Send(self._peer(msg.prefill_rank), ack))
        room.writers_done.setdefault(w, msg.num_chunks)
        self._maybe_done(room, now, out)

    def _on_abort_msg(self, msg: Abort, now: float, out: list[Action]) -> None:
        if self._writer_for(msg, now, out) is None or self._unproven(msg, now, out):
            return
        room = self._rooms.get(msg.room)
        if room is None and not self.is_finished(msg.room):
            # an ABORT before anything else about the room came (it failed at its writer
            # before the writer asked for a region): remembered, the room fails now
            # instead of holding its writers and pages for its whole timeout
            room = self._new_room(msg.room, now)
        if room is not None:
            self._fail(
                room,
                f"aborted by prefill rank {msg.prefill_rank}: {msg.reason}",
                now,
                out,
                skip_writer=msg.prefill_rank,
            )
        else:
            self._confirm_abort(msg.room, msg.prefill_rank, now, out)

    def _unproven(self, msg: WriterDone | Abort, now: float, out: list[Action]) -> bool:
        """A writer's WRITER_DONE or ABORT that does not echo its room nonce: dropped,
        changing nothing (it could otherwise finish, fail or release a room its sender
        was never handed). An open room's BOOTSTRAP goes back to the named writer, so
        an honest one that lost it, or failed before it came, proves itself next."""
        if msg.nonce == self.caps.room(msg.room, msg.prefill_rank):
            return False
        name = "WRITER_DONE" if type(msg) is WriterDone else "ABORT"
        self._drop(
            out,
            now,
            f"{name} from prefill rank {msg.prefill_rank} does not echo the room nonce of "
            f"its BOOTSTRAP ({'none' if not msg.nonce else 'a wrong one'})",
            msg.room,
            peer=msg.prefill_rank,
        )
        room = self._rooms.get(msg.room)
        if room is not None and room.chunks is not None:
            out.append(Send(self._peer(msg.prefill_rank), self._bootstrap(room, msg.prefill_rank)))
        return True

    def nonce_for(self, cls: type, room: int, chunk: int, prefill_rank: int) -> int:
        """The nonce an honest writer `prefill_rank` echoes in its message of type `cls`
        (CHUNK_READY, WRITER_DONE, ABORT) about `room` (and `chunk`): for a folded
        writer's mirrored messages (sim/fold.py), and the check of a CHUNK_READY. 0 for
        a chunk with no region here."""
        if cls is ChunkReady and self.config.path is TransferPath.STAGING:
            r = self._rooms.get(room)
            if r is None or chunk not in r.allocs:
                return 0
            alloc = r.allocs[chunk]
            return self.caps.grant(room, chunk, prefill_rank, alloc.id if alloc else -1)
        return self.caps.room(room, prefill_rank)

    def _bootstrap(self, room: DecodeRoom, prefill_rank: int) -> Bootstrap:
        return Bootstrap(
            room.room,
            room.dst_page_base,
            prefill_rank,
            self.rank,
            self.caps.room(room.room, prefill_rank),
        )

    def _abort(self, room: int, prefill_rank: int, reason: str) -> Abort:
        return Abort(
            room, prefill_rank, self.rank, reason[:512], self.caps.room(room, prefill_rank)
        )

    def _on_unexpected(self, msg, now: float, out: list[Action]) -> None:
        self._drop(
            out, now, f"decode does not accept {type(msg).__name__}", getattr(msg, "room", -1)
        )

    # --- fan-in and completion ------------------------------------------------------------
    def _chunk_maybe_complete(
        self, room: DecodeRoom, chunk: int, now: float, out: list[Action]
    ) -> None:
        if room.chunks is None or chunk_state(room, chunk) is not DecodeChunk.COLLECTING:
            return
        if len(room.arrived.get(chunk, ())) < len(room.writers):
            return
        c = room.chunks[chunk]
        self._record(
            out, "chunk_ready", room.first_arrival.get(chunk, now), now, room=room.room, chunk=chunk
        )
        alloc = room.allocs.get(chunk)
        tags = tuple((w, *t) for w, t in sorted(room.checksums.get(chunk, {}).items()))
        if alloc is None:  # slice path or OVERSIZED: the bytes are already in the KV pool
            if not self.config.check_slice_writes:
                move_chunk(room, chunk, DecodeChunk.COMPLETE)
                return
            move_chunk(room, chunk, DecodeChunk.SCATTERING)  # checked in place, then complete
            self._checks[(room.room, chunk)] = now
            out.append(
                CheckSlice(room.room, chunk, c.page_start, c.num_pages, room.dst_page_base, tags)
            )
            return
        move_chunk(room, chunk, DecodeChunk.SCATTERING)
        self._scatters[(room.room, chunk)] = InFlightScatter(alloc.id, now)
        self.scatters_issued += 1
        out.append(
            Scatter(
                room.room,
                chunk,
                alloc.offset,
                alloc.nbytes,
                c.page_start,
                c.num_pages,
                room.dst_page_base,
                tags,
            )
        )

    def _maybe_done(self, room: DecodeRoom, now: float, out: list[Action]) -> None:
        if room.chunks is None or len(room.writers_done) < len(room.writers):
            return
        if room.complete < len(room.chunks):
            return
        self._end_room(room)
        self._finish(room.room, ok=True)
        self._record(out, "room_done", now, now, room=room.room, ring_used=self.ring.used_bytes)
        out.append(RoomDone(room.room))
        out.append(ReleaseRoom(room.room))

    def _fail(
        self,
        room: DecodeRoom,
        reason: str,
        now: float,
        out: list[Action],
        skip_writer: int = -1,
        fence: bool = False,
    ) -> None:
        """Fail a room: release every region it holds, tell its writers.

        A region being scattered is freed when its scatter completes. The others,
        and the room's KV pages, stay quarantined until every writer confirmed the
        abort (its ABORT comes after its own in-flight writes finished) or
        `abort_grace_s` passed, so a late write cannot land on memory that was handed
        out again. A room that never opened here exposed nothing: released at once.
        `skip_writer` is not told; with `fence` (a writer declared lost: silent, not
        known dead) it is still waited for, so its memory waits out the whole grace:
        a hung writer may still write until its launcher kills it
        (PEER_TIMEOUT_S + abort_grace_s > RANK_SILENT_S, tests/test_fencing.py).
        """
        self._end_room(room)
        held = [
            (chunk, alloc.id)
            for chunk, alloc in room.allocs.items()
            if alloc is not None and chunk_state(room, chunk) is not DecodeChunk.SCATTERING
        ]
        # a writer's new incarnation knows nothing of an older room: it is not told
        told = [p for p in room.writers if p != skip_writer and not self._replaced(p, room.room)]
        waiting = set(told)
        if fence and skip_writer in room.writers:
            waiting.add(skip_writer)  # never confirms: fenced by the grace alone
        exposed = room.chunks is not None or held
        if exposed and waiting:
            until = self._arm_deadline(room.room, now, self.config.abort_grace_s)
            fenced = bool(held) and fence and skip_writer in room.writers
            self._quarantine[room.room] = Quarantine(held, waiting, until, fenced)
            if fenced and self._fenced_since is None:
                self._fenced_since = now  # the other rooms' clocks stop (_resume_clocks)
        else:
            for chunk, alloc_id in held:
                self._free(room.room, chunk, alloc_id, now, out)
        for p in told:
            out.append(Send(self._peer(p), self._abort(room.room, p, reason)))
        self._finish(room.room, ok=False)
        self._record(
            out,
            "room_failed",
            now,
            now,
            room=room.room,
            ring_used=self.ring.used_bytes,
            detail=reason,
        )
        out.append(RoomFailed(room.room, reason))
        if room.room not in self._quarantine:
            out.append(ReleaseRoom(room.room))

    def _fire_timeouts(self, now: float, out: list[Action]) -> None:
        for room_id in self._expired(now):
            room = self._rooms.get(room_id)
            if room is not None:
                if now < room.deadline:
                    self._resend_bootstrap(room, now, out)
                elif self._fenced_since is None:
                    self._fail(room, self._stall_reason(room), now, out)
                # else: its clock is stopped behind a fenced writer's regions; the
                # release of the last of them moves its deadline on (_resume_clocks)
            elif room_id in self._quarantine and now >= self._quarantine[room_id].until:
                self._release_quarantine(room_id, now, out)

    def _resend_bootstrap(self, room: DecodeRoom, now: float, out: list[Action]) -> None:
        """A writer not heard from about an open room may have lost its BOOTSTRAP (which
        the slice path and OVERSIZED chunks need): send it again, with backoff."""
        if room.chunks is None:
            return
        heard = set(room.writers_done)
        for writers in (*room.asked.values(), *room.arrived.values()):
            heard.update(writers)
        silent = [p for w, p in enumerate(room.writers) if w not in heard]
        if not silent:
            return  # every writer has spoken: it had the BOOTSTRAP, no more re-sends
        for p in silent:
            out.append(Send(self._peer(p), self._bootstrap(room, p)))
        room.retries += 1
        backoff = self.config.retry_s * (2 ** min(room.retries, self.config.max_backoff_doublings))
        if now + backoff < room.deadline:
            self._arm_deadline(room.room, now, backoff)

    def _confirm_abort(
        self, room_id: int, prefill_rank: int, now: float, out: list[Action]
    ) -> None:
        q = self._quarantine.get(room_id)
        if q is None:
            return
        q.waiting.discard(prefill_rank)
        if not q.waiting:
            self._release_quarantine(room_id, now, out)

    def _release_quarantine(self, room_id: int, now: float, out: list[Action]) -> None:
        """Every writer confirmed the abort, or the grace passed: the memory is safe."""
        q = self._quarantine.pop(room_id)
        for chunk, alloc_id in q.held:
            self._free(room_id, chunk, alloc_id, now, out)
        out.append(ReleaseRoom(room_id))
        if q.fenced and not any(x.fenced for x in self._quarantine.values()):
            self._resume_clocks(now)

    def _resume_clocks(self, now: float) -> None:
        """The last fenced writer's regions are free: every live room gets back the time
        it spent behind them (they may have held the ring's watermark back, so the rooms
        of healthy writers sharing the ring could not move). Bounded: a fence lasts
        abort_grace_s from its writer's loss."""
        since, self._fenced_since = self._fenced_since, None
        for room in self._rooms.values():
            stopped = now - max(since, room.created)
            if room.deadline != math.inf and stopped > 0:
                room.deadline += stopped
                self._arm_deadline(room.room, now, room.deadline - now)

    def _stall_reason(self, room: DecodeRoom) -> str:
        waits = []
        if room.chunks is None:
            waits.append("the room to open locally")
        else:
            missing = {}
            for c in room.chunks:
                if chunk_state(room, c.index) is DecodeChunk.COLLECTING:
                    got = room.arrived.get(c.index, set())
                    missing[c.index] = [p for w, p in enumerate(room.writers) if w not in got]
            if missing:
                first = list(missing.items())[:4]
                waits.append(
                    "CHUNK_READY from " + ", ".join(f"chunk {c}: prefill {p}" for c, p in first)
                )
            scattering = sorted(c for c, st in room.state.items() if st is DecodeChunk.SCATTERING)
            if scattering:
                waits.append(f"scatter of chunks {scattering[:8]}")
        not_done = [p for w, p in enumerate(room.writers) if w not in room.writers_done]
        if not_done:
            waits.append(f"WRITER_DONE from prefill ranks {not_done}")
        return (
            f"decode rank {self.rank}: room {room.room} timed out after {self.config.room_timeout_s}s waiting for "
            + "; ".join(waits)
        )

    # --- ring and watermark ----------------------------------------------------------------
    def _new_room(self, room_id: int, now: float, opened: bool = True) -> DecodeRoom:
        """A room, made at its open or by a writer's message before it (`opened` False).
        Only an open room's timeout runs: a message cannot start the clock of a room
        that has not arrived here (so a peer cannot time future rooms out), and the
        open arms it (`_on_open`)."""
        room = DecodeRoom(room_id, now, self.sessions.writers(room_id, self.rank))
        self._rooms[room_id] = room
        live = self._live_rooms_of
        for p in room.writers:
            live[p] = live.get(p, 0) + 1
        room.deadline = self._arm_deadline(room_id, now) if opened else math.inf
        return room

    def _free(self, room: int, chunk: int, alloc_id: int, now: float, out: list[Action]) -> None:
        alloc = self.ring.get(alloc_id)
        if alloc is None or not self.ring.free(alloc_id):
            return
        self._ring_changed = True
        wm = self.ring.watermark
        self._record(
            out,
            "free",
            now,
            now,
            room=room,
            chunk=chunk,
            offset=alloc.offset,
            bytes=alloc.nbytes,
            ring_used=self.ring.used_bytes,
            wm_round=wm.round,
            wm_tail=wm.tail,
        )

    def _end_room(self, room: DecodeRoom) -> None:
        """A room leaves the live set: a writer with no other live room here is no
        longer told of watermark moves."""
        del self._rooms[room.room]
        live = self._live_rooms_of
        for p in room.writers:
            n = live[p] - 1
            if n:
                live[p] = n
            else:
                del live[p]
                self._subscribers.pop(p, None)

    def _subscribe(self, prefill_rank: int, out: list[Action]) -> bool:
        """Tell `prefill_rank` of watermark moves from now on, starting with the
        current watermark; False if it was subscribed already."""
        if prefill_rank in self._subscribers:
            return False
        self._subscribers[prefill_rank] = None
        wm = self.ring.watermark
        out.append(
            Send(self._peer(prefill_rank), Watermark(wm.round, wm.tail, prefill_rank, self.rank))
        )
        return True

    def _broadcast_if_moved(self, now: float, out: list[Action]) -> None:
        self._ring_changed = False
        wm = self.ring.watermark
        if wm == self._last_wm:
            return
        assert wm > self._last_wm, f"watermark went backwards: {self._last_wm} -> {wm}"
        self._last_wm = wm
        for s in self._subscribers:
            out.append(Send(self._peer(s), Watermark(wm.round, wm.tail, s, self.rank)))
        self._record(
            out,
            "watermark",
            now,
            now,
            ring_used=self.ring.used_bytes,
            wm_round=wm.round,
            wm_tail=wm.tail,
        )

    def _region_bytes(self, num_pages: int) -> int:
        size = self._region_cache.get(num_pages)
        if size is None:
            size = self._region_cache[num_pages] = self.geometry.region_bytes(num_pages)
        return size

    @property
    def watermark(self) -> WatermarkPos:
        return self.ring.watermark

    _HANDLERS = {
        OpenRoom: _on_open,
        ScatterDone: _on_scatter_done,
        SliceChecked: _on_slice_checked,
        AbortRoom: _on_abort_local,
        Tick: _on_tick,
        PeerLost: _on_peer_lost,
        PeerRejoined: _on_peer_rejoined,
        StagingReq: _on_req,
        ChunkReady: _on_ready,
        WriterDone: _on_writer_done,
        Abort: _on_abort_msg,
        StagingRsp: _on_unexpected,
        ReadyAck: _on_unexpected,
        DoneAck: _on_unexpected,
        Watermark: _on_unexpected,
        Bootstrap: _on_unexpected,
    }
