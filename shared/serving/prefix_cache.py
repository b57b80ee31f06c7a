"""The prefill instance's prefix cache: prompt blocks keyed by a trace's hash ids, LRU.

A Mooncake trace names each request's prompt as a list of block ids (`hash_ids`),
block i holding tokens [512 i, 512 (i + 1)) of the prompt ([C] Mooncake's trace
format, FAST'25 artifact `mooncake_trace.jsonl`; the parser is
shared/scenario/trace_mooncake.py), each id naming the block's content after the same
prefix. Two prompts share KV exactly as far as their leading ids agree: the prefix a
radix tree (SGLang's RadixCache) would match, at block granularity.

One `PrefixCache` per prefill instance (each rank of its TP group keeps the same one:
every rank sees the same rooms in the same order, and holds its head shard of each
cached block). On admission a request

- matches its longest run of leading ids present (`match`): those tokens are cached,
  at most prompt - 1 of them ([C] SGLang `Req.init_next_round_input` caps the match at
  input_len - 1: one token is always computed, for the first output's logits);
- then every block of its prompt is (re)inserted as most recently used. The blocks of
  one request are stamped last block first, so a prefix always outlives its
  extensions, as a radix tree evicts leaves first; the least recently used block goes
  when the cache is over capacity ([A] the blocks of a room in flight are not locked
  against eviction, as SGLang's tree locks them: at capacity that evicts a little
  early).

Inserting at admission, not when the forward ends, is exact here: an instance runs its
forwards one at a time in arrival order (sim/forward.py), so a later room's forward
starts after the earlier room computed the blocks it reuses.

Capacity, in blocks, is the prefill GPU's KV memory (shared/serving/memory.py
`cache_blocks`: memory x utilization - weights - activations) over one block's KV on a
rank; the runtime is given it (this module imports nothing of the serving model, so the
rank runtime can keep a cache without it)
([A] the whole KV budget holds the cache: the rooms in flight take their KV from the
same pool in SGLang, which this does not subtract).

What a hit saves is compute only: the prefill still sends the KV of every prompt page
the decode does not hold (docs/prefix-reuse.md: SGLang's send_kv_chunk reads the
request's pages from the start, cached prefix included).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["BLOCK_TOKENS", "PrefixCache", "PrefixStats", "cached_in_chunk"]

# [C] Mooncake trace format: one hash id per 512 tokens of the prompt
BLOCK_TOKENS = 512


@dataclass(slots=True)
class PrefixStats:
    """What the cache served: prompt tokens looked up and how many of them were cached."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    evicted_blocks: int = 0

    @property
    def hit_fraction(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class PrefixCache:
    """LRU cache of prompt blocks (hash ids) of one prefill instance."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
        self.capacity = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.stats = PrefixStats()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: int) -> bool:
        return block in self._blocks

    def blocks(self) -> list[int]:
        """The cached block ids, least recently used first."""
        return list(self._blocks)

    def match(self, hash_ids: Sequence[int]) -> int:
        """How many leading blocks of `hash_ids` are cached (nothing is touched)."""
        n = 0
        for block in hash_ids:
            if block not in self._blocks:
                break
            n += 1
        return n

    def admit(self, hash_ids: Sequence[int], prompt_tokens: int) -> int:
        """A request's prompt arrives: the tokens served from the cache (its longest
        cached prefix, at most prompt_tokens - 1); then its blocks are the newest."""
        matched = self.match(hash_ids)
        cached = max(0, min(matched * BLOCK_TOKENS, prompt_tokens - 1))
        self.stats.prompt_tokens += prompt_tokens
        self.stats.cached_tokens += cached
        if self.capacity:
            for block in reversed(hash_ids):  # last block first: the prefix is newest
                self._blocks[block] = None
                self._blocks.move_to_end(block)
            while len(self._blocks) > self.capacity:
                self._blocks.popitem(last=False)
                self.stats.evicted_blocks += 1
        return cached


def cached_in_chunk(cached_tokens: int, token_start: int, tokens: int) -> int:
    """How many of a chunk's tokens [token_start, token_start + tokens) lie in the
    cached prefix [0, cached_tokens)."""
    return max(0, min(token_start + tokens, cached_tokens) - token_start)
