"""Fenced writers (issue 25, item 3): a region of a failed room is reused only once no
write of its writers can still land.

A writer declared lost by the failure detector is silent, not known dead: it may be
hung and write on until its launcher kills it. So its memory at the decode stays
quarantined for the whole `abort_grace_s` after the loss, whoever else confirmed.
The timeouts are aligned so that the grace outlasts the kill:

    lost at      t + PEER_TIMEOUT_S                     (peers, shared/liveness.py)
    killed by    t + RANK_SILENT_S + one launcher turn  (hw/control/rendezvous.py, hw/launch/launcher.py)
    freed at     t + PEER_TIMEOUT_S + abort_grace_s     (shared/machine.py)

with t the writer's last sign of life, and freed > killed by KILL_MARGIN_S.
"""

from __future__ import annotations

from protocol_harness import echo

from kvstage.hw.control.rendezvous import RANK_BEAT_S, RANK_SILENT_S
from kvstage.shared.decode import DecodeMachine
from kvstage.shared.events import OpenRoom, PeerLost, RoomFailed, Tick
from kvstage.shared.layout import Geometry
from kvstage.shared.liveness import HEARTBEAT_S, PEER_TIMEOUT_S
from kvstage.shared.machine import ProtocolConfig
from kvstage.shared.protocol import ChunkReady, StagingReq

# what the kill may take after the launcher saw the rank silent: its loop turn (at most
# one rank beat, RANK_BEAT_S [C] hw/control/rendezvous.py) and the SIGKILL's delivery; and
# what the peers' detector may be late by, one heartbeat [C] shared/liveness.py.
# 1 s of margin beyond both [A].
KILL_MARGIN_S = 1.0


def test_the_grace_outlasts_the_launchers_kill():
    grace = ProtocolConfig().abort_grace_s
    freed = PEER_TIMEOUT_S + grace
    killed = RANK_SILENT_S + RANK_BEAT_S + HEARTBEAT_S
    assert freed >= killed + KILL_MARGIN_S, (freed, killed)
    # and the launcher's detector is the slower one: the peers fail the rooms first,
    # with their reason
    assert RANK_SILENT_S > PEER_TIMEOUT_S


def test_a_lost_sole_writer_is_fenced_by_the_grace():
    """P1 -> D1: the room's only writer is lost. Before, nothing was waited for and its
    regions went back to the ring at once, where a hung writer could still write."""
    g = Geometry(1, 1, 8, layers=2, head_dim=4, dtype_bytes=2, page_size=4, chunked_prefill_size=16)
    cfg = ProtocolConfig(room_timeout_s=30.0)
    m = DecodeMachine(0, g, g.chunk_bytes() * 4, cfg)
    m.handle(OpenRoom(0, prompt_tokens=32), 0.0)
    m.handle(StagingReq(0, 0, 4, 0, 0), 0.0)
    m.handle(StagingReq(0, 1, 4, 0, 0), 0.0)
    m.handle(
        echo(m, ChunkReady(0, 0, 0, 4, 0, 0, 0)), 0.1
    )  # chunk 0 scattering, chunk 1 written to
    lost_at = 3.1
    out = m.handle(PeerLost("prefill", 0, "silent for 3 s"), lost_at)
    assert any(isinstance(a, RoomFailed) for a in out)
    assert m.ring.live_count == 2
    m.handle(Tick(), lost_at + cfg.abort_grace_s - 0.01)
    assert m.ring.live_count == 2, "freed before the grace passed"
    m.handle(Tick(), lost_at + cfg.abort_grace_s)
    assert m.ring.live_count == 1  # only the region still being scattered
    assert m.live_rooms == 0
