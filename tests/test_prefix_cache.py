"""The prefill's prefix cache (shared/serving/prefix_cache.py): LRU over 512-token blocks keyed by
a Mooncake trace's hash_ids, its capacity from the prefill GPU's memory, and what a hit
saves in a simulated run (compute, not transfer)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstage.metrics.rooms import room_latencies
from kvstage.run.summary import simulation_summary
from kvstage.shared.scenario import load_scenario
from kvstage.shared.serving.memory import cache_blocks, side_memory
from kvstage.shared.serving.prefix_cache import BLOCK_TOKENS, PrefixCache, cached_in_chunk
from kvstage.shared.workload import generate_requests
from kvstage.sim.driver import Simulation

# --------------------------------------------------------------------------- the cache


def test_lru_eviction_in_closed_form() -> None:
    c = PrefixCache(capacity_blocks=2)
    # a, b: both cached; nothing hit yet
    assert c.admit([1], 512) == 0 and c.admit([2], 512) == 0
    assert c.blocks() == [1, 2] and c.stats.evicted_blocks == 0
    assert c.admit([1], 1024) == 512  # 1 hits, and becomes the newest: LRU order 2, 1
    assert c.blocks() == [2, 1]
    assert c.admit([3], 512) == 0  # 3 evicts the least recently used, 2
    assert c.blocks() == [1, 3] and c.stats.evicted_blocks == 1
    assert c.admit([2], 512) == 0  # 2 is gone: a miss, and it evicts 1
    assert c.blocks() == [3, 2] and c.stats.evicted_blocks == 2
    # 5 prompts of 512, 512, 1024, 512, 512 tokens; 512 of them cached
    assert (c.stats.prompt_tokens, c.stats.cached_tokens) == (3072, 512)
    assert c.stats.hit_fraction == pytest.approx(512 / 3072)


def test_match_is_a_prefix_and_leaves_a_token_to_compute() -> None:
    c = PrefixCache(capacity_blocks=100)
    c.admit([10, 11, 12], 3 * 512)
    # the run of leading ids present: a miss ends it (an id names its block after its
    # whole prefix, so block 12 after 99 is not the cached 12)
    assert c.match([10, 11, 12]) == 3 and c.match([10, 99, 12]) == 1 and c.match([5, 10]) == 0
    # the whole prompt cached: one token is still computed (SGLang's input_len - 1)
    assert c.admit([10, 11, 12], 3 * 512) == 3 * 512 - 1
    # a longer prompt sharing the first two blocks
    assert c.admit([10, 11, 7, 8], 2000) == 2 * 512
    # a partial last block counts only the prompt's tokens
    assert c.admit([10], 300) == 299


def test_a_prefix_outlives_its_extensions() -> None:
    c = PrefixCache(capacity_blocks=2)
    c.admit([1, 2, 3], 3 * 512)  # three blocks into two: the last one goes first
    assert sorted(c.blocks()) == [1, 2] and 3 not in c
    assert c.match([1, 2, 3]) == 2


def test_capacity_zero_caches_nothing_and_negative_is_refused() -> None:
    c = PrefixCache(0)
    assert c.admit([1, 2], 1024) == 0 and c.admit([1, 2], 1024) == 0 and len(c) == 0
    with pytest.raises(ValueError, match="capacity_blocks"):
        PrefixCache(-1)


def test_cached_tokens_of_a_chunk() -> None:
    # cached prefix [0, 1000): chunks of 512 tokens
    assert [cached_in_chunk(1000, s, 512) for s in (0, 512, 1024)] == [512, 488, 0]
    assert cached_in_chunk(0, 0, 512) == 0


# --------------------------------------------------------------------------- in a run

SCENARIO = """
[model]
layers = 2
kv_heads = 8
head_dim = 16
params_b = 0.1
dtype = "bf16"
[prefill]
tp = 2
chunked_prefill_size = 512
[decode]
tp = 1
page_size = 16
staging_pool_mb = 8
[links]
profile = "loopback-cpu"
[workload]
arrival = "trace"
trace = "trace.jsonl"
"""
# a conversation: turn 2 extends turn 1's prompt (4 blocks of 512 tokens); a third
# prompt shares only the first block, a fourth nothing. Far apart: no queueing.
TURNS = [
    {"timestamp": 0, "input_length": 2048, "output_length": 4, "hash_ids": [1, 2, 3, 4]},
    {"timestamp": 1000, "input_length": 2900, "output_length": 4, "hash_ids": [1, 2, 3, 4, 5, 6]},
    {"timestamp": 2000, "input_length": 1024, "output_length": 4, "hash_ids": [1, 9]},
    {"timestamp": 3000, "input_length": 1024, "output_length": 4, "hash_ids": [7, 8]},
]
CACHED = [0, 2048, 512, 0]


def write(tmp_path: Path, rows: list[dict], *extra: str) -> Path:
    (tmp_path / "trace.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = tmp_path / "scenario.toml"
    path.write_text(SCENARIO + "".join(f"{line}\n" for line in extra))
    return path


def run(path: Path, *sets: str):
    s = load_scenario(path, overrides=list(sets))
    result = Simulation(s).run()
    assert result.ok and result.rooms_failed == 0
    return s, result, simulation_summary(s, result)


def compute_s(records) -> dict[int, float]:
    """Per room: the time its prefill forwards took, summed (the group's stream)."""
    out: dict[int, float] = {}
    for r in records:
        if r.role == "prefill" and r.rank == 0 and r.phase == "compute":
            out[r.room] = out.get(r.room, 0.0) + (r.end - r.start)
    return out


def ttft_s(records) -> dict[int, float]:
    return {k: v["done"] - v["arrival"] for k, v in room_latencies(records).items()}


def written_bytes(records) -> int:
    return sum(r.bytes for r in records if r.role == "prefill" and r.phase == "write")


def test_hash_ids_reach_the_requests_cut_to_the_prompt(tmp_path: Path) -> None:
    s = load_scenario(write(tmp_path, TURNS), overrides=["workload.max_prompt_tokens=1500"])
    reqs = generate_requests(s)
    # 1500 tokens are 3 blocks: the ids past them belong to tokens that were cut
    assert [r.hash_ids for r in reqs] == [(1, 2, 3), (1, 2, 3), (1, 9), (7, 8)]
    # prompts not from the trace: its hash ids do not describe them
    fixed = load_scenario(write(tmp_path, TURNS), overrides=['workload.prompt="fixed"'])
    assert all(r.hash_ids == () for r in generate_requests(fixed))


def test_hits_shorten_the_prefill_and_are_reported(tmp_path: Path) -> None:
    _, hit, summary = run(write(tmp_path, TURNS))
    prompts = sum(t["input_length"] for t in TURNS)
    assert summary["prefix_hit_fraction"] == pytest.approx(sum(CACHED) / prompts)
    bare = [{k: v for k, v in t.items() if k != "hash_ids"} for t in TURNS]
    _, miss, bare_summary = run(write(tmp_path, bare))
    assert bare_summary["prefix_hit_fraction"] == 0.0
    with_ids, without = compute_s(hit.records), compute_s(miss.records)
    # the rooms that hit compute less; the others the same
    for room, cached in enumerate(CACHED):
        if cached:
            assert with_ids[room] < without[room]
        else:
            assert with_ids[room] == pytest.approx(without[room])
    ttft, ttft_bare = ttft_s(hit.records), ttft_s(miss.records)
    assert ttft[1] < ttft_bare[1] and ttft[2] < ttft_bare[2]
    # the transfer is not shorter: every page still goes to the decode (SGLang sends
    # the cached prefix's pages too, docs/prefix-reuse.md)
    assert written_bytes(hit.records) == written_bytes(miss.records) > 0


def test_a_cache_per_prefill_instance(tmp_path: Path) -> None:
    # round-robin over two instances: turn 2 (room 1) lands where turn 1 is not cached,
    # the third prompt (room 2) where turn 1 is
    _, _, summary = run(
        write(tmp_path, TURNS), "cluster.prefill_instances=2", 'cluster.router="round-robin"'
    )
    prompts = sum(t["input_length"] for t in TURNS)
    assert summary["prefix_hit_fraction"] == pytest.approx(512 / prompts)


# two conversations, both first turns at once, both second turns at once (B's first)
TWO = [
    {"timestamp": 0, "input_length": 2048, "hash_ids": [1, 2, 3, 4]},
    {"timestamp": 0, "input_length": 2048, "hash_ids": [11, 12, 13, 14]},
    {"timestamp": 1000, "input_length": 2500, "hash_ids": [11, 12, 13, 14, 15]},
    {"timestamp": 1000, "input_length": 2500, "hash_ids": [1, 2, 3, 4, 16]},
]


def first_instance(s, records) -> dict[int, int]:
    """Per room: the prefill instance that opened it."""
    out: dict[int, int] = {}
    for r in records:
        if r.role == "prefill" and r.phase == "room_open":
            out.setdefault(r.room, r.rank // s.prefill.tp)
    return out


def test_cache_aware_router_sends_a_request_where_its_prefix_is(tmp_path: Path) -> None:
    path = write(tmp_path, TWO)
    sets = ["cluster.prefill_instances=2"]
    # least-outstanding: the first turns spread over 0 and 1; B's second turn finds
    # both idle (-> 0), A's then finds 0 busier (-> 1): both miss
    s, lo, lo_summary = run(path, *sets, 'cluster.router="least-outstanding"')
    assert first_instance(s, lo.records) == {0: 0, 1: 1, 2: 0, 3: 1}
    assert lo_summary["prefix_hit_fraction"] == 0.0
    # cache-aware: each second turn goes where its first turn is cached
    s, ca, ca_summary = run(path, *sets, 'cluster.router="cache-aware"')
    assert first_instance(s, ca.records) == {0: 0, 1: 1, 2: 1, 3: 0}
    assert ca_summary["prefix_hit_fraction"] == pytest.approx(2 * 2048 / (2 * 2048 + 2 * 2500))


def test_capacity_from_the_prefill_gpu_memory(tmp_path: Path) -> None:
    s = load_scenario(write(tmp_path, TURNS))
    mem = side_memory(s, "prefill")
    blocks = cache_blocks(s)
    assert blocks == int(mem.kv_bytes // (mem.kv_bytes_per_token * BLOCK_TOKENS)) > 0
    # KV per rank: 2 (K, V) x 2 layers x 8 heads / TP2 x 16 dims x 2 bytes
    assert mem.kv_bytes_per_token == 2 * 2 * 4 * 16 * 2
    assert blocks * mem.kv_bytes_per_token * BLOCK_TOKENS <= mem.kv_bytes


def test_same_trace_same_records(tmp_path: Path) -> None:
    path = write(tmp_path, TURNS)
    _, a, _ = run(path)
    _, b, _ = run(path)
    assert a.records == b.records
