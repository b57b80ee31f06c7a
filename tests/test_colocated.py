"""The colocated engine (kvstage/sim/colocated.py) and the plan's colocated row
(kvstage/explore/colocated.py): closed-form cases and bounds no run may beat."""

from __future__ import annotations

import json

import pytest
from test_plan import SCENARIO as TINY_SCENARIO
from test_plan import SLO as TINY_SLO

from kvstage.explore.colocated import compare, parse_instances
from kvstage.explore.executor import ExploreError
from kvstage.metrics.rooms import request_figures
from kvstage.shared.scenario import load_scenario
from kvstage.shared.scenario.engines import ENGINE_PRESETS
from kvstage.shared.serving.compute import prefill_forward, prefill_forward_s
from kvstage.shared.serving.decode_model import DecodeModel
from kvstage.shared.serving.mixed import mixed_step_s
from kvstage.shared.workload import Request
from kvstage.sim.colocated import (
    colocated_problem,
    colocated_scenario,
    simulate_colocated,
)

FLAGSHIP = "scenarios/llama3-70b-p8-d2.toml"


def _colocated(tp: int = 8, instances: int = 1, *sets: str):
    return colocated_scenario(load_scenario(FLAGSHIP, list(sets)), tp, instances)


def _alone_prefill_s(s, prompt: int) -> float:
    """The prompt's prefill alone: its chunks one after another, each after the last."""
    chunk, done, total = s.prefill.chunked_prefill_size, 0, 0.0
    while done < prompt:
        c = min(chunk, prompt - done)
        total += prefill_forward_s(s, c, done)
        done += c
    return total


@pytest.mark.parametrize("engine", [None, "sglang-nixl"])
def test_one_request_alone_ttft_is_its_prefill_plus_the_request_cost(engine):
    sets = ["prefill.chunked_prefill_size=1024"] + ([f"engine.preset={engine}"] if engine else [])
    s = _colocated(8, 1, *sets)
    req = Request(room=0, arrival_s=0.5, prompt_tokens=3000, prefix_tokens=0, output_tokens=20)
    r = simulate_colocated(s, [req])
    info = r.rooms[0]
    cost = ENGINE_PRESETS[engine].request_us * 1e-6 if engine else 0.0
    ttft = info["done"] - info["arrival"]
    assert ttft == pytest.approx(cost + _alone_prefill_s(s, 3000), rel=1e-12)
    assert _alone_prefill_s(s, 3000) > 0.1  # three chunks of a 70B model: not nothing
    # its first token from the prefill, then 19 decode steps alone, its KV one longer each
    m = DecodeModel(s)
    steps = [m.step_time_s(3000 + k, 1) for k in range(19)]
    assert info["generate_end"] - info["generate_start"] == pytest.approx(sum(steps), rel=1e-12)
    assert info["itls"] == pytest.approx(steps, rel=1e-9)
    figs = request_figures(info)
    assert figs["ttft_s"] == pytest.approx(ttft) and figs["tpot_s"] == pytest.approx(
        sum(steps) / 19
    )


def test_a_chunk_mixed_into_a_compute_bound_step_adds_its_compute():
    s = _colocated(8, 1)
    m = DecodeModel(s)
    batch, kv = 1024, 1024 * 100
    d = m.step(kv, batch)
    assert d.compute_s > d.memory_s  # the case: a compute-bound decode step
    alone = mixed_step_s(s, m, batch, kv, [])
    assert alone == pytest.approx(d.total_s)
    f = prefill_forward(s, 2048, 4096)
    mixed = mixed_step_s(s, m, batch, kv, [(2048, 4096)])
    # issue 35: the step's kernels are launched once; the chunk adds its rows to them
    assert mixed - alone == pytest.approx(f.total_s - f.fixed_s, rel=1e-9)


def test_a_mixed_step_lies_between_its_parts_and_their_sum():
    s = _colocated(8, 1)
    m = DecodeModel(s)
    for batch, kv, chunk in ((1, 4000, 64), (32, 32 * 8000, 512), (200, 200 * 3000, 4096)):
        alone = mixed_step_s(s, m, batch, kv, [])
        chunk_s = prefill_forward(s, chunk, 1000).total_s
        mixed = mixed_step_s(s, m, batch, kv, [(chunk, 1000)])
        assert max(alone, chunk_s) <= mixed <= alone + chunk_s + 1e-15


def test_two_prompts_in_one_forward_cost_no_less_than_either():
    s = _colocated(8, 1)
    m = DecodeModel(s)
    one = mixed_step_s(s, m, 0, 0, [(1000, 0)])
    two = mixed_step_s(s, m, 0, 0, [(1000, 0), (3000, 500)])
    assert one == pytest.approx(prefill_forward_s(s, 1000, 0))
    assert two > max(one, prefill_forward_s(s, 3000, 500))


@pytest.fixture(scope="module")
def loaded():
    sets = [
        "workload.requests=300",
        "workload.rate_per_s=6",
        "workload.output_tokens=64",
        "prefill.chunked_prefill_size=2048",
        "decode.max_running_requests=64",
    ]
    return simulate_colocated(_colocated(8, 2, *sets))


def test_a_loaded_run_never_beats_physics(loaded):
    s = loaded.scenario
    m = DecodeModel(s)
    by_room = {r.room: r for r in loaded.requests}
    assert len(loaded.rooms) == 300 and loaded.rooms_failed == 0
    for room, info in loaded.rooms.items():
        req = by_room[room]
        assert info["done"] - info["arrival"] >= _alone_prefill_s(s, req.prompt_tokens) * (1 - 1e-9)
        span = info["generate_end"] - info["generate_start"]
        # every step it was in held at least itself, with at least its prompt's KV
        assert span >= (req.output_tokens - 1) * m.step_time_s(req.prompt_tokens, 1) * (1 - 1e-9)
        assert len(info["itls"]) == req.output_tokens - 1
    assert 0 < loaded.utilization <= 1
    assert loaded.peak_batch <= s.decode.max_running_requests
    # the load queued: some requests waited, so the run is not a string of lone requests
    waits = [i["forward_start"] - i["arrival"] for i in loaded.rooms.values()]
    assert max(waits) > 0


def test_requests_run_in_arrival_order_on_one_instance(loaded):
    # first come, first served: on its instance, no later arrival starts its prefill first
    starts = {}
    n = loaded.scenario.cluster.decode_instances
    for req in loaded.requests:
        starts.setdefault(req.room % n, []).append(loaded.rooms[req.room]["forward_start"])
    for seq in starts.values():
        assert seq == sorted(seq)


def test_a_request_larger_than_the_kv_pool_fails_with_why():
    # a context longer than the pool, so that the pool, not the context, refuses it
    s = _colocated(8, 1, "decode.tp=8", "decode.gpu_memory_gib=40", "model.context_tokens=4194304")
    cap = DecodeModel(s).capacity_tokens
    req = Request(room=0, arrival_s=0.0, prompt_tokens=cap, prefix_tokens=0, output_tokens=10)
    r = simulate_colocated(s, [req])
    assert r.rooms_failed == 1 and "tokens of KV" in r.failed_reason


def test_a_prompt_beyond_the_context_is_refused_as_in_the_disaggregated_run():
    s = _colocated(8, 1, "model.context_tokens=8192")
    req = Request(room=0, arrival_s=0.0, prompt_tokens=8192, prefix_tokens=0, output_tokens=10)
    r = simulate_colocated(s, [req])
    assert r.rooms_failed == 1 and "context length (8192 tokens)" in r.failed_reason


def test_a_model_that_does_not_fit_is_named():
    s = _colocated(1, 1)  # 70B in BF16 on one 80 GiB GPU
    assert "weights" in (colocated_problem(s) or "")


def _row(gpus: int, good: float, **extra) -> dict:
    return {"gpus": gpus, "goodput_rps": good * gpus, "goodput_per_gpu_rps": good, **extra}


def test_compare_says_whether_disaggregation_pays():
    d = _row(12, 0.3, prefill_gpu="h100-sxm", decode_gpu="h100-sxm", **{
        "cluster.prefill_instances": 2, "prefill.tp": 4,
        "cluster.decode_instances": 1, "decode.tp": 4,
    })  # fmt: skip
    c = _row(16, 0.2, gpu="h100-sxm")
    out = compare(d, c, {"h100-sxm": 2.0})
    assert out["pays"] is True and "4 fewer" in out["text"]
    k = out["disaggregated"]["cost_per_k_good_requests"]
    assert k == pytest.approx(12 * 2.0 / (3.6 * 3600) * 1000)
    assert compare(d, _row(8, 0.5, gpu="h100-sxm"))["pays"] is False
    assert compare(None, c)["pays"] is False and "only colocated" in compare(None, c)["text"]
    assert compare(None, None)["pays"] is None


def test_bad_instance_counts_are_one_clear_error():
    assert parse_instances("1, 2,8") == [1, 2, 8]
    for bad in ("0", "two", ","):
        with pytest.raises(ExploreError, match="--colocated-instances"):
            parse_instances(bad)


# The tiny model of tests/test_plan.py: prefill at 3,000 tokens/s per instance whatever
# its TP, 1,024-token prompts at 4 req/s (4,096 tokens/s): one colocated instance cannot
# keep up, two can; the 2 GiB GPU does not hold the 1B model's weights at TP1.
TINY = TINY_SCENARIO + TINY_SLO


def test_plan_puts_the_best_colocated_configuration_beside_the_winner(tmp_path):
    from typer.testing import CliRunner

    from kvstage.cli.main import app

    path = tmp_path / "tiny.toml"
    path.write_text(TINY)
    out = tmp_path / "plan"
    grid = ["--prefill-tp", "1,2", "--decode-tp", "1,2", "--prefill-instances", "1,2"]
    grid += ["--decode-instances", "1", "--colocated-instances", "1,2,3", "--workers", "1"]
    res = CliRunner().invoke(app, ["plan", str(path), *grid, "--out", str(out), "--no-progress"])
    assert res.exit_code == 0, res.output
    assert "colocated vs disaggregated" in res.output
    doc = json.loads((out / "plan.json").read_text())
    colo = doc["colocated"]
    rows = {(r["colocated.instances"], r["colocated.tp"]): r for r in colo["points"]}
    assert "weights" in rows[(1, 1)]["reason"] and rows[(1, 1)]["status"] == "skipped"
    # one instance: 4,096 prompt tokens/s offered, 3,000 served: screened out, with why
    assert rows[(1, 2)]["status"] == "skipped"
    assert "prefill compute overloaded" in rows[(1, 2)]["reason"]
    best = colo["best"]
    assert (best["colocated.instances"], best["colocated.tp"], best["gpus"]) == (2, 2, 4)
    assert colo["comparison"]["colocated"]["gpus"] == 4
    assert colo["comparison"]["disaggregated"]["gpus"] == doc["winner"]["gpus"]
    assert (out / "colocated.csv").read_text().count("\n") == len(colo["points"]) + 1
    res = CliRunner().invoke(
        app, ["plan", str(path), *grid, "--out", str(tmp_path / "p2"), "--no-colocated"]
    )
    assert res.exit_code == 0 and "colocated" not in res.output
    assert "colocated" not in json.loads((tmp_path / "p2" / "plan.json").read_text())
