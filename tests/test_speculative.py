"""decode.speculative: the table's checks, and a simulated room of n output tokens takes
ceil((n - 1) / accept_length) decode steps (its first token came from the prefill), its
KV growing by accept_length a step."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kvstage.metrics.rooms import room_latencies
from kvstage.shared.scenario import ScenarioError, load_scenario
from kvstage.shared.serving.decode_model import DecodeModel
from kvstage.sim.driver import simulate

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "scenarios" / "llama3-8b-p4-d2.toml"
ONE = [
    'workload.prompt="fixed"',
    "workload.prompt_tokens=1024",
    "workload.requests=1",
    "workload.output_tokens=64",
]
MTP = [
    'decode.speculative.method="mtp"',
    "decode.speculative.draft_tokens=3",
    "decode.speculative.accept_length=2.5",
]


def test_accept_length_beyond_draft_tokens_is_refused_with_both_named() -> None:
    with pytest.raises(ScenarioError) as e:
        load_scenario(BASE, [*MTP[:2], "decode.speculative.accept_length=3.5"])
    msg = str(e.value)
    assert "decode.speculative.accept_length = 3.5" in msg and "draft_tokens = 3" in msg


def test_method_and_required_fields_are_checked() -> None:
    with pytest.raises(ScenarioError, match="'mtp', 'eagle' or 'ngram'"):
        load_scenario(BASE, ['decode.speculative.method="medusa"', *MTP[1:]])
    with pytest.raises(ScenarioError, match="accept_length: missing"):
        load_scenario(BASE, MTP[:2])


def test_draft_steps_default_to_a_chain() -> None:
    s = load_scenario(BASE, MTP)
    assert s.decode.speculative.draft_steps == 2
    assert s.decode.tokens_per_step == 2.5
    assert load_scenario(BASE, [*MTP, "decode.speculative.steps=1"]).decode.speculative.steps == 1
    assert load_scenario(BASE).decode.tokens_per_step == 1.0


def _generation_s(sets: list[str]) -> tuple[float, float]:
    """(simulated generation time of the one room, the sum of its expected steps)."""
    s = load_scenario(BASE, [*ONE, *sets])
    res = simulate(s)
    room = next(iter(room_latencies(res.records).values()))
    model, a = DecodeModel(s), s.decode.tokens_per_step
    steps = math.ceil((64 - 1) / a)  # the first token comes with the KV from the prefill
    expected = sum(model.step_time_s(1024 + i * a, 1) for i in range(steps))
    return room["generate_end"] - room["generate_start"], expected


def test_a_room_takes_ceil_n_over_accept_steps() -> None:
    plain, plain_expected = _generation_s([])
    spec, spec_expected = _generation_s(MTP)
    assert plain == pytest.approx(plain_expected, rel=1e-9)
    assert spec == pytest.approx(spec_expected, rel=1e-9)  # 25 steps, not 63
