"""Decode-only steps in one event (kvstage/sim/colocated.py `jump`) give the colocated
engine's step-by-step results exactly: every request's record (its times and every
inter-token gap), the steps, the forwards' busy time, the peak batch, the instances'
lives."""

from __future__ import annotations

import random

import pytest
from test_plan import SCENARIO as TINY_SCENARIO
from test_plan import SLO as TINY_SLO

from kvstage.explore.autoscale import Planner
from kvstage.shared.scenario import load_scenario
from kvstage.shared.workload import Request
from kvstage.sim.colocated import colocated_scenario, simulate_colocated

FLAGSHIP = "scenarios/llama3-70b-p8-d2.toml"


def _requests(n: int, rate: float, seed: int, prompt_max: int = 6000) -> list[Request]:
    """Poisson arrivals; prompts of 200 to `prompt_max` tokens; outputs of 0, 1 and up
    to 300 tokens; a third of the prompts open with one of four shared prefixes (512-token
    blocks), so the prefix cache hits."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for room in range(n):
        t += rng.expovariate(rate)
        prompt = rng.randint(200, prompt_max)
        output = rng.choice([0, 1, rng.randint(2, 40), rng.randint(2, 300)])
        blocks = [10_000 * room + b for b in range(-(-prompt // 512))]
        if rng.random() < 1 / 3 and len(blocks) > 2:
            shared = rng.randrange(4)
            blocks[:2] = [shared * 2, shared * 2 + 1]
        out.append(Request(room, t, prompt, 0, output, tuple(blocks)))
    return out


def _flagship(tp: int, instances: int, *sets: str):
    return colocated_scenario(load_scenario(FLAGSHIP, list(sets)), tp, instances)


CASES = {
    "one instance": lambda: (_flagship(8, 1), _requests(80, 6.0, 1)),
    "three instances, least-outstanding": lambda: (
        _flagship(4, 3, 'cluster.router="least-outstanding"'),
        _requests(120, 12.0, 2),
    ),
    "two instances, round-robin": lambda: (
        _flagship(8, 2, 'cluster.router="round-robin"'),
        _requests(100, 10.0, 3),
    ),
    "two slots: requests wait for a finish": lambda: (
        _flagship(8, 1, "decode.max_running_requests=2"),
        _requests(40, 8.0, 4),
    ),
    "an engine's request cost": lambda: (
        _flagship(8, 2, "engine.preset=sglang-nixl"),
        _requests(80, 8.0, 5),
    ),
    "small chunks": lambda: (
        _flagship(8, 1, "prefill.chunked_prefill_size=256"),
        _requests(60, 4.0, 6),
    ),
}


def _same(a, b) -> None:
    assert a.rooms == b.rooms  # every time and every inter-token gap, exactly
    assert (a.steps, a.peak_batch, a.rooms_failed, a.failed_reason) == (
        b.steps,
        b.peak_batch,
        b.rooms_failed,
        b.failed_reason,
    )
    assert (a.busy_s, a.sim_time_s, a.lives) == (b.busy_s, b.sim_time_s, b.lives)


@pytest.mark.parametrize("case", list(CASES))
def test_jumped_decode_steps_give_the_step_by_step_results(case):
    s, reqs = CASES[case]()
    jumped = simulate_colocated(s, reqs)
    stepped = simulate_colocated(s, reqs, jump=False)
    _same(jumped, stepped)
    itls = [g for info in stepped.rooms.values() for g in info.get("itls", [])]
    assert len(itls) > 100  # the case decodes (steps between finishes and arrivals)
    if case.startswith("two slots"):  # the case it names: some request waited for a slot
        assert any(i["admitted"] > i["arrival"] for i in stepped.rooms.values() if "admitted" in i)


def test_a_full_kv_pool_and_an_autoscaler_give_the_same_results(tmp_path):
    """A small KV pool (admission waits for finishes) under a planner that adds and
    drains instances on the simulated clock."""
    path = tmp_path / "tiny.toml"
    path.write_text(TINY_SCENARIO + TINY_SLO)
    s = colocated_scenario(load_scenario(path, ["decode.tp=2"]), 2, 1)
    reqs = _requests(300, 8.0, 7, prompt_max=3000)

    def planner():
        return Planner(capacity_rps=3.0, startup_s=5.0, interval_s=5.0, cooldown_s=10.0,
                       arrivals=[r.arrival_s for r in reqs])  # fmt: skip

    a, b = planner(), planner()
    jumped = simulate_colocated(s, reqs, control=a, interval=a.interval_s)
    stepped = simulate_colocated(s, reqs, control=b, interval=b.interval_s, jump=False)
    _same(jumped, stepped)
    assert a.timeline == b.timeline
    assert len(stepped.lives) > 1  # the planner added an instance
    assert any(i["admitted"] > i["arrival"] for i in stepped.rooms.values() if "admitted" in i)
