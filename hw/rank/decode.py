"""A decode rank process: the staging ring's memory, scatters and byte verification.

With transfer.verify_writes = "mac" (the default) or "checksum", a scatter first copies
its staging region out of the ring (registered memory, which the engines can write at
any time), checks each writer block of the copy against the tag its writer sent in
CHUNK_READY (hw/rank/writemac.py), and scatters the copy only if every block matches: bytes
that came any other way never reach the KV cache, and the room fails. On the slice
path (and for OVERSIZED chunks) each writer block is checked in the KV pages it landed
in (CheckSlice) before its chunk counts as complete."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any

import torch

from kvstage.hw.control.plane import rank_name
from kvstage.hw.control.rendezvous import RankInfo
from kvstage.hw.rank.cipher import cipher_key, xor_keystream
from kvstage.hw.rank.kernels import (
    fused_tag_possible,
    gather,
    gather_hashed,
    scatter,
    scatter_hashed,
    wait_for_stream,
)
from kvstage.hw.rank.kvpool import verify
from kvstage.hw.rank.process import RankProcess
from kvstage.hw.rank.writemac import block_tag, digest_tag, tag_and_copy, tag_key
from kvstage.shared.events import CheckSlice, Scatter, ScatterDone, SliceChecked, Verify, VerifyDone
from kvstage.shared.layout import StagingLayout

log = logging.getLogger("kvstage.hw.rank.process")

# [A] How long a block that fails its write tag is re-checked, on an engine whose write
# completion is not the peer's (`Transport.lands_on_completion`), before it is rejected:
# the time the peer's engine thread may wait for a core on a loaded host, with room to
# spare under the 30 s room deadline; a rejected write is reported this much later
LANDING_GRACE_S = 1.0


class DecodeRank(RankProcess):
    role = "decode"

    def __init__(self, scenario, rank: int, rendezvous: str, **kw) -> None:
        super().__init__(scenario, rank, rendezvous, **kw)
        # Scatters and verifications run on one worker thread, in order (a stream): the
        # loop keeps answering messages meanwhile (torch releases the GIL in its kernels).
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.name}-copy")
        self.jobs: deque[tuple[Future, Scatter | CheckSlice | Verify]] = deque()
        self.bytes_verified = 0
        self.bytes_wrong = 0
        self.rooms_verified = 0
        self.wrong_rooms: list[int] = []
        self.verify_writes = scenario.transfer.verify_writes  # "none": nothing checked
        self.encrypt_writes = scenario.transfer.encrypt_writes  # "none": plaintext in the ring
        self.bytes_decrypted = 0
        self.writes_rejected = 0  # regions or slices whose write tag failed: not used
        self.bytes_checksummed = 0
        self.bytes_hashed_in_moves = 0  # of them, hashed by the scatter or gather itself
        self.late_landings = 0  # checks that passed only on a re-check (`_checked`)

    def _register_memory(self) -> None:
        """The staging ring, and the KV pool only where a peer's write lands in it: on
        the slice path, or where a full chunk is larger than the ring (an OVERSIZED chunk
        takes the slice path). Registered memory is open to whoever reaches the engine's
        port (Mooncake's listen on every address, unauthenticated: docs/hardware-mode.md),
        so on the staging path only the ring is, and transfer.verify_writes checks what
        lands there before it reaches the KV cache."""
        s = self.s
        self.ring_buf = torch.zeros(max(1, s.pool_bytes), dtype=torch.uint8, device=self.device)
        self.transport.register(self.ring_buf)
        if s.transfer.path == "slice" or self.g.chunk_bytes() > s.pool_bytes:
            self.transport.register(self.pool.tensor)

    def _rank_extra(self) -> dict[str, Any]:
        return {**super()._rank_extra(), "ring_addr": int(self.ring_buf.data_ptr())}

    def _connect_peers(self, table: dict[str, RankInfo]) -> None:
        for p in self.sessions.all_writers(self.rank):  # the sessions of every prefill instance
            info = table[rank_name("prefill", p)]
            self.control.connect(info.name, info.control, info.identity)

    # --- scatter ---------------------------------------------------------------------------
    def scatter_layout(self, num_pages: int) -> StagingLayout:
        """Where each writer block of a chunk lands (the shared layout)."""
        return self.g.staging_layout(self.local, num_pages)

    def _submit(self, job, a: Scatter | CheckSlice | Verify) -> None:
        future = self.worker.submit(job, a)
        future.add_done_callback(self._wake)  # the loop sleeps until then
        self.jobs.append((future, a))

    def _writer_keys(self, a: Scatter | CheckSlice, derive) -> dict[int, bytes]:
        """`derive(pair key)` for each writer of `a`, made on the loop thread: the control
        plane is its own."""
        return {
            p: derive(self.control.pair_key(rank_name("prefill", p), to_peer=False))
            for _, p, _, _ in a.checksums
        }

    def _tag_keys(self, a: Scatter | CheckSlice) -> dict[int, bytes] | None:
        """The tag key of each writer of `a` (None: verify_writes = "none")."""
        if self.verify_writes == "none":
            return None
        return self._writer_keys(a, partial(tag_key, self.verify_writes))

    def _scatter(self, a: Scatter) -> None:
        seals = None if self.encrypt_writes == "none" else self._writer_keys(a, cipher_key)
        scatter_job = partial(self._scatter_job, keys=self._tag_keys(a), seals=seals)
        job = self.job_cpu.wrap("scatter", scatter_job, a.nbytes)
        self._submit(job, a)

    def _block_rejected(self, a: Scatter | CheckSlice, b, tag_of) -> str:
        """Why writer block `b` (a WriterBlock) fails its writer's tag ('' if it passes):
        `tag_of(prefill_rank, nonce)` computes the tag of the block's bytes as this rank
        uses them (a private copy, or the pass that moves them)."""
        tags = {w: (p, t, n) for w, p, t, n in a.checksums}
        p, want, nonce = tags.get(b.writer, (b.prefill_rank, 0, 0))
        if not want:
            return f"writer {b.writer} (prefill rank {p}) sent no write tag"
        got = tag_of(p, nonce)
        self.bytes_checksummed += b.nbytes
        if got != want:
            return (
                f"block of writer {b.writer} (prefill rank {p}, {b.nbytes} bytes) does not "
                f"match its write tag"
            )
        return ""

    def _checked(self, check: Callable[[], str]) -> str:
        """`check()` ('' when every block passes its write tag), run again after short
        waits, up to LANDING_GRACE_S in all, while it fails on an engine whose write
        completion does not mean the bytes landed here (`Transport.lands_on_completion`:
        Mooncake over TCP). An honest writer's late bytes pass on a re-check; bytes that
        are not its (junk, an attacker's) fail every one, and the block is rejected after
        the grace. The counters count one check."""
        counted = (self.bytes_checksummed, self.bytes_hashed_in_moves)
        start = time.monotonic()
        why, pause = check(), 0.001
        while why and not self.transport.lands_on_completion:
            left = start + LANDING_GRACE_S - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(pause, left))
            pause *= 2
            self.bytes_checksummed, self.bytes_hashed_in_moves = counted
            why = check()
            if not why:
                self.late_landings += 1
                later = time.monotonic() - start
                log.warning("%s: a write tag passed on a re-check %.3f s later", self.name, later)
        return why

    def _fused(self, *flat: torch.Tensor) -> bool:
        """The tag's hash rides in the scatter or gather itself (a CUDA pool, "mac")."""
        return self.verify_writes == "mac" and fused_tag_possible(self.pool, *flat)

    def _rejected(
        self,
        a: Scatter,
        region: torch.Tensor,
        private: torch.Tensor,
        keys: dict[int, bytes],
        seals: dict[int, bytes] | None,
    ) -> str:
        """Copy each writer block of the ring's `region` into `private` (decrypted, with
        `seals`), tagging the bytes copied, and say why one fails its writer's tag ('' if
        all pass)."""
        kind = self.verify_writes
        for b in self.scatter_layout(a.num_pages).blocks:
            src, dst = (
                region[b.offset : b.offset + b.nbytes],
                private[b.offset : b.offset + b.nbytes],
            )

            def tag_of(p: int, nonce: int, src=src, dst=dst) -> int:
                if seals is None:
                    return tag_and_copy(kind, keys[p], a.room, a.chunk, nonce, src, dst)
                xor_keystream(seals[p], a.room, a.chunk, nonce, src, dst)
                return block_tag(kind, keys[p], a.room, a.chunk, nonce, dst)

            why = self._block_rejected(a, b, tag_of)
            if why:
                return f"{why} (bytes [{b.offset}, +{b.nbytes}) of the region)"
        return ""

    def _opened(self, a: Scatter, region: torch.Tensor, seals: dict[int, bytes]) -> torch.Tensor:
        """Each writer block of the ring's `region` decrypted into a private copy (no write
        tag: verify_writes = "none")."""
        private = torch.empty_like(region)
        nonces = {w: (p, n) for w, p, _, n in a.checksums}
        for b in self.scatter_layout(a.num_pages).blocks:
            p, nonce = nonces.get(b.writer, (b.prefill_rank, 0))
            span = slice(b.offset, b.offset + b.nbytes)
            xor_keystream(seals[p], a.room, a.chunk, nonce, region[span], private[span])
        return private

    def _scattered_rejected(
        self,
        a: Scatter,
        region: torch.Tensor,
        keys: dict[int, bytes],
        seals: dict[int, bytes] | None,
    ) -> str:
        """Scatter each writer block of the ring's `region` into the room's pages, hashing
        the bytes as they move (hw/rank/kernels.py `scatter_hashed`: each read once, so
        what is checked is what landed), and say why one fails its writer's tag ('' if
        all pass). With `seals`, each block is first decrypted into a private copy, and
        that is what is scattered. A rejected block's bytes are in the room's own pages,
        which a failed room never serves."""
        first = a.dst_page_base + a.page_start
        private = None if seals is None else torch.empty_like(region)

        def tag_of(b, p: int, nonce: int) -> int:
            block = region[b.offset : b.offset + b.nbytes]
            if private is not None:
                opened = private[b.offset : b.offset + b.nbytes]
                xor_keystream(seals[p], a.room, a.chunk, nonce, block, opened)
                block = opened
            heads = (b.heads.dst_head_start, b.heads.num_heads)
            digest = scatter_hashed(self.pool, first, a.num_pages, block, *heads, keys[p])
            self.bytes_hashed_in_moves += b.nbytes
            return digest_tag(keys[p], a.room, a.chunk, nonce, digest, b.nbytes)

        for b in self.scatter_layout(a.num_pages).blocks:
            why = self._block_rejected(a, b, partial(tag_of, b))
            if why:
                return f"{why} (bytes [{b.offset}, +{b.nbytes}) of the region)"
        return ""

    def _check_slice(self, a: CheckSlice) -> None:
        keys = self._tag_keys(a)
        nbytes = self.scatter_layout(a.num_pages).region_bytes
        check = partial(self._check_slice_job, keys=keys)
        job = self.job_cpu.wrap("check", lambda a: self._checked(partial(check, a)), nbytes)
        self._submit(job, a)

    def _check_slice_job(self, a: CheckSlice, keys: dict[int, bytes]) -> str:
        """Each writer's block as it landed in the KV pages, checked against its tag ('' if
        all pass): hashed as it is read out of the pages (a CUDA pool), else gathered
        into a private copy and tagged."""
        first = a.dst_page_base + a.page_start
        fused = self._fused()
        for b in self.scatter_layout(a.num_pages).blocks:
            heads = (b.heads.dst_head_start, b.heads.num_heads)
            if fused:

                def tag_of(p: int, nonce: int, heads=heads, n=b.nbytes) -> int:
                    digest = gather_hashed(self.pool, first, a.num_pages, *heads, keys[p])
                    self.bytes_hashed_in_moves += n
                    return digest_tag(keys[p], a.room, a.chunk, nonce, digest, n)

            else:
                block = torch.empty(b.nbytes, dtype=torch.uint8, device=self.device)
                gather(self.pool, first, a.num_pages, *heads, block)
                wait_for_stream(self.device)

                def tag_of(p: int, nonce: int, block=block) -> int:
                    return block_tag(self.verify_writes, keys[p], a.room, a.chunk, nonce, block)

            why = self._block_rejected(a, b, tag_of)
            if why:
                return why
        return ""

    def _scatter_job(
        self,
        a: Scatter,
        keys: dict[int, bytes] | None = None,
        seals: dict[int, bytes] | None = None,
    ) -> str:
        """Scatter the chunk's staging region into the room's pages: each writer block
        decrypted out of the ring (`seals`) and checked against its tag (`keys`) first,
        where they are on."""
        region = self.ring_buf[a.offset : a.offset + a.nbytes]
        if keys is not None and self._fused(region):  # checked as it is scattered
            why = self._checked(partial(self._scattered_rejected, a, region, keys, seals))
            wait_for_stream(self.device)  # finished before the runtime frees its region
            if not why and seals is not None:
                self.bytes_decrypted += a.nbytes
            return why
        if keys is not None:  # what is checked is what is scattered: a private copy
            private = torch.empty_like(region)
            why = self._checked(partial(self._rejected, a, region, private, keys, seals))
            if why:
                return why
            region = private
        elif seals is not None:
            region = self._opened(a, region, seals)
        scatter(
            self.pool,
            a.dst_page_base + a.page_start,
            a.num_pages,
            region,
            self.scatter_layout(a.num_pages),
        )
        wait_for_stream(self.device)  # finished before the runtime frees its region
        if seals is not None:
            self.bytes_decrypted += a.nbytes
        return ""

    def _verify(self, a: Verify) -> None:
        self._submit(self._verify_job, a)

    def _verify_job(self, a: Verify) -> tuple[int, int]:
        return verify(
            self.pool,
            a.first_page,
            a.num_pages,
            a.room,
            a.prefix_tokens,
            self.global_heads,
            sample=self.verify_mode == "sample",
        )

    def _progress(self) -> None:
        """Report the worker's finished jobs, in order."""
        while self.jobs and self.jobs[0][0].done():
            job, a = self.jobs.popleft()
            result = job.result()  # a failed kernel is a bug: raise it here, in the loop
            if type(a) is Scatter or type(a) is CheckSlice:
                if result:
                    self.writes_rejected += 1
                    log.warning(
                        "%s: room %d chunk %d: write rejected: %s",
                        self.name,
                        a.room,
                        a.chunk,
                        result,
                    )
                done = ScatterDone if type(a) is Scatter else SliceChecked
                self._feed(done(a.room, a.chunk, rejected=result))
                continue
            checked, wrong = result
            self.bytes_verified += checked
            self.bytes_wrong += wrong
            self.rooms_verified += 1
            if wrong:
                self.wrong_rooms.append(a.room)
            self._feed(VerifyDone(a.room))

    def close(self) -> None:
        self.worker.shutdown(wait=True, cancel_futures=True)
        super().close()

    def _report_extra(self) -> dict[str, Any]:
        return {
            "bytes_verified": self.bytes_verified,
            "bytes_wrong": self.bytes_wrong,
            "rooms_verified": self.rooms_verified,
            "wrong_rooms": self.wrong_rooms,
            "writes_rejected": self.writes_rejected,
            "bytes_checksummed": self.bytes_checksummed,
            "bytes_hashed_in_moves": self.bytes_hashed_in_moves,
            "bytes_decrypted": self.bytes_decrypted,
            "late_landings": self.late_landings,
        }

    _EXECUTORS = {
        Scatter: _scatter,
        CheckSlice: _check_slice,
        Verify: _verify,
    }
