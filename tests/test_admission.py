"""Requests an engine refuses at admission (shared/admission.py), and a simulation that
stalls: the context limit, KV that can never fit (fixed prompts and a trace), the
one-line stall diagnosis."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from kvstage.analysis.workload_report import admission_warnings, trace_overrides
from kvstage.run.simrun import run_simulation
from kvstage.run.summary import simulation_summary
from kvstage.shared.admission import Limits, admit, refusal
from kvstage.shared.scenario import PRESETS, load_scenario
from kvstage.shared.workload import Request
from kvstage.sim import driver
from kvstage.sim.driver import Simulation, Stalled

REPO = Path(__file__).resolve().parents[1]
FLAGSHIP = REPO / "scenarios" / "llama3-70b-p8-d2.toml"


def test_every_preset_knows_its_context_length_and_a_scenario_takes_it():
    assert all(p.context_tokens > 0 for p in PRESETS.values())
    assert PRESETS["llama-3-70b"].context_tokens == 8192  # Llama 3: 8k
    assert PRESETS["llama-3.1-70b"].context_tokens == 131072  # Llama 3.1: 128k
    s = load_scenario(FLAGSHIP)
    assert s.model.preset == "llama-3.1-70b" and s.model.context_tokens == 131072
    # an engine started with --context-length: the scenario says so
    s = load_scenario(FLAGSHIP, ["model.context_tokens=32768"])
    assert s.model.context_tokens == 32768


def test_the_context_rule_is_the_engines():
    limits = Limits(page_size=16, context_tokens=8192)
    assert refusal(Request(0, 0.0, 8191, 0), limits) is None
    assert "context length (8192 tokens)" in refusal(Request(0, 0.0, 8192, 0), limits)
    # input + max_new_tokens reaching the context is refused too (SGLang)
    assert refusal(Request(0, 0.0, 8000, 0, output_tokens=191), limits) is None
    why = refusal(Request(0, 0.0, 8000, 0, output_tokens=192), limits)
    assert why.startswith("context: prompt + output (8000 + 192 tokens)")
    assert refusal(Request(0, 0.0, 10**6, 0), Limits(page_size=16)) is None  # no limit
    taken, refused = admit([Request(0, 0.0, 100, 0), Request(1, 0.1, 9000, 0)], limits)
    assert [r.room for r in taken] == [0] and list(refused) == [1]


def test_a_request_beyond_the_context_is_rejected_and_counted_the_rest_served():
    # Llama-3-70B (8k) with lognormal prompts around 8k: some are longer
    s = load_scenario(FLAGSHIP, ['model.preset="llama-3-70b"', "workload.requests=12"])
    result = Simulation(s).run()
    summary = simulation_summary(s, result)
    long = {r.room for r in result.requests if r.prompt_tokens >= 8192}
    assert long and long != {r.room for r in result.requests}  # both kinds, or no test
    assert set(result.rejected) == long
    assert summary["requests_rejected"] == len(long)
    assert summary["rejected"] == {
        "context: the prompt (# tokens) is not shorter than the model's context length "
        "(# tokens)": len(long)
    }
    assert summary["requests_done"] == 12 - len(long) and summary["requests_failed"] == 0
    assert summary["requests"] == 12
    # no rank ever saw a rejected room
    assert not {rec.room for rec in result.records} & long
    # validate warns before anything runs, with the count
    lines = admission_warnings(s)
    assert lines[0] == (
        f"warning: {len(long)} of 12 requests would be rejected at admission, by reason:"
    )


def test_validate_warns_when_the_distribution_can_reach_the_context():
    sets = ['model.preset="llama-3-70b"', 'workload.prompt="uniform"', "workload.requests=1"]
    sets += ["workload.prompt_min=1024", "workload.prompt_max=8192"]
    s = load_scenario(FLAGSHIP, sets)
    assert s.workload.requests == 1
    lines = admission_warnings(s)
    # this seed's one prompt is shorter than 8192, but the distribution reaches it
    assert len(lines) == 1 and "can draw prompts up to 8192 tokens" in lines[0], lines
    assert admission_warnings(load_scenario(FLAGSHIP)) == []


def test_kv_that_never_fits_a_decode_rank_is_rejected_and_the_run_goes_on():
    # the case: 100k tokens of Llama-3.1-70B on a TP2 decode of 80 GB GPUs
    s = load_scenario(
        FLAGSHIP,
        ['workload.prompt="fixed"', "workload.prompt_tokens=100000", "workload.requests=2"],
    )
    result = Simulation(s).run()
    assert result.ok and result.rooms_done == 0 and len(result.rejected) == 2
    assert all(
        why.startswith(
            "KV pool: the request's KV (6250 pages of 16 tokens) is larger than a "
            "decode rank's KV pool"
        )
        for why in result.rejected.values()
    )


def write_trace(tmp_path: Path, lengths: list[int]) -> Path:
    rows = [
        {"timestamp": 500 * i, "input_length": n, "output_length": 0, "hash_ids": [i]}
        for i, n in enumerate(lengths)
    ]
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_flagship_on_a_long_prompt_trace_ends_every_request(tmp_path: Path):
    trace = write_trace(tmp_path, [4000, 121000, 6000, 90000, 2000])
    # the flagship sets its own arrivals and prompts: the trace's are asked for
    sets = [f'workload.trace="{trace}"', 'workload.arrival="trace"', 'workload.prompt="trace"']
    s = load_scenario(FLAGSHIP, sets)
    result = Simulation(s).run()
    summary = simulation_summary(s, result)
    assert result.ok and sorted(result.rejected) == [1, 3]
    assert summary["requests_done"] == 3 and summary["requests_rejected"] == 2
    assert summary["requests"] == 5


def test_a_stalled_simulation_ends_in_one_line_naming_what_waits(monkeypatch, tmp_path):
    # without admission the 100k request waits for pages forever: the stall the issue met
    monkeypatch.setattr(driver, "engine_limits", lambda s, *a, **k: Limits(page_size=16))
    s = load_scenario(
        FLAGSHIP,
        ['workload.prompt="fixed"', "workload.prompt_tokens=100000", "workload.requests=1"],
    )
    with pytest.raises(Stalled) as info:
        Simulation(s).run()
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("the simulation stalled at ")
    assert "decode0: " in message and "decode1: " in message
    assert "rooms (0) waiting for KV pages (room 0 first, needing 6250, 2546 of 2546 free)" in (
        message
    ), message
    console = Console(record=True, width=80)
    code = run_simulation(s, out=tmp_path / "run", progress=False, console=console)
    out = console.export_text(styles=False).strip().splitlines()
    assert code == 1 and len(out) == 1 and out[0].startswith("error: the simulation stalled")


def test_validate_notes_the_parts_of_a_trace_the_scenario_replaces(tmp_path: Path):
    trace = write_trace(tmp_path, [1000, 2000])
    # the flagship sets its own arrivals and prompts
    notes = trace_overrides(load_scenario(FLAGSHIP, [f'workload.trace="{trace}"']))
    assert [n.split(" replaces")[0] for n in notes] == [
        "note: workload.arrival = 'poisson'",
        "note: workload.prompt = 'lognormal'",
    ]
    sets = [f'workload.trace="{trace}"', 'workload.arrival="trace"', 'workload.prompt="trace"']
    assert trace_overrides(load_scenario(FLAGSHIP, sets)) == []
