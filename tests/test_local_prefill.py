"""Conditional disaggregation (`cluster.max_local_prefill_length`): short prompts are
prefilled on their decode instance, their chunks mixed into its batch's steps, and move
no KV; the rest go to a prefill instance. Dynamo's rule: remote when the uncached
prompt is longer than the limit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_decode_jump import GENERATE as JUMP_GENERATE
from test_plan import SCENARIO as TINY_SCENARIO
from test_plan import SLO as TINY_SLO

from kvstage.explore.figures import shape
from kvstage.explore.plan import plan_candidates
from kvstage.explore.screen import PREFILL, capacity
from kvstage.metrics.rooms import request_figures, room_latencies
from kvstage.shared.scenario import ScenarioError, load_scenario
from kvstage.shared.serving.decode_model import DecodeModel
from kvstage.shared.serving.mixed import mixed_step_s
from kvstage.sim.colocated import colocated_scenario
from kvstage.sim.driver import Simulation

ROOT = Path(__file__).resolve().parents[1]
P8D2 = ROOT / "scenarios" / "llama3-70b-p8-d2.toml"
P1D4 = ROOT / "scenarios" / "llama3-8b-p1-d4.toml"
KEY = "cluster.max_local_prefill_length"
GENERATE = [*JUMP_GENERATE, "workload.rate_per_s=20"]  # outputs of 37 tokens


def _run(path: Path, sets: list[str]):
    s = load_scenario(path, sets)
    r = Simulation(s).run()
    assert not r.violations, [v.format() for v in r.violations[:3]]
    return s, r, room_latencies(r.records)


@pytest.mark.parametrize(
    "value",
    ["-1", '"x"', "true", "1.5", '"none"'],
    ids=["negative", "word", "bool", "float", "none"],
)
def test_a_bad_limit_is_one_clear_error(value):
    with pytest.raises(ScenarioError) as err:
        load_scenario(P1D4, [f"{KEY}={value}"])
    text = str(err.value)
    assert KEY in text and "whole number of tokens >= 0" in text and '"off"' in text


@pytest.mark.parametrize("other", ["cluster.fold=true", "cluster.shard=true"])
def test_fold_and_shard_are_refused_with_it(other):
    with pytest.raises(ScenarioError, match="cannot be combined with fold or shard"):
        load_scenario(P1D4, [f"{KEY}=512", other, "cluster.decode_instances=2"])


def test_hardware_mode_refuses_it():
    from kvstage.hw.rank.preflight import simulated_only

    assert simulated_only(load_scenario(P1D4, [f'{KEY}="off"'])) is None
    why = simulated_only(load_scenario(P1D4, [f"{KEY}=512"]))
    assert why is not None and why.startswith(KEY) and "simulated only" in why


def test_off_is_the_default_and_changes_nothing():
    _, off, _ = _run(P1D4, [*GENERATE, f'{KEY}="off"'])
    _, default, _ = _run(P1D4, GENERATE)
    assert off.records == default.records


@pytest.mark.parametrize("limit, local", [(1024, True), (1023, False)])
def test_the_limit_is_the_uncached_prompt_dynamos_rule(limit, local):
    """A 1,024-token prompt is local at a limit of 1,024 and remote at 1,023."""
    sets = ['workload.prompt="fixed"', "workload.prompt_tokens=1024", "workload.requests=1"]
    _, r, rooms = _run(P8D2, [*sets, "workload.output_tokens=4", f"{KEY}={limit}"])
    prefill_rows = [x for x in r.records if x.role == "prefill"]
    assert (not prefill_rows) is local
    assert r.rooms_done == 1 and request_figures(rooms[0]) is not None


def test_a_local_prompt_alone_takes_its_forward_on_the_decode_gpus():
    """One request: its TTFT is one forward of its prompt on the decode instance's TP
    and GPU (shared/serving/mixed.py with no batch), no transfer; its gaps are the
    decode steps after it."""
    sets = ['workload.prompt="fixed"', "workload.prompt_tokens=2000", "workload.requests=1"]
    s, r, rooms = _run(P8D2, [*sets, "workload.output_tokens=6", f"{KEY}=4096"])
    info = rooms[0]
    here = colocated_scenario(s, s.decode.tp, 1, s.decode.ep)
    model = DecodeModel(s)
    forward = mixed_step_s(here, model, 0, 0.0, [(2000, 0)])
    assert request_figures(info)["ttft_s"] == pytest.approx(forward, rel=1e-12)
    # TP2 on the decode side is not TP8 on the prefill side: the forward is its own
    assert forward != pytest.approx(mixed_step_s(s, model, 0, 0.0, [(2000, 0)]), rel=1e-3)
    steps = [model.step_time_s(2000 + k, 1) for k in range(5)]
    assert info["itls"] == pytest.approx(steps, rel=1e-9)
    assert not [x for x in r.records if x.phase in ("write", "scatter", "compute")]


def test_a_mixed_run_serves_both_kinds_and_keeps_each_to_its_side():
    s, r, rooms = _run(P1D4, [*GENERATE, f"{KEY}=2048", "cluster.decode_instances=2"])
    local = {
        q.room for q in r.requests if s.cluster.prefills_locally(q.prompt_tokens, q.prefix_tokens)
    }
    assert 0 < len(local) < len(r.requests)
    assert r.rooms_done == len(r.requests)
    assert all(request_figures(rooms[q.room]) is not None for q in r.requests)
    prefilled = {x.room for x in r.records if x.role == "prefill" and x.room >= 0}
    assert prefilled == {q.room for q in r.requests} - local
    # a local room's chunks ride in the steps of rooms already decoding: some decode
    # step carries a prompt chunk, so it is longer than a decode-only step of its batch
    model = DecodeModel(s)
    longer = [
        x
        for x in r.records
        if x.phase == "decode_step" and x.end - x.start > 1.5 * model.step_time_s(0, x.requests)
    ]
    assert longer


def test_local_rooms_wait_for_a_slot_like_any_other():
    """One slot: a local room's prefill starts only once the room before it has left,
    so its first token comes at least its whole prompt's forwards after that."""
    sets = [*GENERATE, f"{KEY}=100000", "decode.max_running_requests=1", "workload.requests=8"]
    sets.append("prefill.chunked_prefill_size=1024")  # prompts of several steps
    s, r, rooms = _run(P1D4, sets)
    here, model = colocated_scenario(s, s.decode.tp, 1, s.decode.ep), DecodeModel(s)
    chunk = s.prefill.chunked_prefill_size

    def alone(q) -> float:  # the prompt's chunks one after another, nothing else running
        done, total = q.prefix_tokens, 0.0
        while done < q.prompt_tokens:
            c = min(chunk, q.prompt_tokens - done)
            total += mixed_step_s(here, model, 0, 0.0, [(c, done)])
            done += c
        return total

    order = sorted(r.requests, key=lambda q: rooms[q.room]["generate_start"])
    waited = 0
    for a, b in zip(order, order[1:], strict=False):
        ia, ib = rooms[a.room], rooms[b.room]
        assert ib["generate_start"] >= ia["generate_end"] + alone(b) * (1 - 1e-9)
        waited += ib["arrival"] < ia["generate_end"]
    assert waited  # some room arrived while the slot was taken


def test_the_screen_and_the_plan_axis(tmp_path):
    path = tmp_path / "tiny.toml"
    path.write_text(TINY_SCENARIO + TINY_SLO)
    grid = {
        "prefill.tp": "1",
        "decode.tp": "2",
        "cluster.prefill_instances": "1",
        "cluster.decode_instances": "1",
        KEY: "off,0,100000",
    }
    cands = plan_candidates(path, grid, screen=False)
    got = {p.settings[KEY]: p for p in cands.points}
    assert set(got) == {"off", 0, 100000}
    assert got["off"].scenario.cluster.max_local_prefill_length is None
    assert got[100000].scenario.cluster.max_local_prefill_length == 100000
    # every prompt local: the prefill instances are offered nothing; none local: all
    assert PREFILL not in capacity(got[100000].scenario)
    assert capacity(got["off"].scenario)[PREFILL] == capacity(got[0].scenario)[PREFILL]
    with pytest.raises(Exception, match="whole number of tokens"):
        plan_candidates(path, {**grid, KEY: "off,-3"}, screen=False)


def test_the_plan_searches_it_and_refuses_a_bad_value(tmp_path):
    from typer.testing import CliRunner

    from kvstage.cli.main import app

    path = tmp_path / "tiny.toml"
    path.write_text(TINY_SCENARIO + TINY_SLO)
    grid = ["--prefill-tp", "1", "--decode-tp", "2", "--prefill-instances", "1"]
    grid += ["--decode-instances", "1", "--no-colocated", "--no-progress", "--workers", "1"]
    grid += ["--no-screen"]  # "off" overloads the one prefill instance: simulate it anyway
    res = CliRunner().invoke(app, ["plan", str(path), *grid, "--max-local-prefill", "off,-1"])
    assert res.exit_code == 2 and "--max-local-prefill" in res.output
    out = tmp_path / "plan"
    args = ["plan", str(path), *grid, "--max-local-prefill", "off,100000", "--out", str(out)]
    res = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert res.exit_code in (0, 1), res.output
    rows = json.loads((out / "plan.json").read_text())["points"]
    by = {str(r[KEY]): r for r in rows}
    assert sorted(by) == ["100000", "off"] and all(r["status"] == "ok" for r in rows)
    # every prompt on the decode side: the prefill instance is offered nothing, so it is
    # not the busiest stage (it is, at 137% of its capacity, with none local)
    assert by["off"]["busiest_stage"] == "prefill compute"
    assert by["off"]["busiest_utilization"] > 1
    assert by["100000"]["busiest_stage"] != "prefill compute"
    assert shape(by["100000"]).endswith("prompts <= 100000 prefilled on D")
    assert "prefilled" not in shape(by["off"])


def test_an_online_run_streams_a_local_rooms_tokens():
    """`kvstage serve`'s simulation: requests injected while it runs; the short one is
    prefilled on the decode side, every token streams, no prefill rank sees it."""
    from kvstage.sim.online import OnlineSimulation

    got: list[tuple[int, int, float]] = []
    sets = ["decode.max_running_requests=4", f"{KEY}=1500"]
    sim = OnlineSimulation(load_scenario(P8D2, sets), lambda *t: got.append(t))
    sim.inject(2048, 5)
    sim.advance(0.001)
    sim.inject(1024, 3)
    result = sim.close()
    assert not result.violations and result.rooms_done == 2
    assert sorted((room, k) for room, k, _ in got) == [(0, k) for k in range(1, 6)] + [
        (1, k) for k in range(1, 4)
    ]
    assert {x.room for x in result.records if x.role == "prefill" and x.room >= 0} == {0}


def test_an_export_of_a_winner_that_prefills_on_decode_says_it_is_not_carried(tmp_path):
    from typer.testing import CliRunner

    from kvstage.cli.main import app

    path = tmp_path / "tiny.toml"
    path.write_text(TINY_SCENARIO + TINY_SLO)
    grid = ["--prefill-tp", "1", "--decode-tp", "2", "--prefill-instances", "1"]
    grid += ["--decode-instances", "1", "--no-colocated", "--no-progress", "--workers", "1"]
    grid += ["--no-screen", "--set", "slo.ttft_s=30", "--set", "slo.tpot_s=1"]
    out = tmp_path / "plan"
    args = ["plan", str(path), *grid, "--max-local-prefill", "100000", "--out", str(out)]
    res = CliRunner().invoke(app, [*args, "--export", "sglang"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "sglang.launch_server" in res.output
    assert "note: the winner prefills prompts of at most 100000 uncached tokens" in res.output
