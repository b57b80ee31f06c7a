"""The online simulation behind `kvstage serve` (sim/online.py): requests injected as
they arrive replay the offline run."""

from __future__ import annotations

from pathlib import Path

import pytest

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
    for room, times in tokens.items():
        row = generate[room]
        assert len(times) == row.requests == 12  # one token per step
        assert times == sorted(times) and times[0] > row.start
        assert times[-1] == row.end  # the last token ends the room's generation


def test_a_request_whose_kv_can_never_fit_is_refused_with_the_limit():
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
