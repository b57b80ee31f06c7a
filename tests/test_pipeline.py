"""Prefill pipeline parallelism in the serving model (shared/serving/pipeline.py): the
layers a stage holds, what fits a GPU, a stage's step against its physical bounds, the
pipeline of a prompt's chunks, and the refusals where the model stops."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvstage.run.simrun import simulate
from kvstage.shared.cluster import (
    cluster_sessions,
    hardware_sessions,
    pipeline_problem,
    simulated_pipeline_problem,
)
from kvstage.shared.scenario import ScenarioError, load_scenario
from kvstage.shared.serving.capacity import (
    prefill_stage,
    prompt_forward_s,
    prompt_latency_s,
    prompt_steps,
    scenario_gpus,
)
from kvstage.shared.serving.compute import prefill_forward
from kvstage.shared.serving.gpus import WEIGHT_BYTES, side_gpu
from kvstage.shared.serving.memory import side_memory
from kvstage.shared.serving.pipeline import (
    handoff_s,
    pipeline_latency_s,
    stage_layers,
    stage_share,
    stages_cross_nodes,
)
from kvstage.sim.driver import Simulation

LLAMA70 = "scenarios/llama3-70b-p8-d2.toml"


def _s(*sets: str, path: str = LLAMA70):
    return load_scenario(path, overrides=list(sets))


def test_stage_layers_split_as_sglang_does():
    # SGLang's get_pp_indices: layers // pp each, the last layers % pp stages one more
    assert stage_layers(80, 2) == [40, 40]
    assert stage_layers(61, 4) == [15, 15, 15, 16]
    assert stage_layers(126, 4) == [31, 31, 32, 32]
    for layers, pp in ((80, 3), (61, 8), (126, 16), (5, 5)):
        got = stage_layers(layers, pp)
        assert sum(got) == layers and max(got) - min(got) <= 1 and min(got) >= 1


def test_weights_and_kv_per_gpu_are_the_fullest_stage():
    one = side_memory(_s("prefill.tp=4"), "prefill")
    for pp in (2, 3, 4):
        s = _s("prefill.tp=4", f"prefill.pp={pp}")
        m = side_memory(s, "prefill")
        share = max(stage_layers(80, pp)) / 80
        # the fullest stage holds its layers' share and at most one vocab matrix over TP
        vocab = 128256 * 8192 * WEIGHT_BYTES[s.model.weight_dtype] / 4
        assert one.weight_bytes / pp <= m.weight_bytes <= one.weight_bytes * share + vocab
        assert m.kv_bytes_per_token * 80 == one.kv_bytes_per_token * max(stage_layers(80, pp))
        assert m.kv_tokens > one.kv_tokens  # the stage's KV leaves more room per token
    assert side_memory(_s("prefill.tp=4", "prefill.pp=2"), "decode") == side_memory(
        _s("prefill.tp=4"), "decode"
    )


def test_pipeline_lets_a_model_fit_that_one_node_cannot_hold():
    # Llama-3.1-405B in BF16: 810 GB of weights against 8 x 80 GB of one H100 node
    sets = ["model.preset=llama-3.1-405b", "prefill.tp=8", "decode.tp=8"]
    with pytest.raises(ScenarioError, match=r"weights per GPU > .* at TP8"):
        _s(*sets)
    with pytest.raises(ScenarioError, match="decode"):  # the decode side still does not fit
        _s(*sets, "prefill.pp=2")
    s = _s(*sets, "prefill.pp=2", "decode.gpu=h200")
    assert side_memory(s, "prefill").problem() is None
    assert scenario_gpus(s) == (s.cluster.prefill_instances * 16, s.cluster.decode_instances * 8)


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
@pytest.mark.parametrize("tokens", [512, 4096, 8192])
def test_a_stage_step_is_never_faster_than_its_flops_or_weight_reads(pp, tokens):
    s = _s("prefill.tp=4", f"prefill.pp={pp}")
    (step,) = prompt_steps(s, tokens)
    gpu = side_gpu(s, "prefill")
    share = stage_share(s)
    whole = prefill_forward(s, tokens)
    flops = (whole.linear_flops + whole.attention_flops) * share  # one GPU of the stage
    assert step >= flops / gpu.peak_flops(s.model.weight_dtype)
    weights = side_memory(s, "prefill").weight_bytes  # read once at least
    assert step >= weights / gpu.hbm_Bps * 0.99  # the vocab matrix is read in part only


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
@pytest.mark.parametrize("tokens", [256, 2048, 8192])
def test_one_chunk_through_the_pipeline_is_never_below_one_groups_compute(pp, tokens):
    flat = prompt_latency_s(_s("prefill.tp=4"), tokens)
    assert flat == pytest.approx(prompt_forward_s(_s("prefill.tp=4"), tokens))
    assert prompt_latency_s(_s("prefill.tp=4", f"prefill.pp={pp}"), tokens) >= flat


def test_a_prompts_chunks_pipeline_through_the_stages():
    assert pipeline_latency_s([0.25] * 5, 4) == pytest.approx((5 + 4 - 1) * 0.25)
    assert pipeline_latency_s([1.0, 3.0, 2.0], 2) == pytest.approx(6.0 + 3.0)
    assert pipeline_latency_s([], 4) == 0.0
    one, two = _s("prefill.tp=4"), _s("prefill.tp=4", "prefill.pp=2")
    steps = prompt_steps(two, 65536)
    assert len(steps) == 8
    assert prompt_latency_s(two, 65536) == pytest.approx(sum(steps) + max(steps))
    # a long prompt's chunks overlap: its latency drops below one group's, and with
    # other prompts in flight the instance finishes a chunk every stage-step
    assert prompt_latency_s(two, 65536) < prompt_latency_s(one, 65536)
    assert prompt_forward_s(two, 65536) == pytest.approx(sum(steps))
    assert prompt_forward_s(two, 65536) < prompt_forward_s(one, 65536)


def test_the_handoff_crosses_the_nic_only_between_nodes():
    inside = _s("prefill.tp=2", "prefill.pp=2")  # 4 GPUs on one 8-GPU node
    across = _s("prefill.tp=8", "prefill.pp=2")  # stage 1 on the second node
    assert not stages_cross_nodes(inside) and stages_cross_nodes(across)
    assert not stages_cross_nodes(_s("prefill.tp=4", "prefill.pp=2"))
    assert stages_cross_nodes(_s("prefill.tp=4", "prefill.pp=3"))
    tokens = 8192
    nbytes = 2 * tokens * 8192 * 2  # hidden states and residual in BF16
    gpu = side_gpu(inside, "prefill")
    assert handoff_s(inside, tokens) >= nbytes / 2 / gpu.scaleup_Bps
    assert handoff_s(across, tokens) > handoff_s(_s("prefill.tp=8", "cluster.gpus_per_node=16",
                                                    "prefill.pp=2"), tokens)  # fmt: skip
    assert handoff_s(_s("prefill.tp=4"), tokens) == 0.0


def test_prefill_capacity_counts_the_pipelines_gpus():
    s = _s("prefill.tp=4", "prefill.pp=2")
    load = {"requests_per_s": 1.0, "computed_tokens": 4096.0}
    assert "TP4 PP2" in prefill_stage(s, [], load, work=(4096.0, 1.0)).why


def test_decode_pp_is_refused_with_why():
    with pytest.raises(ScenarioError, match="prefill side only.*remove decode.pp"):
        _s("decode.pp=2")
    with pytest.raises(ScenarioError, match=r"prefill.pp = 81.*allowed: 1..80"):
        _s("prefill.pp=81")


ONE = ["workload.requests=1", "workload.arrival=fixed", "workload.prompt=fixed",
       "workload.output_tokens=0"]  # fmt: skip


@pytest.mark.parametrize("pp", [1, 2, 3])
@pytest.mark.parametrize("tokens", [4096, 32768])
def test_the_simulator_pipelines_a_prompts_chunks_as_the_model_does(pp, tokens):
    # one prompt on an idle instance: its forwards from the first chunk entering stage 0
    # to the last leaving the last stage are the serving model's n + pp - 1 steps
    s = _s(*ONE, f"workload.prompt_tokens={tokens}", "prefill.tp=4", f"prefill.pp={pp}")
    d = simulate(s).summary
    assert d["requests_done"] == 1 and d["invariant_violations"] == 0
    assert d["prefill_compute_s"]["p50"] == pytest.approx(prompt_latency_s(s, tokens), rel=1e-9)
    flat = _s(*ONE, f"workload.prompt_tokens={tokens}", "prefill.tp=4")
    if tokens <= s.geometry().chunk_tokens:  # one chunk: never below one group's compute
        assert d["prefill_compute_s"]["p50"] >= prompt_forward_s(flat, tokens)


CLUSTER = ("cluster.prefill_instances=2", "cluster.decode_instances=2",
           "cluster.router=least-outstanding")  # fmt: skip


@pytest.mark.parametrize(
    ("path", "sets", "flat"),
    [(LLAMA70, ("prefill.tp=4", "prefill.pp=2"), ("prefill.tp=8",)),
     (LLAMA70, ("prefill.tp=2", "prefill.pp=3", "transfer.path=slice"),  # 26, 27, 27 layers
      ("prefill.tp=2", "transfer.path=slice", "prefill.gpu=h200")),
     (LLAMA70, ("prefill.tp=8", "prefill.pp=2", *CLUSTER), ("prefill.tp=8", *CLUSTER)),
     ("scenarios/mla/deepseek-v3-p16-d8.toml", ("prefill.tp=8", "prefill.pp=2"), ())],
)  # fmt: skip
def test_every_stage_sends_its_layers_and_every_byte_lands(path, sets, flat):
    # the same decode side without stages receives the same payload
    s = _s("workload.requests=12", *sets, path=path)
    d = simulate(s).summary
    f = simulate(_s("workload.requests=12", *flat, path=path)).summary
    assert d["requests_done"] == 12 and d["requests_failed"] == 0
    assert d["invariant_violations"] == 0
    assert d["payload_bytes"] == f["payload_bytes"]  # the same KV reaches the decode


def test_hardware_mode_refuses_stages_and_the_host_models_too():
    s = _s("prefill.tp=4", "prefill.pp=2")
    assert pipeline_problem(_s("prefill.tp=4")) is None and simulated_pipeline_problem(s) is None
    cluster_sessions(s, [])  # the Sessions map the stages
    why = pipeline_problem(s)
    assert why is not None and "hardware mode" in why and "allowed: prefill.pp = 1" in why
    with pytest.raises(ValueError, match="hardware mode's KV pools"):
        hardware_sessions(s, [])
    host = _s("prefill.tp=4", "prefill.pp=2", 'links.host_model="cpu-loop"',
              "links.host_cores=2", "links.engine_thread_cores=0.5", "links.event_us=40",
              "links.fill_latency_us=200", "links.fill_bandwidth_gbs=2")  # fmt: skip
    assert "cpu-loop host model" in simulated_pipeline_problem(host)
    with pytest.raises(ValueError, match="cpu-loop host model"):
        Simulation(host)
    with pytest.raises(ScenarioError, match="cannot fold ranks: the prefill's pipeline stages"):
        _s("prefill.tp=4", "prefill.pp=2", "cluster.fold=true")
    out = subprocess.run(
        [sys.executable, "-m", "kvstage.cli", "hw", LLAMA70, "--set", "prefill.pp=2",
         "--set", "prefill.tp=4"],
        capture_output=True, text=True, env={"COLUMNS": "300", "PATH": ""},
    )  # fmt: skip
    assert out.returncode == 2
    assert out.stdout.count("\n") + out.stderr.count("\n") == 1
    assert "prefill.pp = 2" in out.stdout + out.stderr


def test_validate_shows_each_stage_writers_layers_and_block():
    from kvstage.analysis.layout_report import duplicate_share

    sets = ["model.preset=llama-3.1-405b", "decode.gpu=h200", "decode.tp=8", "prefill.tp=16"]
    wide = _s(*sets, "prefill.pp=2", path="scenarios/llama3-70b-p16-d4.toml")
    assert duplicate_share(wide) == duplicate_share(
        _s(*sets, path="scenarios/llama3-70b-p16-d4.toml")
    )
    out = subprocess.run(
        [sys.executable, "-m", "kvstage.cli", "validate", LLAMA70, "--set", "prefill.pp=2",
         "--set", "prefill.tp=4"],
        capture_output=True, text=True, env={"COLUMNS": "300", "PATH": ""},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "prefill TP4 PP2 -> decode TP2" in out.stdout
    rows = [r for r in out.stdout.splitlines() if "40..79" in r]
    # decode rank 0's writers 2, 3 and rank 1's 2, 3: stage 1's ranks, half the layers' bytes
    assert len(rows) == 4 and all("40,960" in r for r in rows)
    assert "1 prefill x TP4 PP2 + 1 decode x TP2 = 10 GPUs" in out.stdout
