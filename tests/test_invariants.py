"""The invariant checker catches deliberately broken protocols (it has teeth)."""

from __future__ import annotations

from protocol_harness import World

from shared import decode as decode_mod
from shared import prefill as prefill_mod
from shared.invariants import check_records
from shared.layout import Geometry


def _run(seed=0, rooms=5, pool_chunks=1, P=4, D=1):
    g = Geometry(P, D, 8, layers=2, head_dim=4, dtype_bytes=2, page_size=4, chunked_prefill_size=16)
    w = World(g, pool_bytes=g.chunk_bytes() * pool_chunks, seed=seed)
    for room in range(rooms):
        w.open_room(room, prompt_tokens=37 + 13 * room)
    w.run()
    return w


def test_clean_run_has_no_violation():
    w = _run()
    assert check_records(w.records) == []


def test_ignoring_the_watermark_breaks_safety(monkeypatch):
    monkeypatch.setattr(prefill_mod, "is_ready", lambda *a: True)
    found = [v for s in range(3) for v in check_records(_run(seed=s).records)]
    assert any(v.invariant == "safety" for v in found)
    assert "overlaps live data" in found[0].format() or "lived until" in found[0].format()


def test_leaked_region_is_reported(monkeypatch):
    real_free = decode_mod.DecodeMachine._free

    def leaky_free(self, room, chunk, alloc_id, now, out):
        if (room, chunk) != (2, 1):
            real_free(self, room, chunk, alloc_id, now, out)

    monkeypatch.setattr(decode_mod.DecodeMachine, "_free", leaky_free)
    # the leak pins the watermark: with a one-chunk pool nothing after it can be written
    found = check_records(_run(pool_chunks=1).records)
    kinds = {v.invariant for v in found}
    assert {"no_leak", "liveness"} <= kinds
    # with a big pool everything finishes, but the ring is not empty at the end
    found = check_records(_run(pool_chunks=50).records)
    assert [v.invariant for v in found] == ["no_leak"]
