"""A decode batch's steps in one event (sim/decode_batch.py `jump`) give the records of
the step-by-step loop, row for row and in the same order."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstage.shared.scenario import load_scenario
from kvstage.sim.driver import Simulation

ROOT = Path(__file__).resolve().parents[1]
P8D2 = ROOT / "scenarios" / "llama3-70b-p8-d2.toml"
P1D4 = ROOT / "scenarios" / "llama3-8b-p1-d4.toml"
# lognormal prompts and outputs drawn per request from a Mooncake-format trace would
# need a file; a Poisson workload with outputs of several lengths does the same here
GENERATE = [
    'workload.arrival="poisson"',
    "workload.rate_per_s=40",
    "workload.requests=60",
    'workload.prompt="uniform"',
    "workload.prompt_min=256",
    "workload.prompt_max=6000",
    "workload.max_prompt_tokens=8192",
    "workload.output_tokens=37",
]
CASES = {
    "one instance": (P8D2, []),
    "a slot each, one at a time": (P8D2, ["decode.max_running_requests=1"]),
    "two slots": (P8D2, ["decode.max_running_requests=2"]),
    "one output token": (P8D2, ["workload.output_tokens=1"]),
    "speculative": (
        P8D2,
        [
            'decode.speculative.method="mtp"',
            "decode.speculative.draft_tokens=3",
            "decode.speculative.accept_length=2.5",
        ],
    ),
    "instances, load-aware router": (
        P1D4,
        [
            "cluster.prefill_instances=2",
            "cluster.decode_instances=3",
            'cluster.router="least-outstanding"',
        ],
    ),
    "folded ranks": (
        P1D4,
        ["cluster.prefill_instances=2", "cluster.decode_instances=2", "cluster.fold=true"],
    ),
    "slice path": (P8D2, ['transfer.path="slice"']),
    "two-batch overlap (a step not linear in its KV)": (
        P8D2,  # a MoE model with DP attention: the all-to-all the overlap hides
        ['model.preset="mixtral-8x7b"', "decode.ep=4", "decode.two_batch_overlap=true"],
    ),
}


def _records(path: Path, sets: list[str], jump: bool) -> tuple[list, int]:
    sim = Simulation(load_scenario(path, [*GENERATE, *sets]))
    sim.batches.jump = jump
    result = sim.run()
    assert result.rooms_done == len(result.requests) and not result.violations
    return result.records, sim.batches.peak_batch


@pytest.mark.parametrize("case", sorted(CASES))
def test_steps_in_one_event_give_the_step_by_step_records(case: str) -> None:
    path, sets = CASES[case]
    steps, peak = _records(path, sets, jump=False)
    jumped, jumped_peak = _records(path, sets, jump=True)
    rows = [r for r in steps if r.phase == "decode_step"]
    assert rows or case == "one output token"  # the batch stepped (one token: none to step)
    assert jumped == steps  # every field of every record, in the same order
    assert jumped_peak == peak


def test_an_online_run_steps_one_event_a_step() -> None:
    """Tokens stream per step (sim/online.py): a plan would emit them late, so it steps."""
    from kvstage.sim.online import OnlineSimulation

    got: list[tuple[int, int, float]] = []
    sim = OnlineSimulation(
        load_scenario(P8D2, ["decode.max_running_requests=4"]), lambda *t: got.append(t)
    )
    sim.inject(2048, 5)
    sim.advance(0.001)
    sim.inject(1024, 3)
    result = sim.close()
    assert not sim.batches._rows  # no plan was made
    assert sorted((room, k) for room, k, _ in got) == [(0, k) for k in range(1, 6)] + [
        (1, k) for k in range(1, 4)
    ]
    steps = [r for r in result.records if r.phase == "decode_step"]
    ends = {r.end for r in steps}
    assert all(t in ends for room, k, t in got if k > 1)  # each token at a step's end
