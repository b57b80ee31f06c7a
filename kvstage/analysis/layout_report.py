"""`kvstage validate`'s derived-layout tables."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from kvstage.fmt import MIB
from kvstage.shared.layout import owned_heads, room_pages
from kvstage.shared.scenario import Scenario
from kvstage.shared.serving.capacity import scenario_gpus
from kvstage.tables import print_table


def _mib(n: float) -> str:
    return f"{n / MIB:,.2f} MiB"


def request_costs(s: Scenario, prompt_tokens: int) -> dict[str, int]:
    """Bytes, chunks and transfer requests of one request of `prompt_tokens` tokens."""
    g = s.geometry()
    prefix = min(s.decode.prefix_tokens, prompt_tokens // g.page_size * g.page_size)
    pages = room_pages(prompt_tokens, prefix, g.page_size)
    chunks = g.chunks(pages)
    staging_requests = slice_requests = staging_bytes = 0
    for d in range(g.decode_tp):
        for c in chunks:
            staging_bytes += g.region_bytes(c.num_pages)
            for p in g.writers(d):
                staging_requests += 1
                slice_requests += g.slice_requests(p, d, c.num_pages)
    return {
        "pages": pages,
        "chunks": len(chunks),
        "bytes": staging_bytes,
        "staging_requests": staging_requests,
        "slice_requests": slice_requests,
    }


def duplicate_share(s: Scenario) -> float:
    """The share of staged bytes that are copies of a head the same decode rank also
    gets from another writer: with prefill TP > KV heads, prefill_tp / kv_heads prefill
    ranks hold each head, and every one of them writes it (and takes its staging space).
    Counted in heads x layers: with pipeline stages a writer's block holds its stage's."""
    g = s.geometry()
    total = unique = 0
    for d in range(g.decode_tp):
        heads: set[tuple[int, int]] = set()
        for p in g.writers(d):
            hs, layers = g.head_slice(p, d), g.writer_layers(p)
            total += hs.num_heads * len(layers)
            dst = range(hs.dst_head_start, hs.dst_head_start + hs.num_heads)
            heads.update((layer, h) for layer in layers for h in dst)
        unique += len(heads)
    return 1 - unique / total if total else 0.0


def mla_mapping(s: Scenario) -> str:
    """One line on MLA's layout: the latent is on every rank, each decode rank reads it
    from one prefill rank, d % P, so the reads spread over the prefill ranks."""
    g = s.geometry()
    pairs = ", ".join(f"{d} <- {g.writers(d)[0]}" for d in range(g.decode_tp))
    idle = [p for p in range(g.prefill_tp) if not g.targets(p)]
    line = (
        f"latent KV replicated on every rank: no head resharding; decode rank d reads from "
        f"prefill rank d % {g.prefill_tp} ({pairs})"
    )
    if idle:
        line += f"; prefill ranks {idle[0]}..{idle[-1]} compute but send nothing"
    return line


def _duplicates_row(s: Scenario) -> str:
    share = duplicate_share(s)
    if s.geometry().mla:
        return "0% (MLA: each decode rank reads the latent once, from one prefill rank)"
    if not share:
        return "0%"
    p, h = s.prefill.tp, s.model.kv_heads
    stage = " of a stage" if s.prefill.pp > 1 else ""
    return (
        f"{share:.0%} (prefill TP{p} > {h} KV heads: {p // h} prefill ranks{stage} hold each "
        "head and each writes it)"
    )


def _ranks_table(s: Scenario) -> Table:
    g = s.geometry()
    what = f"MLA latent of {g.head_dim}" if g.mla else f"{g.total_kv_heads} KV heads"
    pp = f" PP{g.prefill_pp}" if g.prefill_pp > 1 else ""
    ranks = Table(
        title=f"rank mapping: prefill TP{g.prefill_tp}{pp} -> decode TP{g.decode_tp}, {what}"
    )
    cols = ["decode rank", "owns heads", "writer", "prefill rank", "src heads", "dst heads"]
    for col in cols + (["layers"] if pp else []) + ["block bytes/token"]:
        ranks.add_column(col)
    for d in range(g.decode_tp):
        own = owned_heads(g.decode_tp, d, g.total_kv_heads)
        for w, p in enumerate(g.writers(d)):
            hs, layers = g.head_slice(p, d), g.writer_layers(p)
            ranks.add_row(
                str(d) if w == 0 else "",
                f"{own.start}..{own.stop - 1}" if w == 0 else "",
                str(w),
                str(p),
                f"{hs.src_head_start}..{hs.src_head_start + hs.num_heads - 1}",
                f"{hs.dst_head_start}..{hs.dst_head_start + hs.num_heads - 1}",
                *([f"{layers.start}..{layers.stop - 1}"] if pp else []),
                f"{g.writer_block_bytes(p, 1, hs.num_heads):,}",
            )
    return ranks


def layout_report(s: Scenario, console: Console) -> None:
    g = s.geometry()
    print_table(console, _ranks_table(s))
    if g.mla:
        console.print(mla_mapping(s))

    prompt = s.workload.prompt_tokens
    cost = request_costs(s, prompt)
    chunk = g.chunk_bytes()
    sizes = Table(title="sizes", show_header=False)
    sizes.add_column("what")
    sizes.add_column("value", justify="right")
    sizes.add_row("KV bytes per token (whole model)", f"{g.kv_bytes_per_token():,} B")
    sizes.add_row(
        "staging bytes per token per decode rank", f"{g.region_bytes(1) // g.page_size:,} B"
    )
    sizes.add_row(
        "chunk grid",
        f"{g.grid_pages} pages x {g.page_size} tokens = {g.chunk_tokens} tokens",
    )
    sizes.add_row("staging bytes per full chunk per decode rank", f"{chunk:,} B ({_mib(chunk)})")
    sizes.add_row("staging pool per decode rank", f"{s.pool_bytes:,} B ({_mib(s.pool_bytes)})")
    sizes.add_row("full chunks the pool holds", f"{g.pool_chunks(s.pool_bytes) if chunk else 0}")
    sizes.add_row(
        f"request of {prompt} tokens: pages / chunks", f"{cost['pages']} / {cost['chunks']}"
    )
    sizes.add_row(
        "request: staging bytes, all decode ranks", f"{cost['bytes']:,} B ({_mib(cost['bytes'])})"
    )
    sizes.add_row("request: transfer requests, staging path", f"{cost['staging_requests']:,}")
    sizes.add_row("request: transfer requests, slice path", f"{cost['slice_requests']:,}")
    ratio = cost["slice_requests"] / max(1, cost["staging_requests"])
    sizes.add_row("slice / staging requests", f"{ratio:,.0f}x")
    sizes.add_row("staged bytes that are duplicates", _duplicates_row(s))
    sizes.add_row("transfer path of this scenario", s.transfer.path)
    print_table(console, sizes)
    print_table(console, _cluster_table(s))


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:,.1f}"


def _cluster_table(s: Scenario) -> Table:
    """The cluster and the decode side: instances, GPUs, KV capacity, step time."""
    from kvstage.shared.serving.decode_model import DecodeModel
    from kvstage.shared.serving.memory import side_memory

    c, g, m = s.cluster, s.geometry(), DecodeModel(s)
    t = Table(title="cluster and decode side", show_header=False)
    t.add_column("what")
    t.add_column("value", justify="right")
    gpus = sum(scenario_gpus(s))
    t.add_row(
        "instances",
        f"{c.prefill_instances} prefill x TP{g.prefill_tp}"
        f"{f' PP{g.prefill_pp}' if g.prefill_pp > 1 else ''} + "
        f"{c.decode_instances} decode x TP{g.decode_tp} = {gpus} GPUs",
    )
    if not c.single:
        t.add_row(
            "router / nodes",
            f"{c.router}; {c.gpus_per_node} GPUs per node, "
            f"{c.nics_per_node or 'links.gpus_per_nic'} NICs per node; fold {c.fold}",
        )
    for side in ("prefill", "decode"):
        mem = side_memory(s, side)
        t.add_row(
            f"{side} GPU memory",
            f"{mem.gpu.name}: {_gib(mem.memory_bytes)} x {mem.utilization:g} = "
            f"{_gib(mem.usable_bytes)} GiB: weights {_gib(mem.weight_bytes)} "
            f"({s.model.weight_dtype}), activations {_gib(mem.activation_bytes)}, "
            f"KV {_gib(mem.kv_bytes)} GiB",
        )
    t.add_row("decode KV capacity per rank", f"{m.capacity_tokens:,} tokens ({s.model.kv_dtype})")
    prompt, out = s.workload.prompt_tokens, s.workload.output_tokens
    if out:
        step = m.step_time_s(prompt)
        t.add_row(
            f"decode step, one request of {prompt} tokens", f"{step * 1e3:,.2f} ms (TPOT alone)"
        )
    elif out is None and s.workload.trace:
        t.add_row("decode generation", "the trace rows' output lengths, where they give one")
    else:
        t.add_row("decode generation", "not modeled (workload.output_tokens = 0)")
    return t
