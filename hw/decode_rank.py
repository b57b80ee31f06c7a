"""A decode rank process: the staging ring's memory, scatters and byte verification."""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from kvstage.hw.control import RankInfo, rank_name
from kvstage.hw.kernels import scatter
from kvstage.hw.kvpool import verify
from kvstage.hw.rank import RankProcess
from kvstage.shared.events import Scatter, ScatterDone, Verify, VerifyDone
from kvstage.shared.layout import StagingLayout


class DecodeRank(RankProcess):
    role = "decode"

    def __init__(self, scenario, rank: int, rendezvous: str, **kw) -> None:
        super().__init__(scenario, rank, rendezvous, **kw)
        self.ring_buf = torch.zeros(max(1, scenario.pool_bytes), dtype=torch.uint8, device=self.device)
        self.transport.register(self.ring_buf)
        self.to_verify: deque[Verify] = deque()
        self.bytes_verified = 0
        self.bytes_wrong = 0
        self.rooms_verified = 0
        self.wrong_rooms: list[int] = []

    def _rank_extra(self) -> dict[str, Any]:
        return {**super()._rank_extra(), "ring_addr": int(self.ring_buf.data_ptr())}

    def _connect_peers(self, table: dict[str, RankInfo]) -> None:
        for p in self.g.writers(self.rank):
            info = table[rank_name("prefill", p)]
            self.control.connect(info.name, info.control)

    # --- scatter ---------------------------------------------------------------------------
    def scatter_layout(self, num_pages: int) -> StagingLayout:
        """Where each writer block of a chunk lands (the shared layout)."""
        return self.g.staging_layout(self.rank, num_pages)

    def _scatter(self, a: Scatter) -> None:
        region = self.ring_buf[a.offset : a.offset + a.nbytes]
        scatter(self.pool, a.dst_page_base + a.page_start, a.num_pages, region, self.scatter_layout(a.num_pages))
        if self.on_cuda:
            torch.cuda.synchronize(self.device)
        self._feed(ScatterDone(a.room, a.chunk))

    # --- verification (when the loop is idle, so it never delays the protocol) -----------------
    def _verify(self, a: Verify) -> None:
        self.to_verify.append(a)

    def _has_idle_work(self) -> bool:
        return bool(self.to_verify)

    def _idle_work(self, had_messages: bool) -> None:
        if not self.to_verify or had_messages:
            return
        a = self.to_verify.popleft()
        checked, wrong = verify(self.pool, a.first_page, a.num_pages, a.room, a.prefix_tokens, self.global_heads,
                                sample=self.verify_mode == "sample")
        self.bytes_verified += checked
        self.bytes_wrong += wrong
        self.rooms_verified += 1
        if wrong:
            self.wrong_rooms.append(a.room)
        self._feed(VerifyDone(a.room))

    def _report_extra(self) -> dict[str, Any]:
        return {
            "bytes_verified": self.bytes_verified,
            "bytes_wrong": self.bytes_wrong,
            "rooms_verified": self.rooms_verified,
            "wrong_rooms": self.wrong_rooms,
        }

    _EXECUTORS = {
        Scatter: _scatter,
        Verify: _verify,
    }
