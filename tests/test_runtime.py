"""RankRuntime on its own: the rank's bookkeeping, driven by hand without a driver."""

from __future__ import annotations

from pathlib import Path

from kvstage.shared.events import Arrive, PeerLost, Tick
from kvstage.shared.protocol import StagingReq
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
