"""The sans-I/O state machine of one prefill rank.

Per room and per decode rank it writes to (a *target*), a chunk moves through the
states of `ChunkState`; `CHUNK_TRANSITIONS` is the diagram as code, and any other
move raises `LocalProtocolError`:

    WAITING (for its RSP, its forward, or the decode's pages on the slice path)
      -> WM_WAIT (placed and computed, behind the watermark) -> GATHERING
      -> GATHERING -> WRITING -> WRITTEN (CHUNK_READY sent)
      -> SLICE_WRITING (slice path, or an OVERSIZED chunk) -> WRITTEN
    WRITING / SLICE_WRITING -> FAILED (the engine reported a failed write)

When every chunk of a target was written, WRITER_DONE. A chunk in WM_WAIT waits in
a per-target heap ordered like the ring, and is re-examined only when a WATERMARK
from that decode rank moves the view: no spinning.
"""

from __future__ import annotations

import heapq

from kvstage.shared.cluster import Sessions
from kvstage.shared.events import (
    AbortRoom,
    Action,
    ChunkComputed,
    Event,
    Gather,
    GatherDone,
    OpenRoom,
    PeerLost,
    ReleaseRoom,
    RoomDone,
    RoomFailed,
    Send,
    SliceWrite,
    Tick,
    Write,
    WriteDone,
)
from kvstage.shared.layout import Geometry, HeadSlice, LayoutError, room_pages
from kvstage.shared.machine import LocalProtocolError, MachineBase, ProtocolConfig, TransferPath
from kvstage.shared.prefill_state import (
    IN_FLIGHT,
    ChunkState,
    Draining,
    LiveGrants,
    PrefillRoom,
    Target,
)
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
from kvstage.shared.ring import WatermarkPos, is_ready

# Bootstraps for rooms not yet opened here are kept, but never without bound:
# a peer sending garbage room ids must not grow memory forever.
MAX_EARLY_BOOTSTRAPS = 1 << 16


class PrefillMachine(MachineBase):
    role = "prefill"
    peer_role = "decode"

    def __init__(
        self,
        rank: int,
        geometry: Geometry,
        config: ProtocolConfig | None = None,
        pool_bytes: int | None = None,
        sessions: Sessions | None = None,
    ) -> None:
        super().__init__(rank, geometry, config or ProtocolConfig())
        # the decode's staging pool: a region outside it is not one the decode handed out
        self.pool_bytes = pool_bytes
        # rank is global (instance * TP + local rank); one instance: the local rank
        self.sessions = ss = sessions or Sessions(geometry)
        if not 0 <= rank < ss.prefill_ranks:
            raise ValueError(f"prefill rank {rank} out of range 0..{ss.prefill_ranks - 1}")
        self.local = local = ss.local("prefill", rank)
        # every decode rank this rank may write into, over all decode instances
        self.targets = ss.all_targets(rank)
        self._writer = {d: geometry.writers(d % ss.decode_tp).index(local) for d in self.targets}
        self._heads = {d: geometry.head_slice(local, d % ss.decode_tp) for d in self.targets}
        self._rooms: dict[int, PrefillRoom] = {}
        self._wm: dict[int, WatermarkPos] = {d: WatermarkPos(0, 0) for d in self.targets}
        # per decode rank: heap of (round, end, room, chunk) waiting for the watermark
        self._waiting: dict[int, list[tuple[int, int, int, int]]] = {d: [] for d in self.targets}
        # (room, decode rank) -> (dst_page_base, room nonce) of a BOOTSTRAP before the open
        self._early_boot: dict[tuple[int, int], tuple[int, int]] = {}
        self._heard: dict[int, float] = {}  # decode rank -> last time it told us something new
        self._draining: dict[int, Draining] = {}
        # the highest ring round each decode rank handed this rank: a WATERMARK past
        # round + 1 claims regions the decode never handed out, and waits until an
        # RSP makes it plausible (or forever, if it was forged)
        self._max_round: dict[int, int] = {d: 0 for d in self.targets}
        self._implausible_wm: dict[int, WatermarkPos] = {}
        # per decode rank: its regions granted here and not yet written (no true
        # watermark passes them; no true grant overlaps them in their round)
        self._live_grants: dict[int, LiveGrants] = {d: LiveGrants() for d in self.targets}
        # failed rooms whose drain grace expired with writes unconfirmed: a write that
        # completes later may have landed on a region the decode handed out again
        self._expired_drains: dict[int, set[tuple[int, int]]] = {}
        self._block_offset_cache: dict[tuple[int, int], int] = {}
        self._block_bytes_cache: dict[tuple[int, int], int] = {}

    # --- public ---------------------------------------------------------------------
    @property
    def live_rooms(self) -> int:
        return len(self._rooms)

    @property
    def settled(self) -> bool:
        """No room live and no failed room still draining its writes."""
        return not self._rooms and not self._draining

    def holding(self) -> list[str]:
        """What keeps the machine from being settled, in words."""
        out = [f"room {r} live" for r in sorted(self._rooms)[:5]]
        out += [
            f"room {r} draining until {d.until:.2f}s (pending {sorted(d.pending)[:5]})"
            for r, d in sorted(self._draining.items())[:5]
        ]
        return out

    def watermark_view(self, decode_rank: int) -> WatermarkPos:
        return self._wm[decode_rank]

    def handle(self, event: Event, now: float) -> list[Action]:
        out: list[Action] = []
        handler = self._HANDLERS.get(type(event))
        if handler is None:
            self._drop(out, now, f"prefill cannot handle {type(event).__name__}")
        else:
            handler(self, event, now, out)
        if self._deadline_due(now):
            self._fire_timeouts(now, out)
        return out

    # --- local events -----------------------------------------------------------------
    def _on_open(self, ev: OpenRoom, now: float, out: list[Action]) -> None:
        if ev.room in self._rooms or self.is_finished(ev.room):
            self._drop(out, now, "room already opened or failed before it opened", ev.room)
            return
        g = self.geometry
        targets_here = self.sessions.targets(ev.room, self.rank)
        dead = [f"{r}{k}" for (r, k) in self.dead_peers if k in targets_here]
        if dead:
            reason = f"prefill rank {self.rank}: peer {', '.join(dead)} is gone ({'; '.join(self.dead_peers.values())})"
            self._record(out, "room_failed", now, now, room=ev.room, detail=reason)
            out.append(RoomFailed(ev.room, reason))
            out.append(ReleaseRoom(ev.room))
            self._finish(ev.room, ok=False)
            return
        try:
            pages = room_pages(ev.prompt_tokens, ev.prefix_tokens, g.page_size)
        except LayoutError as exc:
            self._record(out, "room_failed", now, now, room=ev.room, detail=str(exc))
            out.append(RoomFailed(ev.room, str(exc)))
            out.append(ReleaseRoom(ev.room))
            self._finish(ev.room, ok=False)
            return
        targets = {d: Target(d, self._writer[d], self._heads[d]) for d in targets_here}
        room = PrefillRoom(ev.room, ev.prefix_tokens // g.page_size, g.chunks(pages), targets)
        self._rooms[ev.room] = room
        room.deadline = self._arm_deadline(ev.room, now)
        self._arm_deadline(ev.room, now, self.config.retry_s)  # re-requests and re-sends
        self._record(out, "room_open", now, now, room=ev.room, chunk=len(room.chunks))
        for d, t in targets.items():
            boot = self._early_boot.pop((ev.room, d), None)
            if boot is not None:
                t.dst_page_base, t.nonce = boot
            if self.config.path is TransferPath.STAGING:
                # Ask for every chunk's region now, so the decode allocates while
                # this rank is still computing the prefill forward.
                for c in room.chunks:
                    out.append(
                        Send(self._peer(d), StagingReq(ev.room, c.index, c.num_pages, self.rank, d))
                    )
                    self._record(
                        out, "req", now, now, room=ev.room, chunk=c.index, writer=t.writer, peer=d
                    )
        if not room.chunks:  # nothing to send: empty room (prompt == prefix)
            for t in targets.values():
                self._maybe_writer_done(room, t, now, out)
            if not targets:
                self._maybe_room_done(room, now, out)

    def _on_computed(self, ev: ChunkComputed, now: float, out: list[Action]) -> None:
        room = self._rooms.get(ev.room)
        if room is None or not 0 <= ev.chunk < len(room.chunks) or ev.chunk in room.computed:
            return  # room failed meanwhile, or a duplicate: nothing to do
        room.computed.add(ev.chunk)
        start = ev.start if ev.start >= 0 else now
        self._record(out, "compute", start, now, room=ev.room, chunk=ev.chunk)
        for t in room.targets.values():
            self._advance(room, t, ev.chunk, now, out)
        if not room.targets and len(room.computed) == len(room.chunks):
            # a rank no decode rank reads from (MLA with more prefill than decode
            # ranks): it computed its part of the forward, nothing to send
            self._maybe_room_done(room, now, out)

    def _on_gather_done(self, ev: GatherDone, now: float, out: list[Action]) -> None:
        t = self._target_in_flight(ev, (ChunkState.GATHERING,), now, out)
        if t is None:
            return
        room = self._rooms[ev.room]
        rsp = t.rsp[ev.chunk]
        c = room.chunks[ev.chunk]
        self._record(
            out,
            "gather",
            t.since[ev.chunk],
            now,
            room=ev.room,
            chunk=ev.chunk,
            writer=t.writer,
            peer=t.decode_rank,
            bytes=self._block_bytes(c.num_pages, t.heads),
        )
        t.move(ev.chunk, ChunkState.WRITING, now)
        offset = rsp.offset + self._block_offset(t.decode_rank, c.num_pages, t.writer)
        out.append(
            Write(
                ev.room,
                ev.chunk,
                t.decode_rank,
                t.writer,
                offset,
                self._block_bytes(c.num_pages, t.heads),
            )
        )

    def _on_write_done(self, ev: WriteDone, now: float, out: list[Action]) -> None:
        t = self._target_in_flight(ev, (ChunkState.WRITING, ChunkState.SLICE_WRITING), now, out)
        if t is None:
            return
        room = self._rooms[ev.room]
        start = t.since[ev.chunk]
        c = room.chunks[ev.chunk]
        rsp = t.rsp.get(ev.chunk)
        nbytes = self._block_bytes(c.num_pages, t.heads)
        if t.get(ev.chunk) is ChunkState.WRITING:
            offset = rsp.offset + self._block_offset(t.decode_rank, c.num_pages, t.writer)
            self._record(
                out,
                "write",
                start,
                now,
                room=ev.room,
                chunk=ev.chunk,
                writer=t.writer,
                peer=t.decode_rank,
                offset=offset,
                bytes=nbytes,
                requests=1,
            )
        else:
            self._record(
                out,
                "slice_write",
                start,
                now,
                room=ev.room,
                chunk=ev.chunk,
                writer=t.writer,
                peer=t.decode_rank,
                bytes=nbytes,
                requests=self._slice_requests(t.decode_rank, c.num_pages),
            )
        if not ev.ok:
            t.move(ev.chunk, ChunkState.FAILED, now)
            self._fail(
                room,
                f"write of chunk {ev.chunk} to decode rank {t.decode_rank} failed: {ev.error}",
                now,
                out,
            )
            return
        t.move(ev.chunk, ChunkState.WRITTEN, now)
        t.unacked[ev.chunk] = now
        if ev.checksum:
            t.checksums[ev.chunk] = ev.checksum
        out.append(Send(self._peer(t.decode_rank), self._chunk_ready(room, t, ev.chunk)))
        self._maybe_writer_done(room, t, now, out)
        self._live_grants[t.decode_rank].discard(room.room, ev.chunk)

    def _chunk_ready(self, room: PrefillRoom, t: Target, chunk: int) -> ChunkReady:
        c = room.chunks[chunk]
        rsp = t.rsp.get(chunk)
        return ChunkReady(
            room.room,
            chunk,
            c.page_start,
            c.num_pages,
            self.rank,
            t.writer,
            t.decode_rank,
            t.checksums.get(chunk, 0),
            rsp.nonce if rsp is not None else t.nonce,  # the grant's; the slice path: the room's
        )

    def _writer_done(self, room: PrefillRoom, t: Target) -> WriterDone:
        return WriterDone(room.room, len(room.chunks), self.rank, t.writer, t.decode_rank, t.nonce)

    def _target_in_flight(
        self,
        ev: GatherDone | WriteDone,
        states: tuple[ChunkState, ...],
        now: float,
        out: list[Action],
    ) -> Target | None:
        """The target of a completion, if its room is live; a completion of a failed
        room counts toward its drain. A completion in any other state is a local bug."""
        room = self._rooms.get(ev.room)
        t = room.targets.get(ev.decode_rank) if room else None
        if t is None:
            self._drained(ev.room, ev.decode_rank, ev.chunk, now, out)
            return None
        if t.get(ev.chunk) not in states:
            raise LocalProtocolError(
                f"{type(ev).__name__} for room {ev.room} chunk {ev.chunk} to decode rank {ev.decode_rank}, "
                f"which is {t.get(ev.chunk).value}"
            )
        return t

    def _on_abort_local(self, ev: AbortRoom, now: float, out: list[Action]) -> None:
        room = self._rooms.get(ev.room)
        if room is not None:
            self._fail(room, ev.reason, now, out)

    def _on_tick(self, ev: Tick, now: float, out: list[Action]) -> None:
        pass  # timeouts fire in handle()

    def _on_peer_lost(self, ev: PeerLost, now: float, out: list[Action]) -> None:
        """A decode rank we write to is gone: its rooms cannot finish; fail them now."""
        if ev.role != "decode" or ev.rank not in self._wm:
            return
        self.dead_peers[(ev.role, ev.rank)] = ev.reason or "lost"
        for room in list(self._rooms.values()):
            if ev.rank in room.targets:  # rooms of other decode instances do not need it
                self._fail(room, f"decode rank {ev.rank} is gone: {ev.reason or 'lost'}", now, out)

    # --- messages -----------------------------------------------------------------------
    def _check_peer(self, msg, now: float, out: list[Action]) -> bool:
        """The message is from a decode rank this rank writes to (for a room message:
        a decode rank of the instance that room was routed to)."""
        room = getattr(msg, "room", None)
        peers = self._wm if room is None else self.sessions.targets(room, self.rank)
        if msg.prefill_rank != self.rank or msg.decode_rank not in peers:
            self._drop(
                out,
                now,
                f"{type(msg).__name__} for prefill rank {msg.prefill_rank} from decode rank "
                f"{msg.decode_rank}: not a peer of prefill rank {self.rank}",
                getattr(msg, "room", -1),
            )
            return False
        return True

    def _on_rsp(self, msg: StagingRsp, now: float, out: list[Action]) -> None:
        if not self._check_peer(msg, now, out):
            return
        room = self._rooms.get(msg.room)
        if room is None:
            if not self.is_finished(msg.room):
                self._drop(out, now, "STAGING_RSP for an unknown room", msg.room, msg.chunk)
            return
        if not 0 <= msg.chunk < len(room.chunks):
            self._drop(out, now, f"STAGING_RSP chunk {msg.chunk} out of range", msg.room, msg.chunk)
            return
        t = room.targets[msg.decode_rank]
        if msg.chunk in t.rsp:
            return  # duplicate answer: the first one stands
        want = self.geometry.region_bytes(room.chunks[msg.chunk].num_pages)
        if not msg.oversized:
            problem = self._implausible_region(msg, want)
            if problem:
                # never written to: a peer's bad answer must not move bytes (nor fail the
                # room: the honest answer may still come, or the retry brings it)
                self._drop(
                    out, now, f"STAGING_RSP {problem}", msg.room, msg.chunk, peer=msg.decode_rank
                )
                return
            if WatermarkPos(msg.round, msg.offset) < self._wm[msg.decode_rank]:
                # a region live in a ring is never behind its watermark, whenever that
                # was sent (the head only moves on): this grant or the view is false
                self._drop(
                    out,
                    now,
                    f"STAGING_RSP region ({msg.round}, {msg.offset}) behind the watermark "
                    f"{tuple(self._wm[msg.decode_rank])}: never live",
                    msg.room,
                    msg.chunk,
                    peer=msg.decode_rank,
                )
                return
            grants = self._live_grants[msg.decode_rank]
            clash = grants.overlapping(msg.round, msg.offset, msg.end)
            if clash is not None:
                self._drop(
                    out,
                    now,
                    f"STAGING_RSP region [{msg.offset}, {msg.end}) of round {msg.round} overlaps "
                    f"[{clash[0]}, {clash[1]}), granted to this rank and not yet written",
                    msg.room,
                    msg.chunk,
                    peer=msg.decode_rank,
                )
                return
            grants.add(msg.room, msg.chunk, msg.round, msg.offset, msg.end)
            if msg.round > self._max_round[msg.decode_rank]:
                self._max_round[msg.decode_rank] = msg.round
                self._maybe_accept_watermark(msg.decode_rank, now, out)
        t.rsp[msg.chunk] = msg
        self._heard[msg.decode_rank] = now
        self._record(
            out,
            "rsp",
            now,
            now,
            room=msg.room,
            chunk=msg.chunk,
            writer=t.writer,
            peer=msg.decode_rank,
            offset=-1 if msg.oversized else msg.offset,
            bytes=0 if msg.oversized else want,
            detail="oversized" if msg.oversized else "",
        )
        self._advance(room, t, msg.chunk, now, out)

    def _implausible_region(self, msg: StagingRsp, want: int) -> str:
        """Why a region cannot be one the decode handed out for this chunk ('' if it can)."""
        if msg.end - msg.offset != want:
            return f"region of {msg.end - msg.offset} bytes, the chunk needs {want}"
        if self.pool_bytes is not None and not 0 <= msg.offset <= msg.end <= self.pool_bytes:
            return (
                f"region [{msg.offset}, {msg.end}) outside the {self.pool_bytes}-byte staging pool"
            )
        return ""

    def _on_watermark(self, msg: Watermark, now: float, out: list[Action]) -> None:
        if not self._check_peer(msg, now, out):
            return
        d = msg.decode_rank
        new = WatermarkPos(msg.round, msg.tail)
        if new <= self._wm[d]:
            return  # stale or reordered: keeping the max is only conservative
        if self.pool_bytes is not None and msg.tail > self.pool_bytes:
            self._drop(
                out,
                now,
                f"WATERMARK tail {msg.tail} beyond the {self.pool_bytes}-byte pool",
                peer=d,
            )
            return
        past = self._past_live_grant(d, new)
        if past:
            self._drop(out, now, f"WATERMARK {past}: never sent", peer=d)
            return
        if msg.round > self._max_round[d] + 1:
            # Beyond anything decode rank d handed this rank (its ring restarts a round
            # at most once past the last region it gave out): held, not applied, until
            # an RSP of that round arrives (a WATERMARK may overtake the RSP).
            held = self._implausible_wm.get(d)
            if held is None or new > held:
                self._implausible_wm[d] = new
            self._drop(
                out,
                now,
                f"WATERMARK round {msg.round} beyond round {self._max_round[d]} + 1 "
                f"handed out (held until plausible)",
                peer=d,
            )
            return
        self._apply_watermark(d, new, now, out)

    def _past_live_grant(self, d: int, new: WatermarkPos) -> str:
        """Why decode rank d cannot have sent watermark `new` whatever the order of
        delivery ('' if it can have): it passes a region d granted this rank that
        this rank has not said written. Such a region is live in d's ring (a ring
        frees a region only after its scatter, which waits for every writer's
        CHUNK_READY), and a ring's watermark is its oldest live region, or its head,
        which is never past a region placed after it."""
        oldest = self._live_grants[d].oldest()
        if oldest is not None and new > oldest:
            return (
                f"({new.round}, {new.tail}) past region ({oldest[0]}, {oldest[1]}), granted "
                f"to this rank and not yet written"
            )
        return ""

    def _maybe_accept_watermark(self, d: int, now: float, out: list[Action]) -> None:
        held = self._implausible_wm.get(d)
        if held is not None and held.round <= self._max_round[d] + 1:
            del self._implausible_wm[d]
            if held > self._wm[d] and not self._past_live_grant(d, held):
                self._apply_watermark(d, held, now, out)

    def _apply_watermark(self, d: int, new: WatermarkPos, now: float, out: list[Action]) -> None:
        self._wm[d] = new
        self._heard[d] = now
        heap = self._waiting[d]
        while heap and is_ready(heap[0][0], heap[0][1], new):
            _, _, room_id, chunk = heapq.heappop(heap)
            room = self._rooms.get(room_id)
            if room is not None:
                self._advance(room, room.targets[d], chunk, now, out)

    def _on_bootstrap(self, msg: Bootstrap, now: float, out: list[Action]) -> None:
        if not self._check_peer(msg, now, out):
            return
        room = self._rooms.get(msg.room)
        if room is None:
            if self._finished.get(msg.room) is False:
                # failed here, perhaps before the BOOTSTRAP came (so its ABORT carried
                # no room nonce, and the decode asks again): the ABORT, with the nonce
                drain = self._draining.get(msg.room)
                if drain is not None:  # sent once its in-flight writes report back
                    drain.nonces.setdefault(msg.decode_rank, msg.nonce)
                else:
                    self._send_aborts(
                        msg.room,
                        [msg.decode_rank],
                        f"the room failed at prefill rank {self.rank}",
                        out,
                        {msg.decode_rank: msg.nonce},
                    )
                return
            if self.is_finished(msg.room):
                return
            if len(self._early_boot) >= MAX_EARLY_BOOTSTRAPS:
                self._drop(out, now, "too many bootstraps for unopened rooms", msg.room)
                return
            self._early_boot[(msg.room, msg.decode_rank)] = (msg.dst_page_base, msg.nonce)
            return
        t = room.targets[msg.decode_rank]
        if t.dst_page_base is not None:
            return
        t.dst_page_base = msg.dst_page_base
        t.nonce = msg.nonce
        for c in room.chunks:
            self._advance(room, t, c.index, now, out)
        self._maybe_writer_done(room, t, now, out)

    def _on_abort_msg(self, msg: Abort, now: float, out: list[Action]) -> None:
        if not self._check_peer(msg, now, out):
            return
        reason = f"aborted by decode rank {msg.decode_rank}: {msg.reason}"
        room = self._rooms.get(msg.room)
        if room is not None:
            t = room.targets[msg.decode_rank]
            if t.nonce and msg.nonce != t.nonce:
                self._drop(
                    out,
                    now,
                    f"ABORT from decode rank {msg.decode_rank} does not carry the room nonce "
                    f"of its BOOTSTRAP",
                    msg.room,
                    peer=msg.decode_rank,
                )
                return
            t.nonce = msg.nonce
            # Our ABORT back (after in-flight writes drained) tells the decode that
            # this writer will not touch the room's regions again.
            self._fail(room, reason, now, out)
        elif not self.is_finished(msg.room):
            # Not opened here yet (still queued for the forward): remember the
            # failure so the later OpenRoom is refused instead of starting a room
            # the decode already gave up on.
            nonces = {k[1]: v[1] for k, v in self._early_boot.items() if k[0] == msg.room}
            nonces[msg.decode_rank] = msg.nonce
            self._early_boot = {k: v for k, v in self._early_boot.items() if k[0] != msg.room}
            self._finish(msg.room, ok=False)
            self._record(out, "room_failed", now, now, room=msg.room, detail=reason)
            out.append(RoomFailed(msg.room, reason))
            out.append(ReleaseRoom(msg.room))
            self._send_aborts(
                msg.room, self.sessions.targets(msg.room, self.rank), reason, out, nonces
            )
        elif msg.room not in self._draining:
            # Finished here (done, or failed with nothing in flight): confirm at once
            # that this writer will not touch the room's regions again.
            self._send_aborts(
                msg.room,
                [msg.decode_rank],
                "writer confirms: nothing in flight",
                out,
                {msg.decode_rank: msg.nonce},
            )

    def _on_ready_ack(self, msg: ReadyAck, now: float, out: list[Action]) -> None:
        if not self._check_peer(msg, now, out):
            return
        room = self._rooms.get(msg.room)
        if room is None:
            return  # late: the room ended here already
        t = room.targets[msg.decode_rank]
        if t.unacked.pop(msg.chunk, None) is not None:
            self._heard[msg.decode_rank] = now
            self._maybe_room_done(room, now, out)

    def _on_done_ack(self, msg: DoneAck, now: float, out: list[Action]) -> None:
        if not self._check_peer(msg, now, out):
            return
        room = self._rooms.get(msg.room)
        if room is None:
            return
        t = room.targets[msg.decode_rank]
        if t.done and not t.done_acked:
            t.done_acked = True
            self._heard[msg.decode_rank] = now
            self._maybe_room_done(room, now, out)

    def _on_unexpected(self, msg, now: float, out: list[Action]) -> None:
        self._drop(
            out, now, f"prefill does not accept {type(msg).__name__}", getattr(msg, "room", -1)
        )

    # --- the chunk pipeline ---------------------------------------------------------------
    def _advance(
        self, room: PrefillRoom, t: Target, chunk: int, now: float, out: list[Action]
    ) -> None:
        """Start the next step of `chunk` toward target `t` if its inputs are all there."""
        state = t.get(chunk)
        if (
            state is not ChunkState.WAITING and state is not ChunkState.WM_WAIT
        ) or chunk not in room.computed:
            return
        c = room.chunks[chunk]
        rsp = t.rsp.get(chunk)
        if self.config.path is TransferPath.STAGING and (rsp is None or not rsp.oversized):
            if rsp is None:
                return
            if not is_ready(rsp.round, rsp.end, self._wm[t.decode_rank]):
                if state is ChunkState.WAITING:
                    t.move(chunk, ChunkState.WM_WAIT, now)
                    heapq.heappush(
                        self._waiting[t.decode_rank], (rsp.round, rsp.end, room.room, chunk)
                    )
                return
            if state is ChunkState.WM_WAIT:
                wm = self._wm[t.decode_rank]
                self._record(
                    out,
                    "wm_wait",
                    t.since[chunk],
                    now,
                    room=room.room,
                    chunk=chunk,
                    writer=t.writer,
                    peer=t.decode_rank,
                    wm_round=wm.round,
                    wm_tail=wm.tail,
                )
            t.move(chunk, ChunkState.GATHERING, now)
            out.append(
                Gather(
                    room.room,
                    chunk,
                    t.decode_rank,
                    t.writer,
                    room.prefix_pages + c.page_start,
                    c.num_pages,
                    t.heads,
                    self._block_bytes(c.num_pages, t.heads),
                    rsp.nonce,
                )
            )
            return
        # Slice path, or the fallback for an OVERSIZED chunk: needs the decode's pages.
        if t.dst_page_base is None:
            return
        t.move(chunk, ChunkState.SLICE_WRITING, now)
        out.append(
            SliceWrite(
                room.room,
                chunk,
                t.decode_rank,
                t.writer,
                room.prefix_pages + c.page_start,
                c.page_start,
                c.num_pages,
                t.dst_page_base,
                t.heads,
                self._slice_requests(t.decode_rank, c.num_pages),
                self._block_bytes(c.num_pages, t.heads),
                rsp.nonce if rsp is not None else t.nonce,  # as its CHUNK_READY echoes
            )
        )

    def _maybe_writer_done(
        self, room: PrefillRoom, t: Target, now: float, out: list[Action]
    ) -> None:
        if t.done or t.written < len(room.chunks) or not t.nonce:
            return  # without the BOOTSTRAP's room nonce it would be dropped: waits for it
        t.done = True
        t.done_sent = now
        out.append(Send(self._peer(t.decode_rank), self._writer_done(room, t)))

    def _maybe_room_done(self, room: PrefillRoom, now: float, out: list[Action]) -> None:
        """Done when every decode rank confirmed every CHUNK_READY and WRITER_DONE."""
        if all(x.delivered for x in room.targets.values()):
            del self._rooms[room.room]
            self._finish(room.room, ok=True)
            self._record(out, "room_done", now, now, room=room.room)
            out.append(RoomDone(room.room))
            out.append(ReleaseRoom(room.room))

    def _fail(self, room: PrefillRoom, reason: str, now: float, out: list[Action]) -> None:
        """Fail a room here; tell its decode ranks once no gather/write of it is in flight."""
        del self._rooms[room.room]
        self._finish(room.room, ok=False)
        self._record(out, "room_failed", now, now, room=room.room, detail=reason)
        out.append(RoomFailed(room.room, reason))
        # Heap entries of the gone room are skipped when popped.
        pending = {
            (t.decode_rank, c)
            for t in room.targets.values()
            for c, st in t.state.items()
            if st in IN_FLIGHT
        }
        targets = list(room.targets)
        nonces = {d: t.nonce for d, t in room.targets.items() if t.nonce}
        if pending:
            until = self._arm_deadline(room.room, now, self.config.abort_grace_s)
            self._draining[room.room] = Draining(pending, targets, reason, until, nonces)
        else:
            self._send_aborts(room.room, targets, reason, out, nonces)
            out.append(ReleaseRoom(room.room))
        # its regions leave this rank's live grants (the decode frees them once told)
        for d, t in room.targets.items():
            for c in t.rsp:
                self._live_grants[d].discard(room.room, c)

    def _retry(self, room: PrefillRoom, now: float, out: list[Action]) -> None:
        """Re-ask for what a lost message would explain; the decode answers idempotently."""
        if any(self._heard.get(d, -1.0) > room.last_retry for d in room.targets):
            room.retries = 0  # the decode answered since our last try: not a dead link
        room.last_retry = now
        asked = False
        for t in room.targets.values():
            asked |= self._re_request(room, t, now, out)
            asked |= self._resend_unacked(room, t, now, out)
        if asked:
            room.retries += 1
        backoff = self.config.retry_s * (2 ** min(room.retries, self.config.max_backoff_doublings))
        self._arm_deadline(room.room, now, backoff)

    def _re_request(self, room: PrefillRoom, t: Target, now: float, out: list[Action]) -> bool:
        """Staging: re-send STAGING_REQ for chunks with no answer, and one for a chunk
        stuck behind the watermark (the decode answers with the current one)."""
        if self.config.path is not TransferPath.STAGING:
            return False
        missing = [c for c in room.chunks if c.index not in t.rsp]
        behind = t.chunks_in(ChunkState.WM_WAIT)
        if behind:
            missing.append(room.chunks[behind[0]])
        for c in missing:
            out.append(
                Send(
                    self._peer(t.decode_rank),
                    StagingReq(room.room, c.index, c.num_pages, self.rank, t.decode_rank),
                )
            )
            self._record(
                out,
                "req",
                now,
                now,
                room=room.room,
                chunk=c.index,
                writer=t.writer,
                peer=t.decode_rank,
                detail=f"retry {room.retries + 1}",
            )
        return bool(missing)

    def _resend_unacked(self, room: PrefillRoom, t: Target, now: float, out: list[Action]) -> bool:
        """Re-send CHUNK_READY and WRITER_DONE that were not acknowledged within retry_s."""
        due = now - self.config.retry_s
        sent = False
        for chunk, at in list(t.unacked.items()):
            if at <= due:
                t.unacked[chunk] = now
                out.append(Send(self._peer(t.decode_rank), self._chunk_ready(room, t, chunk)))
                self._record(
                    out,
                    "resend",
                    now,
                    now,
                    room=room.room,
                    chunk=chunk,
                    writer=t.writer,
                    peer=t.decode_rank,
                    detail="CHUNK_READY not acknowledged",
                )
                sent = True
        # every chunk written but the BOOTSTRAP (and its room nonce) never came: a
        # WRITER_DONE without the nonce asks the decode for it (dropped, answered)
        asks = not t.done and not t.nonce and t.written == len(room.chunks)
        if (asks or t.done and not t.done_acked) and t.done_sent <= due:
            t.done_sent = now
            out.append(Send(self._peer(t.decode_rank), self._writer_done(room, t)))
            self._record(
                out,
                "resend",
                now,
                now,
                room=room.room,
                writer=t.writer,
                peer=t.decode_rank,
                detail="WRITER_DONE waits for the BOOTSTRAP's room nonce"
                if asks
                else "WRITER_DONE not acknowledged",
            )
            sent = True
        return sent

    def _drained(
        self, room_id: int, decode_rank: int, chunk: int, now: float, out: list[Action]
    ) -> None:
        drain = self._draining.get(room_id)
        if drain is None:
            late = self._expired_drains.get(room_id)
            if late is not None and (decode_rank, chunk) in late:
                late.discard((decode_rank, chunk))
                self._record(
                    out,
                    "late_write",
                    now,
                    now,
                    room=room_id,
                    chunk=chunk,
                    peer=decode_rank,
                    detail="completed after the abort grace: its region may have been handed out again",
                )
            return
        drain.pending.discard((decode_rank, chunk))
        if not drain.pending:
            del self._draining[room_id]
            self._send_aborts(room_id, drain.targets, drain.reason, out, drain.nonces)
            out.append(ReleaseRoom(room_id))

    def _send_aborts(
        self,
        room_id: int,
        targets: list[int],
        reason: str,
        out: list[Action],
        nonces: dict[int, int] | None = None,
    ) -> None:
        """ABORT to each of `targets`, echoing its room nonce (`nonces`; 0 where this
        rank never had one: the decode then answers with its BOOTSTRAP, and the ABORT
        goes again with the nonce)."""
        nonces = nonces or {}
        for d in targets:
            out.append(
                Send(self._peer(d), Abort(room_id, self.rank, d, reason[:512], nonces.get(d, 0)))
            )

    def _fire_timeouts(self, now: float, out: list[Action]) -> None:
        for room_id in self._expired(now):
            room = self._rooms.get(room_id)
            if room is not None:
                if now >= room.deadline and not self._behind_watermark(room):
                    self._fail(room, self._stall_reason(room), now, out)
                else:
                    self._retry(room, now, out)
            elif room_id in self._draining and now >= self._draining[room_id].until:
                # writes that never reported back: give up waiting, say so
                drain = self._draining.pop(room_id)
                self._expired_drains[room_id] = set(drain.pending)
                if len(self._expired_drains) > self.config.finished_memory:
                    self._expired_drains.pop(next(iter(self._expired_drains)))
                self._send_aborts(
                    room_id,
                    drain.targets,
                    drain.reason + f" (in-flight writes {sorted(drain.pending)[:4]} unconfirmed)",
                    out,
                    drain.nonces,
                )
                out.append(ReleaseRoom(room_id))

    def _behind_watermark(self, room: PrefillRoom) -> bool:
        """A chunk of the room waits for a decode's watermark: that decode, which holds
        the ring, times the room out (its clock stops while a lost writer's regions hold
        the ring back: DecodeMachine._resume_clocks), and its ABORT ends the room here.
        Until then the re-sent STAGING_REQ asks it for the watermark, or for the ABORT of
        a room it failed; a decode that is gone is PeerLost."""
        return any(t.chunks_in(ChunkState.WM_WAIT) for t in room.targets.values())

    def _stall_reason(self, room: PrefillRoom) -> str:
        waits = []
        missing_compute = [c.index for c in room.chunks if c.index not in room.computed]
        if missing_compute:
            waits.append(f"forward of chunks {missing_compute[:8]}")
        for t in room.targets.values():
            if self.config.path is TransferPath.STAGING:
                no_rsp = [c.index for c in room.chunks if c.index not in t.rsp]
                if no_rsp:
                    waits.append(
                        f"STAGING_RSP from decode rank {t.decode_rank} for chunks {no_rsp[:8]}"
                    )
            behind = t.chunks_in(ChunkState.WM_WAIT)
            if behind:
                waits.append(
                    f"watermark of decode rank {t.decode_rank} (view {tuple(self._wm[t.decode_rank])}) for chunks {behind[:8]}"
                )
            busy = t.chunks_in(*IN_FLIGHT)
            if busy:
                waits.append(
                    f"gather/write completion of chunks {busy[:8]} to decode rank {t.decode_rank}"
                )
            if t.unacked:
                waits.append(
                    f"decode rank {t.decode_rank} to acknowledge CHUNK_READY of chunks "
                    f"{sorted(t.unacked)[:8]} (READY_ACK)"
                )
            if t.done and not t.done_acked:
                waits.append(f"decode rank {t.decode_rank} to acknowledge WRITER_DONE (DONE_ACK)")
            if t.dst_page_base is None and (
                self.config.path is TransferPath.SLICE
                or any(r.oversized for r in t.rsp.values())
                or t.written == len(room.chunks)
            ):
                waits.append(f"BOOTSTRAP from decode rank {t.decode_rank}")
        return (
            f"prefill rank {self.rank}: room {room.room} timed out after {self.config.room_timeout_s}s waiting for "
            + ("; ".join(waits) or "nothing pending (internal error)")
        )

    # --- geometry helpers (cached: hot in the simulator) -----------------------------------
    def _block_bytes(self, num_pages: int, heads: HeadSlice) -> int:
        key = (num_pages, heads.num_heads)
        nbytes = self._block_bytes_cache.get(key)
        if nbytes is None:
            tokens = num_pages * self.geometry.page_size  # this rank's layers (its stage's)
            nbytes = self.geometry.writer_block_bytes(self.local, tokens, heads.num_heads)
            self._block_bytes_cache[key] = nbytes
        return nbytes

    def _block_offset(self, decode_rank: int, num_pages: int, writer: int) -> int:
        if self.geometry.prefill_pp > 1:  # blocks of stages with unequal layers differ
            d = decode_rank % self.sessions.decode_tp
            return self.geometry.staging_layout(d, num_pages).blocks[writer].offset
        key = (decode_rank, num_pages)
        base = self._block_offset_cache.get(key)
        if base is None:
            # all blocks of a region have the same size, so offset = writer * size
            layout = self.geometry.staging_layout(decode_rank % self.sessions.decode_tp, num_pages)
            base = layout.blocks[1].offset if len(layout.blocks) > 1 else layout.blocks[0].nbytes
            self._block_offset_cache[key] = base
        return writer * base

    def _slice_requests(self, decode_rank: int, num_pages: int) -> int:
        return self.geometry.slice_requests(
            self.local, decode_rank % self.sessions.decode_tp, num_pages
        )

    _HANDLERS = {
        OpenRoom: _on_open,
        ChunkComputed: _on_computed,
        GatherDone: _on_gather_done,
        WriteDone: _on_write_done,
        AbortRoom: _on_abort_local,
        Tick: _on_tick,
        PeerLost: _on_peer_lost,
        StagingRsp: _on_rsp,
        Watermark: _on_watermark,
        Bootstrap: _on_bootstrap,
        Abort: _on_abort_msg,
        ReadyAck: _on_ready_ack,
        DoneAck: _on_done_ack,
        StagingReq: _on_unexpected,
        ChunkReady: _on_unexpected,
        WriterDone: _on_unexpected,
    }
