"""Issue 35, the decode side as engines run it: the engine's host work per step
(`decode.engine`), DeepEP's low-latency all-to-all (`decode.deepep_mode`), two-batch
overlap (`decode.two_batch_overlap`) and n-gram drafts (`decode.speculative`).

Expected figures are computed here from the published numbers the docstrings name, not
read from the code under test."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstage.shared.scenario import ScenarioError, load_scenario
from kvstage.shared.serving.compute import alltoall_parts, decode_step
from kvstage.shared.serving.decode_model import DecodeModel
from kvstage.shared.serving.decode_tbo import HalfStages, schedule_s
from kvstage.shared.serving.ep_balance import busiest_rank

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "scenarios" / "llama3-8b-p4-d2.toml"

# DeepSeek-V3 FP8 decode on H100 nodes of 8: TP1 x EP16, DP attention
DSV3 = [
    'transfer.path="slice"',
    "model.preset=deepseek-v3",
    "model.weight_dtype=fp8",
    "prefill.tp=1",
    "prefill.ep=16",
    "decode.tp=1",
    "decode.ep=16",
]


def test_an_overlapping_engine_hides_its_host_work_and_a_synchronous_one_adds_it():
    gpu_only = decode_step(load_scenario(BASE, ["decode.step_overhead_ms=0"]), 8, 8 * 1000)
    sglang = decode_step(load_scenario(BASE, ['decode.engine="sglang"']), 8, 8 * 1000)
    v0 = decode_step(load_scenario(BASE, ['decode.engine="vllm-v0"']), 8, 8 * 1000)
    assert gpu_only.total_s > 0.31e-3  # a real step is longer than SGLang's host work
    assert sglang.total_s == pytest.approx(gpu_only.total_s)  # [P] 0.31 ms, overlapped
    assert v0.total_s == pytest.approx(gpu_only.total_s + 4e-3)  # [P] 4 ms, not hidden
    # no engine: the default 1 ms, added; step_overhead_ms overrides any engine, added
    plain = decode_step(load_scenario(BASE), 8, 8 * 1000)
    assert plain.total_s == pytest.approx(gpu_only.total_s + 1e-3)
    fit = load_scenario(BASE, ['decode.engine="sglang"', "decode.step_overhead_ms=2"])
    assert decode_step(fit, 8, 8 * 1000).total_s == pytest.approx(gpu_only.total_s + 2e-3)


def test_sglangs_mtp_step_adds_its_host_work_the_eagle_worker_does_not_overlap():
    # [P] sgl-project/sglang PR 12128: overlapping EAGLE's host work took DeepSeek-R1's
    # 512 tokens (accept length 2.296) from 3.644 s to 3.206 s; [C] PR 9588: no overlap
    # scheduler for speculative decoding before it
    mtp = [
        *DSV3,
        'decode.engine="sglang"',
        'decode.speculative.method="mtp"',
        "decode.speculative.draft_tokens=2",
        "decode.speculative.accept_length=1.85",
    ]
    step = decode_step(load_scenario(BASE, mtp), 8, 8 * 4864)
    host = (3.644 - 3.206) / (512 / 2.296)
    assert step.total_s == pytest.approx(step.gpu_s + host)
    # without speculative decoding the overlap scheduler hides its 0.31 ms
    plain = decode_step(load_scenario(BASE, [*DSV3, 'decode.engine="sglang"']), 8, 8 * 4864)
    assert plain.total_s == pytest.approx(plain.gpu_s)
    # n-gram drafts keep the plain engine's figure (no measurement of theirs)
    ngram = [*mtp[:-3], 'decode.speculative.method="ngram"', *mtp[-2:]]
    assert decode_step(load_scenario(BASE, ngram), 8, 8 * 4864).overhead_s == 0.31e-3


def test_the_engine_preset_names_the_decode_engine_and_the_model_agrees_with_the_step():
    s = load_scenario(BASE, ['engine.preset="vllm-nixl"'])
    step = decode_step(s, 4, 4 * 500)
    assert step.overhead_s == pytest.approx(0.16e-3) and not step.host_overlapped
    m = DecodeModel(load_scenario(BASE, ['engine.preset="sglang-nixl"']))
    for batch, kv in ((1, 100), (16, 16 * 3000)):
        assert m.step_time_s(kv, batch) == pytest.approx(m.step(kv, batch).total_s)


def test_an_unknown_engine_is_refused_naming_the_allowed_ones():
    with pytest.raises(ScenarioError) as e:
        load_scenario(BASE, ['decode.engine="tgi"'])
    assert "decode.engine" in str(e.value) and "'vllm-v1'" in str(e.value)


def test_low_latency_all_to_all_reproduces_deepeps_table_on_its_own_setup():
    """DeepEP README: H800, one 50 GB/s NIC a GPU, 128 tokens, hidden 7,168, top-8, EP16:
    dispatch 118 us, combine 195 us. On H800 nodes whose NIC gives each GPU 50 GB/s, the
    same 128 tokens of DeepSeek-V3 (hidden 7,168, top-8) cost that a layer when routed as
    the benchmark routes them, uniformly; real routing's busiest rank (EPLB's residual
    skew, shared/serving/ep_balance.py) waits longer, in proportion."""
    s = load_scenario(
        BASE, [*DSV3, "decode.gpu=h800", "links.inter_bandwidth_gbps=400", "links.gpus_per_nic=1"]
    )
    d, c = alltoall_parts(s, "decode", 128)
    skew = busiest_rank(s, "decode", 128) / busiest_rank(s, "decode", 128, skew=False)
    assert 1.0 < skew < 1.1
    assert d / 61 == pytest.approx(118e-6 * skew) and c / 61 == pytest.approx(195e-6 * skew)
    # fewer tokens cost less, but never less than a link latency per kernel
    d1, c1 = alltoall_parts(s, "decode", 1)
    assert d1 < d and d1 / 61 >= s.links.resolved().inter.latency_s
    # normal mode is the bandwidth model: FP8 out, BF16 back, a third and two thirds
    n = load_scenario(BASE, [*DSV3, 'decode.deepep_mode="normal"'])
    nd, nc = alltoall_parts(n, "decode", 128)
    assert nc == pytest.approx(2 * nd)


def test_two_batch_overlap_hides_communication_but_never_beats_compute_or_comm():
    plain = load_scenario(BASE, DSV3)
    tbo = load_scenario(BASE, [*DSV3, "decode.two_batch_overlap=true"])
    for batch in (8, 64, 256):
        kv = batch * 2000
        one, two = decode_step(plain, batch, kv), decode_step(tbo, batch, kv)
        comm = two.alltoall_s
        compute = two.gpu_s + two.overlap_s - comm  # the two halves' compute
        assert two.gpu_s >= max(comm, compute) - 1e-12
        assert compute >= one.gpu_s - one.alltoall_s  # the weights are read twice
        assert two.overlap_s > 0
        assert DecodeModel(tbo).step_time_s(kv, batch) == pytest.approx(two.total_s)
    # with nothing to hide (no expert parallelism) the option changes nothing, where a
    # scenario holds it without validation (a loaded one is refused, below)
    dense = load_scenario(BASE)
    forced = dense.model_copy(update={"decode": dense.decode.model_copy(
        update={"two_batch_overlap": True})})  # fmt: skip
    assert decode_step(forced, 64, 64 * 1000).total_s == pytest.approx(
        decode_step(dense, 64, 64 * 1000).total_s
    )


@pytest.mark.parametrize(
    "sets",
    [
        [],  # a dense model
        [*DSV3, "decode.ep=1"],  # a MoE model, its experts split by TP
        [*DSV3, "decode.tp=2", "decode.ep=2"],  # EP no wider than TP: no DP attention
    ],
)
def test_two_batch_overlap_is_refused_without_an_all_to_all(sets):
    """SGLang refuses it without an all-to-all backend (server_args.py), and the decode
    step splits only where there is one (compute.py `decode_step`)."""
    with pytest.raises(ScenarioError) as err:
        load_scenario(BASE, [*sets, "decode.two_batch_overlap=true"])
    assert "decode.two_batch_overlap = true" in str(err.value)
    assert "needs a MoE model with decode.ep > decode.tp" in str(err.value)
    assert "set it false here" in str(err.value)


def test_ngram_drafts_cost_no_gpu_forward_but_the_verify_is_paid():
    sets = ["decode.speculative.draft_tokens=4", "decode.speculative.accept_length=2"]
    ngram = decode_step(load_scenario(BASE, ['decode.speculative.method="ngram"', *sets]), 8, 8000)
    eagle = decode_step(load_scenario(BASE, ['decode.speculative.method="eagle"', *sets]), 8, 8000)
    none = decode_step(load_scenario(BASE), 8, 8000)
    assert ngram.draft_s == 0 and eagle.draft_s > 0
    assert ngram.flops == pytest.approx(eagle.flops) and ngram.flops > 3.9 * none.flops
    assert none.total_s < ngram.total_s < eagle.total_s


def test_the_decode_schedule_runs_sglangs_stages_in_its_order():
    """One layer, both halves alike, costs in units: prepare 1, core 2, shared 1,
    experts 3, dispatch 5, combine 4. SGLang's order with the second micro-batch two
    stages behind (operations_strategy.py `_compute_moe_deepseek_blog_decode`): A0 A1
    | A2 B0 | A3 B1 | A4 B2 | B3 | B4. By hand: A's prepare and core end at 3; A sends
    its dispatch at 3 (lands at 8) and runs its shared experts to 4; B prepares to 5;
    A waits for its dispatch to 8, runs its experts to 11 and sends its combine (lands
    at 15); B's core to 13; A waits for its combine to 15; B sends its dispatch at 15
    (lands at 20), shared to 16; B waits to 20, experts to 23, combine lands at 27; B
    waits for it: 27, and the tail (2 each) after."""
    half = HalfStages(prepare=1, core=2, shared=1, experts=3, dispatch=5, combine=4, tail=2)
    assert schedule_s([half, half], layers=1) == 27 + 4
    # nothing to hide: the stream is the compute alone, A's seven then B's
    free = HalfStages(prepare=1, core=2, shared=1, experts=3, dispatch=0, combine=0)
    assert schedule_s([free, free], layers=3) == 3 * 2 * 7


def test_two_batch_overlap_in_decode_against_the_published_ablation():
    """[P] LMSYS (https://lmsys.org/blog/2025-05-05-large-scale-ep/, "Ablation Study:
    Two-batch Overlap", DeepSeek-V3 on H100 nodes, EP72, 2,000-token KV): TBO is a loss
    below a threshold "between 64 and 128" tokens a device (-27% at 32) and gains 25.5%
    at 256. The model is not fitted to these: it replays SGLang's schedule
    (decode_tbo.py). Tolerance chosen before the run: the 256 gain within 10%."""
    sets = [
        *DSV3,
        "decode.ep=72",
        "decode.max_running_requests=256",
        "model.kv_dtype=bf16",
        'decode.engine="sglang"',
    ]
    plain = load_scenario(BASE, sets)
    tbo = load_scenario(BASE, [*sets, "decode.two_batch_overlap=true"])

    def gain(batch: int) -> float:
        return (
            decode_step(plain, batch, batch * 2000).total_s
            / decode_step(tbo, batch, batch * 2000).total_s
        )

    assert gain(32) < 1.0 and gain(64) < 1.0 < gain(128)
    assert gain(256) == pytest.approx(1.255, rel=0.10)
