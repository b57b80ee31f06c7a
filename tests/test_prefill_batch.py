"""Prompts packed into one prefill forward (shared/serving/prefill_batch.py): the rule,
the price of a packed forward (shared/serving/compute.py `packed_forward`) and the
capacity that packs a request mix (shared/serving/capacity.py `prefill_work`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstage.metrics.rooms import room_latencies
from kvstage.shared.invariants import check_records
from kvstage.shared.scenario import load_scenario
from kvstage.shared.serving.capacity import prefill_capacity, prefill_work, prompt_forward_s
from kvstage.shared.serving.compute import (
    packed_forward,
    packed_forward_s,
    prefill_forward,
    prefill_forward_s,
)
from kvstage.shared.serving.pipeline import stage_step_s
from kvstage.shared.serving.prefill_batch import OpenForward, pack
from kvstage.shared.serving.prefill_tbo import split_chunks
from kvstage.shared.workload import Request
from kvstage.sim.driver import simulate

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "scenarios" / "llama3-8b-p4-d2.toml"


def _s(*sets: str):
    return load_scenario(BASE, ['transfer.path="slice"', *sets])


def test_chunks_pack_in_order_while_they_fit_the_chunk():
    # (room, tokens computed, context): budget 8192
    queue = [
        (0, 8192, 0),  # a full chunk: alone
        (0, 1024, 8192),  # room 0's short last chunk
        (1, 4096, 0),
        (2, 2048, 0),  # 1024 + 4096 + 2048 = 7168
        (3, 2048, 0),  # would make 9216: the next forward
        (4, 0, 0),  # nothing to compute: closes the forward
        (5, 512, 0),
        (5, 512, 512),  # the same room again: the next forward
    ]
    assert pack(queue, 8192) == [
        [(8192, 0)],
        [(1024, 8192), (4096, 0), (2048, 0)],
        [(2048, 0)],
        [(512, 0)],
        [(512, 512)],
    ]
    f = OpenForward(8192)
    assert f.takes(0, 8192) and not f.takes(0, 0)
    f.add(0, 4096)
    assert f.takes(1, 4096) and not f.takes(1, 4097) and not f.takes(0, 1)


def test_a_packed_forward_of_equal_chunks_is_the_benchmarks_batched_forward():
    s = _s("model.preset=llama-3-8b")
    assert packed_forward(s, [(1024, 0)] * 8) == prefill_forward(s, 1024, prompts=8)
    assert packed_forward_s(s, [(1024, 512)]) == prefill_forward_s(s, 1024, 512)
    assert packed_forward_s(s, []) == 0.0


def test_a_packed_forward_costs_less_than_its_chunks_alone_and_its_attention_is_theirs():
    s = _s("model.preset=llama-3-8b", "prefill.tp=1", "prefill.gpu=h100-sxm")
    chunks = [(512, 0), (1024, 2048), (256, 0), (2048, 0)]
    packed = packed_forward(s, chunks)
    alone = [prefill_forward(s, t, c) for t, c in chunks]
    # the attention FLOPs are each chunk's over its own prompt's keys, summed
    assert packed.attention_flops == pytest.approx(sum(f.attention_flops for f in alone))
    # the weights are read once and the matmuls have more rows: shorter than one by one
    assert packed.total_s < sum(f.total_s for f in alone)
    assert packed.linear_s < sum(f.linear_s for f in alone)


def test_the_two_batch_split_of_unequal_chunks_keeps_every_token_and_end():
    # whole chunks where they balance: 3000 | 1000 + 2000
    a, b = split_chunks([(3000, 0), (1000, 100), (2000, 0)])
    assert [(p.tokens, p.context) for p in a] == [(3000, 0)]
    assert [(p.tokens, p.context) for p in b] == [(1000, 100), (2000, 0)]
    # 4000 | 1000 is off balance: cut at 2500 tokens, the cut chunk's rest attends to it
    a, b = split_chunks([(4000, 0), (1000, 0)])
    assert [(p.tokens, p.context, p.ends) for p in a] == [(2500, 0, 0)]
    assert [(p.tokens, p.context, p.ends) for p in b] == [(1500, 2500, 1), (1000, 0, 1)]
    for chunks in ([(7, 0), (900, 10), (33, 0)], [(1, 0), (1, 5)], [(4096, 0), (512, 0)] * 3):
        a, b = split_chunks(chunks)
        assert sum(p.total for p in (*a, *b)) == sum(t for t, _ in chunks)
        assert sum(p.ends for p in (*a, *b)) == len(chunks)
        keys = sum(t * (c + (t + 1) / 2) for t, c in chunks)
        assert sum(p.keys for p in (*a, *b)) == pytest.approx(keys)


def test_the_capacity_packs_short_prompts_and_leaves_a_lone_prompt_alone():
    s = _s("model.preset=llama-3-8b", "prefill.chunked_prefill_size=8192")
    one = [Request(room=0, arrival_s=0.0, prompt_tokens=1024, prefix_tokens=0)]
    assert prefill_work(s, one) == (1024.0, prompt_forward_s(s, 1024))
    many = [Request(room=i, arrival_s=0.0, prompt_tokens=1024, prefix_tokens=0) for i in range(16)]
    # 8 prompts of 1,024 tokens a forward of 8,192
    assert prefill_work(s, many) == (16 * 1024.0, 2 * prefill_forward(s, 1024, prompts=8).total_s)
    assert prefill_capacity(s, many) > prefill_capacity(s, one)
    # with pipeline stages a packed forward is one stage-step (sim/forward.py PipelineForward)
    pp = _s("model.preset=llama-3-8b", "prefill.pp=2", "prefill.tp=2")
    step = stage_step_s(pp, prefill_forward(pp, 1024, prompts=8).total_s, 8 * 1024)
    assert prefill_work(pp, many) == (16 * 1024.0, 2 * step)
    assert prefill_work(pp, one) == (1024.0, prompt_forward_s(pp, 1024))


@pytest.mark.parametrize("pp", [1, 2])
def test_a_saturated_stream_of_short_prompts_runs_at_the_capacity(pp):
    """512 prompts of 1,000 tokens arriving 0.1 ms apart, far faster than the instance
    forwards them: the simulator packs the waiting prompts 8 a forward (8,192-token
    chunks, 1,008 tokens a prompt in whole pages), so its prompt tokens per second over
    the forwards' span is the capacity's; with 2 pipeline stages, a packed forward a
    stage-step. Tolerance 5%, chosen before running: the first forward starts alone (the
    stream was idle, nothing else waited yet), one forward in about 64, the last may be
    short, and a pipeline fills and drains (one stage-step more); never above the
    capacity."""
    s = _s(
        "model.preset=llama-3.1-8b",
        'workload.prompt="fixed"',
        "workload.prompt_tokens=1000",
        "workload.output_tokens=1",
        'workload.arrival="fixed"',
        "workload.rate_per_s=10000",
        "workload.requests=512",
        "prefill.chunked_prefill_size=8192",
        "cluster.prefill_instances=1",
        f"prefill.pp={pp}",
    )
    res = simulate(s)
    assert res.violations == []  # the live checker
    assert check_records(res.records, "slice") == []
    rooms = room_latencies(res.records)
    assert len(rooms) == 512
    span = max(r["forward_end"] for r in rooms.values()) - min(
        r["forward_start"] for r in rooms.values()
    )
    simulated = 512 * 1000 / span
    capacity = prefill_capacity(s, res.requests)
    assert simulated <= capacity * (1 + 1e-9)
    assert simulated == pytest.approx(capacity, rel=0.05)
    # packed: well above one prompt a forward
    alone = 1000 / prompt_forward_s(s, 1000)
    assert simulated > 1.2 * alone
