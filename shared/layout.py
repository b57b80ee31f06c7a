"""KV geometry under a tensor-parallel mismatch: who writes which heads where.

With prefill pipeline stages (`prefill_pp` > 1) a prefill instance is pp stages of
prefill_tp ranks each, rank p = stage x prefill_tp + TP rank; a stage's ranks hold and
send only their stage's layers ([C] SGLang: each prefill PP stage writes its layers'
KV into the decode's matching layers, disaggregation/common/conn.py
`get_mha_kv_ptrs_with_pp` / `get_mla_kv_ptrs_with_pp` slicing the decode's per-layer
pointers from the stage's `prefill_start_layer`). A decode rank's writers are then its
TP writers in every stage, stage by stage, each block holding its stage's layers.

Everything here is a pure function of integers, so the simulator, the hardware
drivers, the CLI and the tests all agree on one mapping (docs/design.md, "Rank mapping"
and "Head slices").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

DTYPE_BYTES: dict[str, int] = {"fp8": 1, "bf16": 2, "fp16": 2, "fp32": 4}
# "mha": K and V heads split across TP ranks (GQA/MQA included: fewer KV heads than
# query heads). "mla": multi-head latent attention (DeepSeek-V2/V3, Kimi-K2), one
# compressed latent vector per token per layer, replicated on every TP rank.
ATTENTION_KINDS: tuple[str, ...] = ("mha", "mla")


class LayoutError(ValueError):
    """A TP / head geometry that the staging protocol cannot map."""


@dataclass(frozen=True, slots=True)
class HeadSlice:
    """Heads one prefill rank sends to one decode rank.

    `src_head_start` indexes the prefill rank's local heads, `dst_head_start` the
    decode rank's local heads; both slices are `num_heads` long.
    """

    src_head_start: int
    num_heads: int
    dst_head_start: int


@dataclass(frozen=True, slots=True)
class Chunk:
    """One chunk of a room: pages [page_start, page_start + num_pages) after the prefix."""

    index: int
    page_start: int
    num_pages: int


@dataclass(frozen=True, slots=True)
class WriterBlock:
    """One writer's block inside a chunk's staging region."""

    writer: int  # writer index on this decode rank (0..W-1)
    prefill_rank: int
    offset: int  # bytes from the region start
    nbytes: int
    heads: HeadSlice
    layer_start: int = 0  # the first layer of the block (its writer's pipeline stage)
    num_layers: int = 0  # layers in the block; 0: every layer of the model


@dataclass(frozen=True, slots=True)
class StagingLayout:
    """Byte layout of one chunk's staging region on one decode rank."""

    decode_rank: int
    num_tokens: int
    blocks: tuple[WriterBlock, ...]
    region_bytes: int


def _check_tp(name: str, tp: int) -> None:
    if not isinstance(tp, int) or tp < 1:
        raise LayoutError(f"{name} must be a positive integer, got {tp!r}")


def validate_tp(prefill_tp: int, decode_tp: int, total_kv_heads: int) -> None:
    """Reject geometries the rank mapping cannot express, naming what is allowed."""
    _check_tp("prefill_tp", prefill_tp)
    _check_tp("decode_tp", decode_tp)
    _check_tp("total_kv_heads", total_kv_heads)
    big, small = max(prefill_tp, decode_tp), min(prefill_tp, decode_tp)
    if big % small:
        raise LayoutError(
            f"prefill_tp={prefill_tp} and decode_tp={decode_tp} must divide one another "
            "(allowed: one is a multiple of the other, e.g. 8 and 2)"
        )
    for name, tp in (("prefill_tp", prefill_tp), ("decode_tp", decode_tp)):
        if tp % total_kv_heads and total_kv_heads % tp:
            raise LayoutError(
                f"{name}={tp} and total_kv_heads={total_kv_heads} must divide one another "
                "(allowed: the TP size divides the KV head count, or is a multiple of it)"
            )


def heads_per_rank(tp: int, total_kv_heads: int) -> int:
    """Local KV heads of one rank; with replication (tp > heads) each rank holds one."""
    return max(1, total_kv_heads // tp)


def owned_heads(tp: int, rank: int, total_kv_heads: int) -> range:
    """Global KV heads a rank holds. With tp > heads, tp/heads consecutive ranks share one."""
    per = heads_per_rank(tp, total_kv_heads)
    replication = max(1, tp // total_kv_heads)
    start = (rank // replication) * per
    return range(start, start + per)


def mla_writers_of(decode_rank: int, prefill_tp: int, decode_tp: int) -> list[int]:
    """MLA: the one prefill rank decode rank d reads from, d % prefill_tp.

    Every prefill rank holds the whole latent, so any one will do; d % P spreads the
    decode ranks over the prefill ranks (with P > D, ranks D..P-1 send nothing).
    """
    if not 0 <= decode_rank < decode_tp:
        raise LayoutError(f"decode_rank={decode_rank} out of range 0..{decode_tp - 1}")
    return [decode_rank % prefill_tp]


def mla_targets_of(prefill_rank: int, prefill_tp: int, decode_tp: int) -> list[int]:
    """MLA: the decode ranks whose one writer `prefill_rank` is (possibly none)."""
    if not 0 <= prefill_rank < prefill_tp:
        raise LayoutError(f"prefill_rank={prefill_rank} out of range 0..{prefill_tp - 1}")
    return list(range(prefill_rank, decode_tp, prefill_tp))


def writers_of(decode_rank: int, prefill_tp: int, decode_tp: int) -> list[int]:
    """Prefill ranks that write to `decode_rank`, in writer order."""
    if not 0 <= decode_rank < decode_tp:
        raise LayoutError(f"decode_rank={decode_rank} out of range 0..{decode_tp - 1}")
    if prefill_tp > decode_tp:
        fan_in = prefill_tp // decode_tp
        return list(range(decode_rank * fan_in, (decode_rank + 1) * fan_in))
    return [decode_rank // (decode_tp // prefill_tp)]


def targets_of(prefill_rank: int, prefill_tp: int, decode_tp: int) -> list[int]:
    """Decode ranks that `prefill_rank` writes to (one with fan-in, several with fan-out)."""
    if not 0 <= prefill_rank < prefill_tp:
        raise LayoutError(f"prefill_rank={prefill_rank} out of range 0..{prefill_tp - 1}")
    if prefill_tp > decode_tp:
        return [prefill_rank // (prefill_tp // decode_tp)]
    fan_out = decode_tp // prefill_tp
    return list(range(prefill_rank * fan_out, (prefill_rank + 1) * fan_out))


def writer_index(prefill_rank: int, decode_rank: int, prefill_tp: int, decode_tp: int) -> int:
    """Position of `prefill_rank` among the writers of `decode_rank`."""
    writers = writers_of(decode_rank, prefill_tp, decode_tp)
    try:
        return writers.index(prefill_rank)
    except ValueError:
        raise LayoutError(
            f"prefill rank {prefill_rank} does not write to decode rank {decode_rank} "
            f"(its writers are {writers})"
        ) from None


def head_slice(
    prefill_tp: int, decode_tp: int, prefill_rank: int, decode_rank: int, total_kv_heads: int
) -> HeadSlice:
    """The heads `prefill_rank` sends to `decode_rank` (docs/design.md, "Head slices")."""
    validate_tp(prefill_tp, decode_tp, total_kv_heads)
    writer_index(prefill_rank, decode_rank, prefill_tp, decode_tp)  # raises if not paired
    sh = heads_per_rank(prefill_tp, total_kv_heads)
    dh = heads_per_rank(decode_tp, total_kv_heads)
    if prefill_tp > decode_tp:
        dst = ((prefill_rank // max(1, prefill_tp // total_kv_heads)) * sh) % dh
        return HeadSlice(src_head_start=0, num_heads=sh, dst_head_start=dst)
    # Integer division, not modulo: with replication consecutive decode ranks share a head.
    src = ((decode_rank // max(1, decode_tp // total_kv_heads)) * dh) % sh
    return HeadSlice(src_head_start=src, num_heads=dh, dst_head_start=0)


_cached_head_slice = lru_cache(maxsize=65536)(head_slice)


def stage_layer_ranges(layers: int, pp: int) -> tuple[range, ...]:
    """The layers of each pipeline stage, first to last: layers // pp each, the last
    layers % pp stages one more ([C] SGLang python/sglang/srt/distributed/utils.py
    `get_pp_indices`: "the last N partitions will have one extra layer, where N =
    remainder")."""
    if not isinstance(pp, int) or not 1 <= pp <= layers:
        raise LayoutError(f"prefill_pp must be an integer in 1..layers ({layers}), got {pp!r}")
    base, extra = divmod(layers, pp)
    out, start = [], 0
    for i in range(pp):
        n = base + (1 if i >= pp - extra else 0)
        out.append(range(start, start + n))
        start += n
    return tuple(out)


_stage_ranges = lru_cache(maxsize=256)(stage_layer_ranges)


def grid_pages(page_size: int, chunked_prefill_size: int = 8192) -> int:
    """Pages per chunk of the chunk grid."""
    return max(1, chunked_prefill_size // page_size)


def chunk_grid(num_pages: int, page_size: int, chunked_prefill_size: int = 8192) -> list[Chunk]:
    """Split a room of `num_pages` pages into chunks; the last one holds the rest."""
    if num_pages < 0:
        raise LayoutError(f"num_pages must be >= 0, got {num_pages}")
    if page_size < 1:
        raise LayoutError(f"page_size must be >= 1, got {page_size}")
    step = grid_pages(page_size, chunked_prefill_size)
    return [
        Chunk(index=i, page_start=start, num_pages=min(step, num_pages - start))
        for i, start in enumerate(range(0, num_pages, step))
    ]


def room_pages(prompt_tokens: int, prefix_tokens: int, page_size: int) -> int:
    """Pages a room transfers: the prompt after the decode-side cached prefix.

    A prefix that is not page aligned would shift every page, so it is refused
    with a clear reason instead of mis-offsetting the copy.
    """
    if prefix_tokens % page_size:
        raise LayoutError(
            f"decode prefix of {prefix_tokens} tokens is not a multiple of page_size={page_size}"
        )
    if prefix_tokens > prompt_tokens:
        raise LayoutError(
            f"decode prefix {prefix_tokens} exceeds the prompt ({prompt_tokens} tokens)"
        )
    return math.ceil((prompt_tokens - prefix_tokens) / page_size)


@dataclass(frozen=True, slots=True)
class Geometry:
    """All the numbers the protocol needs about model, TP sizes and paging.

    MLA (`attention="mla"`) is one "head" of width `head_dim` = the latent width
    (kv_lora_rank + rope dim), K only: `total_kv_heads` is 1 and `kv_factor` 1, so
    the byte layout, head slices and slice-path requests of MHA apply unchanged with
    a single KV plane; only who writes to whom differs (`mla_writers_of`).
    """

    prefill_tp: int
    decode_tp: int
    total_kv_heads: int
    layers: int
    head_dim: int
    dtype_bytes: int
    page_size: int
    chunked_prefill_size: int = 8192
    attention: str = "mha"
    prefill_pp: int = 1  # pipeline stages of a prefill instance, prefill_tp ranks each

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_KINDS:
            raise LayoutError(
                f"attention must be one of {', '.join(ATTENTION_KINDS)}, got {self.attention!r}"
            )
        if self.attention == "mla" and self.total_kv_heads != 1:
            raise LayoutError(
                f"MLA has one latent vector per token per layer: total_kv_heads must be 1 "
                f"(head_dim = the latent width), got {self.total_kv_heads}"
            )
        validate_tp(self.prefill_tp, self.decode_tp, self.total_kv_heads)
        for name in ("layers", "head_dim", "dtype_bytes", "page_size", "chunked_prefill_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"{name} must be a positive integer, got {value!r}")
        stage_layer_ranges(self.layers, self.prefill_pp)  # raises if not 1..layers

    @property
    def mla(self) -> bool:
        """True when every rank holds the whole latent KV: nothing to reshard."""
        return self.attention == "mla"

    @property
    def kv_factor(self) -> int:
        """KV planes per layer: K and V (2), or MLA's single latent (1)."""
        return 1 if self.attention == "mla" else 2

    @property
    def prefill_heads(self) -> int:
        return heads_per_rank(self.prefill_tp, self.total_kv_heads)

    @property
    def decode_heads(self) -> int:
        return heads_per_rank(self.decode_tp, self.total_kv_heads)

    @property
    def grid_pages(self) -> int:
        return grid_pages(self.page_size, self.chunked_prefill_size)

    @property
    def chunk_tokens(self) -> int:
        """Tokens of a full chunk: chunked_prefill_size rounded down to whole pages, the
        one reading of it everywhere ([C] SGLang's PrefillAdder truncates a chunk to
        rem_chunk_tokens // page_size * page_size, python/sglang/srt/managers/
        schedule_policy.py, and schedules none below a page)."""
        return self.grid_pages * self.page_size

    @property
    def prefill_ranks(self) -> int:
        """Ranks of one prefill instance: prefill_tp in each of prefill_pp stages."""
        return self.prefill_tp * self.prefill_pp

    def writer_layers(self, prefill_rank: int) -> range:
        """The layers `prefill_rank` holds and sends: its pipeline stage's (all of them
        without stages)."""
        if not 0 <= prefill_rank < self.prefill_ranks:
            raise LayoutError(
                f"prefill_rank={prefill_rank} out of range 0..{self.prefill_ranks - 1}"
            )
        return _stage_ranges(self.layers, self.prefill_pp)[prefill_rank // self.prefill_tp]

    def _tp_rank(self, prefill_rank: int) -> int:
        """`prefill_rank`'s rank in its stage's TP group (itself without stages)."""
        if self.prefill_pp == 1:
            return prefill_rank
        self.writer_layers(prefill_rank)  # raises when out of range
        return prefill_rank % self.prefill_tp

    def writers(self, decode_rank: int) -> list[int]:
        """Prefill ranks that write to `decode_rank`, in writer order: its TP writers,
        stage by stage."""
        if self.attention == "mla":
            local = mla_writers_of(decode_rank, self.prefill_tp, self.decode_tp)
        else:
            local = writers_of(decode_rank, self.prefill_tp, self.decode_tp)
        if self.prefill_pp == 1:
            return local
        return [s * self.prefill_tp + p for s in range(self.prefill_pp) for p in local]

    def targets(self, prefill_rank: int) -> list[int]:
        """Decode ranks `prefill_rank` writes to; with MLA and P > D possibly none."""
        prefill_rank = self._tp_rank(prefill_rank)
        if self.attention == "mla":
            return mla_targets_of(prefill_rank, self.prefill_tp, self.decode_tp)
        return targets_of(prefill_rank, self.prefill_tp, self.decode_tp)

    def head_slice(self, prefill_rank: int, decode_rank: int) -> HeadSlice:
        if self.attention == "mla":
            # The whole latent, from and to local "head" 0, once paired.
            if prefill_rank not in self.writers(decode_rank):
                raise LayoutError(
                    f"prefill rank {prefill_rank} does not write to decode rank {decode_rank} "
                    f"(MLA: its one writer is prefill rank {decode_rank % self.prefill_tp}"
                    f"{' in each stage' if self.prefill_pp > 1 else ''})"
                )
            return HeadSlice(src_head_start=0, num_heads=1, dst_head_start=0)
        return _cached_head_slice(
            self.prefill_tp,
            self.decode_tp,
            self._tp_rank(prefill_rank),
            decode_rank,
            self.total_kv_heads,
        )

    def chunks(self, num_pages: int) -> list[Chunk]:
        return chunk_grid(num_pages, self.page_size, self.chunked_prefill_size)

    # --- bytes -----------------------------------------------------------------
    def head_token_bytes(self, heads: int) -> int:
        """Bytes of `heads` heads of one token in one layer for K or V."""
        return heads * self.head_dim * self.dtype_bytes

    def kv_bytes_per_token(self) -> int:
        """Whole model, all heads, K and V (MLA: the latent once): one prompt token's KV."""
        return self.kv_factor * self.layers * self.head_token_bytes(self.total_kv_heads)

    def block_bytes(self, num_tokens: int, heads: int) -> int:
        """One writer block of every layer: [K layer 0..L-1, V layer 0..L-1] x
        [T][heads][head_dim] (MLA: [latent layer 0..L-1] x [T][1][latent])."""
        return self.kv_factor * self.layers * num_tokens * self.head_token_bytes(heads)

    def writer_block_bytes(self, prefill_rank: int, num_tokens: int, heads: int) -> int:
        """The block `prefill_rank` writes: `block_bytes` over its stage's layers only."""
        if self.prefill_pp == 1:
            return self.block_bytes(num_tokens, heads)
        layers = len(self.writer_layers(prefill_rank))
        return self.kv_factor * layers * num_tokens * self.head_token_bytes(heads)

    def staging_layout(self, decode_rank: int, num_pages: int) -> StagingLayout:
        """Writer blocks back to back for one chunk of `num_pages` pages on `decode_rank`."""
        return _staging_layout(self, decode_rank, num_pages)

    def region_bytes(self, num_pages: int) -> int:
        """Staging bytes one chunk of `num_pages` needs on a decode rank (same on every rank)."""
        return self.staging_layout(0, num_pages).region_bytes

    def chunk_bytes(self) -> int:
        """Staging bytes of one full chunk on one decode rank."""
        return self.region_bytes(self.grid_pages)

    def pool_chunks(self, pool_bytes: int) -> int:
        """How many full chunks a staging pool of `pool_bytes` holds at once."""
        return pool_bytes // self.chunk_bytes()

    # --- the slice path --------------------------------------------------------
    def slice_contiguous_pages(self, prefill_rank: int, decode_rank: int) -> bool:
        """True when a head slice is a whole token row on both sides.

        Then a page of tokens is one contiguous run and costs one request per
        (page, layer, K/V); otherwise every token is its own strided piece. MLA's
        latent is always a whole row: one request per (page, layer).
        """
        hs = self.head_slice(prefill_rank, decode_rank)
        return hs.num_heads == self.prefill_heads == self.decode_heads

    def slice_requests(self, prefill_rank: int, decode_rank: int, num_pages: int) -> int:
        """Transfer requests one writer issues for `num_pages` pages on the slice path."""
        per_kv_layer = (
            num_pages
            if self.slice_contiguous_pages(prefill_rank, decode_rank)
            else num_pages * self.page_size
        )
        return self.kv_factor * len(self.writer_layers(prefill_rank)) * per_kv_layer


@lru_cache(maxsize=4096)
def _staging_layout(g: Geometry, decode_rank: int, num_pages: int) -> StagingLayout:
    # Cached: the simulator asks for the same few chunk sizes hundreds of thousands of times.
    tokens = num_pages * g.page_size
    blocks = []
    offset = 0
    for w, p in enumerate(g.writers(decode_rank)):
        hs = g.head_slice(p, decode_rank)
        layers = g.writer_layers(p)
        nbytes = g.writer_block_bytes(p, tokens, hs.num_heads)
        blocks.append(WriterBlock(w, p, offset, nbytes, hs, layers.start, len(layers)))
        offset += nbytes
    return StagingLayout(decode_rank, tokens, tuple(blocks), offset)


def staging_address(
    geometry: Geometry,
    layout: StagingLayout,
    writer: int,
    kv: int,
    layer: int,
    token: int,
    head: int,
) -> int:
    """Byte offset, from the region start, of element 0 of (writer, K/V, layer, token, head).

    `kv` is 0 (K) or 1 (V); MLA has only plane 0, the latent. `layer` is the model's
    layer, one of the writer's (its pipeline stage's)."""
    block = layout.blocks[writer]
    heads = block.heads.num_heads
    t = layout.num_tokens
    b = geometry.dtype_bytes
    d = geometry.head_dim
    layers = block.num_layers or geometry.layers
    local = layer - block.layer_start
    if not 0 <= local < layers:
        raise LayoutError(
            f"layer {layer} is not in writer {writer}'s block (layers {block.layer_start}.."
            f"{block.layer_start + layers - 1})"
        )
    return block.offset + (kv * layers + local) * t * heads * d * b + (token * heads + head) * d * b
