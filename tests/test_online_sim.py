"""The online simulation behind `kvstage serve` (sim/online.py): requests injected as
they arrive replay the offline run."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstage.metrics.rooms import request_figures, room_latencies
from kvstage.serve.timeline import client_figures
from kvstage.shared.scenario import load_scenario
from kvstage.shared.workload import generate_requests
from kvstage.sim.driver import simulate
from kvstage.sim.online import OnlineSimulation, RequestRefused

ROOT = Path(__file__).resolve().parents[1]
P8D2 = ROOT / "scenarios" / "llama3-70b-p8-d2.toml"
# a small workload that queues at the decode: 2 slots, 6 requests 40 ms apart
SMALL = [
    "workload.arrival=fixed",
    "workload.rate_per_s=25",
    "workload.requests=6",
    'workload.prompt="uniform"',
    "workload.prompt_min=200",
    "workload.prompt_max=3000",
    "workload.output_tokens=12",
    "decode.max_running_requests=2",
]


def _online(scenario):
    tokens: dict[int, list[float]] = {}
    sim = OnlineSimulation(scenario, lambda room, k, t: tokens.setdefault(room, []).append(t))
    return sim, tokens


def test_requests_injected_online_replay_the_offline_run_exactly():
    s = load_scenario(P8D2, SMALL)
    offline = simulate(s)
    sim, tokens = _online(s)
    for req in generate_requests(s):
        sim.advance(req.arrival_s)
        assert sim.inject(req.prompt_tokens, req.output_tokens) == req.room
    online = sim.close()
    assert online.requests == offline.requests
    assert online.records == offline.records  # the same trace, row for row
    assert not online.violations
    generate = {r.room: r for r in offline.records if r.phase == "generate" and r.rank == 0}
    assert set(tokens) == set(generate) and len(generate) == 6
    rooms = room_latencies(online.records)
    for room, times in tokens.items():
        row = generate[room]
        assert len(times) == row.requests == 12 and times == sorted(times)
        assert times[0] == row.start  # the first token as the room joins the batch
        assert times[-1] == row.end  # the last ends the room's generation
        # the streamed times give kvstage's own figures (kvstage/metrics/rooms.py)
        figures = request_figures(rooms[room])
        mine = client_figures(rooms[room]["arrival"], times)
        for key in ("ttft_s", "tpot_s", "e2e_s"):
            assert mine[key] == pytest.approx(figures[key], abs=1e-12)
        assert mine["itl_s"] == pytest.approx(rooms[room]["itls"], abs=1e-12)


def test_a_request_an_engine_refuses_is_refused_with_its_reason():
    s = load_scenario(P8D2, SMALL)
    sim, _ = _online(s)
    capacity = sim.decode_model.capacity_pages
    with pytest.raises(RequestRefused, match=rf"a decode rank's KV pool \({capacity} pages\)"):
        sim.inject(capacity * s.decode.page_size * 2, 10)
    assert sim.requests == []  # nothing half-injected


def test_a_request_beyond_the_context_is_refused_as_offline():
    s = load_scenario(P8D2, [*SMALL, "model.context_tokens=4096"])
    sim, _ = _online(s)
    with pytest.raises(RequestRefused, match=r"context: the prompt \(4096 tokens\)"):
        sim.inject(4096, 10)
    with pytest.raises(RequestRefused, match=r"context: prompt \+ output \(4000 \+ 96 tokens\)"):
        sim.inject(4000, 96)
    assert sim.requests == []
    assert sim.inject(4000, 95) == 0


def test_speculative_steps_stream_their_accepted_tokens_at_once():
    spec = ['decode.speculative.method="eagle"', "decode.speculative.draft_tokens=4"]
    s = load_scenario(P8D2, [*SMALL, *spec, "decode.speculative.accept_length=2.5"])
    offline = simulate(s)
    sim, tokens = _online(s)
    for req in generate_requests(s):
        sim.advance(req.arrival_s)
        sim.inject(req.prompt_tokens, req.output_tokens)
    assert sim.close().records == offline.records
    generate = {r.room: r for r in offline.records if r.phase == "generate" and r.rank == 0}
    for room, times in tokens.items():
        assert len(times) == 12 and times == sorted(times)
        assert times[0] == generate[room].start and times[-1] == generate[room].end
        # 11 tokens after the first in ceil(11 / 2.5) = 5 steps: 2, 3, 2, 3, 1 at a time
        at = sorted(set(times[1:]))
        assert [times[1:].count(t) for t in at] == [2, 3, 2, 3, 1]
