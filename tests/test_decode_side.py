"""The decode side in simulation: KV capacity and admission, continuous batching, TPOT."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstage.metrics.rooms import (
    BREAKDOWN,
    request_breakdown,
    request_figures,
    room_latencies,
    summarize,
)
from kvstage.shared.scenario import ScenarioError, load_scenario
from kvstage.shared.serving.decode_model import DecodeModel
from kvstage.shared.serving.memory import GIB
from kvstage.sim.driver import simulate

ROOT = Path(__file__).resolve().parents[1]
P8D2 = ROOT / "scenarios" / "llama3-70b-p8-d2.toml"
ABORT = ROOT / "scenarios" / "faults" / "abort-mid-write.toml"
FIXED = ['workload.prompt="fixed"', "workload.max_prompt_tokens=8192"]  # prompts of prompt_tokens


def by_phase(records, phase):
    return {r.room: r for r in records if r.phase == phase and r.role == "decode" and r.rank == 0}


def test_capacity_and_step_time_follow_memory_weights_and_bandwidth():
    s = load_scenario(P8D2, ["decode.gpu_memory_gib=141"])
    m = DecodeModel(s)
    g = s.geometry()
    kv_token = (
        g.layers * 2 * g.decode_heads * g.head_dim * g.dtype_bytes
    )  # K and V, this rank's heads
    weights = s.model.params_b * 1e9 * 2 / s.decode.tp
    # activations: a batch of max_running_requests tokens x hidden x 8 tensors x 2 B
    act = s.decode.max_running_requests * s.model.hidden * 8 * 2
    assert m.kv_bytes_per_token == kv_token
    assert m.capacity_tokens == int((141 * GIB * 0.9 - weights - act) // kv_token)
    hbm = 3350e9 * 0.8  # H100 HBM x the decode share of it
    # the figure moved (issue 22): a step now also pays its TP all-reduces, 2 per layer
    # of one token x hidden 8192 x 2 B, ring 2 (n-1)/n = 1 at TP2, over NVLink 4's
    # 450 GB/s x 0.8; issue 35: each all-reduce's NVLink latency at 2 GPUs, 6 us, and
    # the kernels' fixed costs, 80 layers x 10 kernels x 5 us; the weights read less
    # the embedding (vocab 128,256 x hidden 8,192 x 2 B over TP2: a lookup)
    allreduce = 2 * 80 * (8192 * 2 * 1 / (450e9 * 0.8) + 6e-6)
    read = weights - 128256 * 8192 * 2 / 2
    # the weight matmuls and the attention are kernels of their own, each memory bound
    assert m.step_time_s(1000) == pytest.approx(
        m.step_overhead_s + (read + 1000 * kv_token) / hbm + allreduce + 80 * 10 * 5e-6
    )
    # unset: the decode GPU's own memory (h100-sxm, 80 GiB)
    assert DecodeModel(load_scenario(P8D2)).capacity_tokens == int(
        (80 * GIB * 0.9 - weights - act) // kv_token
    )


def test_gpu_memory_below_the_weights_is_one_clear_error():
    with pytest.raises(
        ScenarioError,
        match=r"decode.gpu_memory_gib = 40.0: 65.8 GiB of weights per GPU > 36 GiB usable "
        "on h100-sxm at TP2",
    ):
        load_scenario(P8D2, ["decode.gpu_memory_gib=40"])


def test_one_request_alone_takes_one_step_per_token_with_its_kv_growing():
    """Alone in the batch, a request's first token reaches the client as it joins (the
    prefill made it) and the other N - 1 each take a step of its own KV, growing by one
    token per step: TPOT = (E2E - TTFT) / (N - 1) is their mean, ITL each step."""
    s = load_scenario(
        P8D2,
        [*FIXED, "workload.requests=1", "workload.output_tokens=50", "workload.prompt_tokens=4096"],
    )
    res = simulate(s)
    gen = by_phase(res.records, "generate")[0]
    m = DecodeModel(s)
    steps = [m.step_time_s(4096 + i) for i in range(49)]
    assert gen.end - gen.start == pytest.approx(sum(steps), rel=1e-9)
    assert gen.requests == 50
    # the room's pages were freed only after its last token: the run ends then
    assert res.sim_time_s == pytest.approx(gen.end)
    per = request_breakdown(room_latencies(res.records))
    assert per["tpot_s"] == [pytest.approx(sum(steps) / 49)]
    assert per["itl_s"] == pytest.approx(steps, rel=1e-9)
    assert per["e2e_s"][0] == pytest.approx(gen.end - res.requests[0].arrival_s, abs=1e-6)
    assert per["ttft_s"][0] == pytest.approx(gen.start - res.requests[0].arrival_s, abs=1e-6)


def one_slot_four(n: int, prompt: int) -> list[str]:
    """Four prompts of `prompt` tokens at once, `n` output tokens each, one decode slot."""
    return [
        *FIXED,
        "workload.requests=4",
        f"workload.output_tokens={n}",
        f"workload.prompt_tokens={prompt}",
        'workload.arrival="fixed"',
        "workload.rate_per_s=1000000",
        "decode.max_running_requests=1",
    ]


def test_one_slot_four_prompts_tpot_is_the_step_and_ttft_includes_the_wait():
    """decode.max_running_requests = 1 and four prompts at once (the closed form of issue
    36): each request generates alone, so its TPOT is its own steps' mean (no wait in
    it) and every gap is one step; a request's first token comes when the one before
    it finished, so its TTFT holds the whole generations of those before it."""
    n, prompt = 40, 2048
    s = load_scenario(P8D2, one_slot_four(n, prompt))
    res = simulate(s)
    assert res.rooms_done == 4 and not res.violations
    m = DecodeModel(s)
    steps = [m.step_time_s(prompt + i) for i in range(n - 1)]
    rooms = room_latencies(res.records)
    order = sorted(rooms, key=lambda r: rooms[r]["first_token"])
    for k, room in enumerate(order):
        info = rooms[room]
        figs = request_figures(info)
        assert figs["tpot_s"] == pytest.approx(sum(steps) / (n - 1), rel=1e-9)
        assert info["itls"] == pytest.approx(steps, rel=1e-9)
        if k:  # it got the slot the moment the one before it sent its last token
            before = rooms[order[k - 1]]
            assert info["first_token"] == pytest.approx(before["last_token"], abs=1e-12)
            assert figs["ttft_s"] >= k * sum(steps) - 1e-9
            assert info["first_token"] - info["done"] > 0  # the wait for the slot
    per = request_breakdown(rooms)
    assert max(per["ttft_s"]) > 3 * sum(steps)
    assert max(per["tpot_s"]) == pytest.approx(sum(steps) / (n - 1), rel=1e-9)
    # the breakdown adds up to TTFT, request by request
    for room in order:
        info = rooms[room]
        parts = sum(info[b] - info[a] for a, b in BREAKDOWN.values())
        assert parts == pytest.approx(request_figures(info)["ttft_s"], abs=1e-9)


def test_first_token_from_the_prefill_moves_the_slot_wait_from_ttft_to_tpot():
    """decode.first_token = "prefill" (DistServe): the same run as above, but the client
    gets each first token at its prompt's last forward end; the wait for the one decode
    slot then sits between its first and second token. The last tokens do not move."""
    n, prompt = 40, 2048
    sets = one_slot_four(n, prompt)
    by_decode = room_latencies(simulate(load_scenario(P8D2, sets)).records)
    res = simulate(load_scenario(P8D2, [*sets, 'decode.first_token="prefill"']))
    assert res.rooms_done == 4 and not res.violations
    rooms = room_latencies(res.records)
    streamed = [r for r in res.records if r.phase == "first_token"]
    assert sorted(r.room for r in streamed) == sorted(rooms)  # one row a room, at a prefill
    assert all(r.role == "prefill" for r in streamed)
    waits = 0.0
    for room, info in rooms.items():
        figs = request_figures(info)
        assert info["first_token"] == pytest.approx(info["forward_end"], abs=1e-12)
        assert figs["ttft_s"] == pytest.approx(info["forward_end"] - info["arrival"], abs=1e-12)
        assert info["last_token"] == pytest.approx(by_decode[room]["last_token"], abs=1e-12)
        assert figs["tpot_s"] == pytest.approx(
            (info["last_token"] - info["first_token"]) / (n - 1), rel=1e-12
        )
        # the gaps are the client's: the first holds the transfer and the slot wait
        assert len(info["itls"]) == n - 1
        assert sum(info["itls"]) == pytest.approx(info["last_token"] - info["first_token"])
        assert info["itls"][1:] == pytest.approx(by_decode[room]["itls"][1:], rel=1e-9)
        waits += info["generate_start"] - info["first_token"]
        assert figs["ttft_s"] < request_figures(by_decode[room])["ttft_s"]
    assert waits > 3 * sum(DecodeModel(res.scenario).step_time_s(prompt + i) for i in range(n - 1))


def test_admission_waits_for_kv_pages_held_by_generating_rooms():
    """A KV pool holding one room at a time: the second request arrives while the first
    generates, waits (an `arrive` row), and opens only when the first's pages are
    freed at its last token."""
    m = DecodeModel(load_scenario(P8D2))
    # memory for exactly one room (8192 prompt + 64 output tokens) at utilization 1
    room_bytes = (8192 + 64) * m.kv_bytes_per_token
    gib = (m.weight_bytes + room_bytes * 1.5) / GIB
    s = load_scenario(
        P8D2,
        [
            *FIXED,
            *(
                f"{k}={v}"
                for k, v in (
                    ("workload.requests", 2),
                    ("workload.arrival", '"fixed"'),
                    ("workload.rate_per_s", 100),
                    ("workload.prompt_tokens", 8192),
                    ("workload.output_tokens", 64),
                    ("decode.gpu_memory_gib", gib),
                    ("decode.memory_utilization", 1.0),
                )
            ),
        ],
    )
    res = simulate(s)
    assert res.rooms_done == 2 and not res.violations
    gen, opened, arrived = (by_phase(res.records, p) for p in ("generate", "room_open", "arrive"))
    assert 1 in arrived and 0 not in arrived  # only the second waited
    assert opened[1].start == pytest.approx(gen[0].end)  # admitted when room 0's pages came back
    summary = summarize(res.records, mode="sim", pool_bytes=s.pool_bytes, requests=2)
    assert summary["decode_admission_wait_s"]["max"] == pytest.approx(gen[0].end - arrived[1].start)
    assert summary["tpot_s"]["count"] == 2 and summary["e2e_s"]["count"] == 2


def test_batched_rooms_share_steps():
    """Two rooms generating together take longer per token than one alone (the batch's
    KV is read every step) but far less than twice: that is what batching buys."""
    base = [
        *FIXED,
        "workload.prompt_tokens=4096",
        "workload.output_tokens=200",
        'workload.arrival="fixed"',
    ]
    alone = simulate(load_scenario(P8D2, [*base, "workload.requests=1"]))
    pair = simulate(load_scenario(P8D2, [*base, "workload.requests=2", "workload.rate_per_s=1000"]))
    t1 = request_breakdown(room_latencies(alone.records))["tpot_s"][0]
    t2 = max(request_breakdown(room_latencies(pair.records))["tpot_s"])
    assert t1 < t2 < 1.2 * t1


def test_a_failed_room_never_holds_the_others_generation():
    """A room aborted mid-write fails at the decode; the other rooms generate and the run
    ends (nothing waits for a room that will never join the batch)."""
    res = simulate(load_scenario(ABORT, ["workload.output_tokens=16"]))
    assert set(res.failures) == {2}
    gens = {r.room for r in res.records if r.phase == "generate"}
    assert gens == {r.room for r in res.requests} - {2}


def test_without_output_tokens_nothing_of_the_decode_side_is_traced():
    res = simulate(load_scenario(P8D2, ["workload.requests=4"]))
    assert not [r for r in res.records if r.phase in ("generate", "arrive")]
    summary = summarize(res.records, mode="sim", pool_bytes=1, requests=4)
    assert "tpot_s" not in summary and "decode_admission_wait_s" not in summary


def test_max_running_requests_caps_the_batch():
    """Six rooms at once, at most two running: they generate two at a time, in three
    rounds, each step at least the time of a batch of two; uncapped, they overlap."""
    base = [
        *FIXED,
        "workload.prompt_tokens=1024",
        "workload.output_tokens=20",
        'workload.arrival="fixed"',
        "workload.rate_per_s=100000",
        "workload.requests=6",
    ]
    capped_s = load_scenario(P8D2, [*base, "decode.max_running_requests=2"])
    capped, free = simulate(capped_s), simulate(load_scenario(P8D2, base))
    assert capped.rooms_done == free.rooms_done == 6

    def span(res):
        gens = by_phase(res.records, "generate").values()
        return max(g.end for g in gens) - min(g.start for g in gens)

    m = DecodeModel(capped_s)
    # a round of two rooms takes at least 19 steps of a batch of two (KV >= 2 prompts):
    # the first of the 20 tokens comes from the prefill
    one_round = 19 * m.step_time_s(2 * 1024, 2)
    assert span(capped) >= 3 * one_round * 0.99
    # uncapped, the rooms join as their prefills end and overlap: at least one round less
    assert span(free) < span(capped) - one_round
