"""RankRuntime on its own: the rank's bookkeeping, driven by hand without a driver."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstage.shared.events import (
    Arrive,
    CheckSlice,
    Forward,
    ForwardDone,
    ForwardStarted,
    Gather,
    GatherDone,
    PeerLost,
    Scatter,
    Send,
    Tick,
)
from kvstage.shared.protocol import Bootstrap, ChunkReady, StagingReq, StagingRsp
from kvstage.shared.runtime import RankRuntime
from kvstage.shared.scenario import load_scenario
from kvstage.shared.workload import Request

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "scenarios" / "faults" / "abort-mid-write.toml"  # prefill TP4 -> decode TP2


def test_room_failed_by_a_peer_before_it_arrives_frees_its_pages_on_arrival():
    """A room a prefill already asked about, failed before the decode admitted it (here:
    its other writer is declared lost), is released before its pages exist; when the
    request then arrives its pages are taken and must be given back at once, or the rank
    never settles (seen in CI: a prefill rank killed mid-run)."""
    s = load_scenario(SCENARIO)
    req = Request(room=7, arrival_s=1.0, prompt_tokens=200, prefix_tokens=16)
    rt = RankRuntime(s, "decode", 0, requests=[req], kv_pages=64)
    first, second = rt.geometry.writers(0)[:2]
    rt.handle(StagingReq(7, 0, 4, first, 0), 0.4)  # the room exists here, not yet opened
    rt.handle(PeerLost("prefill", second, "killed"), 0.5)
    assert list(rt.failures) == [7] and "gone" in rt.failures[7]
    rt.handle(Arrive(req), 1.0)
    rt.handle(Tick(), 1.0 + rt.config.abort_grace_s + 1)
    assert rt.settled, rt.holding()
    assert rt.free_kv_pages == 64  # every page back


@pytest.mark.parametrize(("path", "kind"), [("staging", Scatter), ("slice", CheckSlice)])
def test_a_late_scatter_starts_its_chunks_scatter_or_check_that_late(path, kind):
    """faults.late_scatter: the chunk's Scatter (on the slice path, with the writes
    checked, its CheckSlice) is handed out `seconds` after the chunk is complete, once;
    the completion is owed from the start, so the rank does not settle meanwhile."""
    s = load_scenario(
        SCENARIO,
        overrides=[
            "faults.abort=[]",
            f"transfer.path={path}",
            "faults.late_scatter=[{room = 7, chunk = 0, seconds = 2.5}]",
        ],
    )
    req = Request(room=7, arrival_s=1.0, prompt_tokens=200, prefix_tokens=16)
    rt = RankRuntime(s, "decode", 0, requests=[req], kv_pages=64, check_writes=True)
    writers = rt.geometry.writers(0)
    out = rt.handle(Arrive(req), 1.0)
    if path == "staging":
        for p in writers:
            out += rt.handle(StagingReq(7, 0, 4, p, 0), 1.0)
    grant = StagingRsp if path == "staging" else Bootstrap
    sent = [a.msg for a in out if type(a) is Send and type(a.msg) is grant]
    grants = {m.prefill_rank: m.nonce for m in sent}
    assert set(grants) == set(writers), out
    out = []
    for w, p in enumerate(writers):
        out += rt.handle(ChunkReady(7, 0, 0, 4, p, w, 0, checksum=1, nonce=grants[p]), 1.1)
    assert not [a for a in out if type(a) is kind]  # complete, not yet started
    assert not [a for a in rt.handle(Tick(), 3.5) if type(a) is kind]
    late = [a for a in rt.handle(Tick(), 3.6) if type(a) is kind]
    assert [(a.room, a.chunk) for a in late] == [(7, 0)]
    assert rt.plan.injected == {"late_scatter": 1}
    assert not rt.settled and "completions owed" in rt.holding()


def test_a_gather_owed_by_a_failed_room_finds_its_pages_gone_and_reports_at_once():
    """A gather handed out may wait for send-buffer space (hw/rank/prefill.py
    `waiting_gathers`). If its room fails meanwhile, the room's pages go back after the
    abort grace while the gather is still owed: the executor must not read them (seen
    in CI: a prefill rank died of `KeyError: 13` retrying such a gather). It asks
    `pages_held` first and reports the gather done at once; the rank then settles."""
    s = load_scenario(SCENARIO, overrides=["faults.abort=[]"])
    req = Request(room=7, arrival_s=1.0, prompt_tokens=200, prefix_tokens=16)
    rt = RankRuntime(s, "prefill", 0, requests=[req], kv_pages=64)
    forwards = [a for a in rt.handle(Arrive(req), 1.0) if type(a) is Forward]
    asked = []
    for f in forwards:
        out = rt.handle(ForwardStarted(f.room, f.chunk), 1.0)
        asked += [a.msg for a in out if type(a) is Send and type(a.msg) is StagingReq]
        rt.handle(ForwardDone(f.room, f.chunk, 1.0), 1.1)
    first = next(m for m in asked if m.chunk == 0)
    region = rt.geometry.region_bytes(first.num_pages)  # what the decode grants the chunk
    out = rt.handle(StagingRsp(7, 0, 0, 0, region, False, 0, 0, 5), 1.2)
    (gather,) = [a for a in out if type(a) is Gather]
    assert rt.pages_held(7)
    rt.handle(PeerLost("decode", 0, "killed"), 1.3)  # the room fails, the gather still owed
    assert rt.pages_held(7)  # quarantined for the abort grace: not handed to another room
    rt.handle(Tick(), 1.3 + rt.config.abort_grace_s + 1)
    assert not rt.pages_held(7)  # its pages went back, though the gather is still owed
    assert "gather" in rt.holding() and rt.free_kv_pages == 64
    rt.handle(GatherDone(gather.room, gather.chunk, gather.decode_rank), 20.0)
    assert rt.settled and rt.free_kv_pages == 64
