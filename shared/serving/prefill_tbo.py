"""Two-batch overlap in prefill (`prefill.two_batch_overlap`): a forward run as two
micro-batches, one's expert-parallel all-to-all under the other's compute.

What the engines do, and what kvstage takes from it:

- **What it is.** [P] LMSYS, "Deploying DeepSeek with PD Disaggregation and Large-scale
  Expert Parallelism on 96 H100 GPUs" (https://lmsys.org/blog/2025-05-05-large-scale-ep/,
  "Two-batch Overlap"): the batch is split into two micro-batches so that one's
  computation overlaps the other's communication (DeepSeek's design,
  https://github.com/deepseek-ai/profile-data); it also halves the activations a
  kernel holds (16,384 tokens a device ran with it, 8,192 without before running out
  of memory). SGLang runs it with `--enable-two-batch-overlap`, and refuses it without
  an all-to-all backend ([C] sgl-project/sglang python/sglang/srt/server_args.py: "When
  enabling two batch overlap, moe_a2a_backend cannot be 'none'."), and in a prefill
  batch whose DeepEP mode resolves to low-latency ([C] two_batch_overlap.py
  `TboDPAttentionPreparer.prepare_all_gather`): prefill TBO runs DeepEP's normal
  kernels, which kvstage's prefill prices (compute.py `alltoall_parts`). LMSYS's
  prefill ran it so ([C] https://github.com/sgl-project/sglang/issues/6017, the
  prefill command: `--enable-deepep-moe --deepep-mode normal ...
  --enable-two-batch-overlap`).
- **How a batch splits** ([C] SGLang python/sglang/srt/batch_overlap/
  two_batch_overlap.py `compute_split_seq_index`, `_split_extend_seqs`): by whole
  sequences where the two halves' token counts are closest
  (`_split_array_by_balanced_sum`); when that leaves either half under
  `tbo_token_distribution_threshold` of the tokens (server_args default 0.48), a
  "two-chunk" split at half the tokens, the sequence there cut in two, its second
  part attending to the first part's KV (`derive_fields_related_to_seq_len_for_two_chunk`).
  So a one-prompt forward splits into its two halves of tokens. (LMSYS's May 2025
  build split whole sequences only, `_split_array_by_half_sum`, and ran a one-sequence
  batch without TBO; its 16,384-token forwards held 4 to 16 prompts.) A forward of one
  token cannot split: it runs as one batch (`split_halves` returns None).
- **What overlaps what** ([C] SGLang operations_strategy.py
  `_compute_moe_deepseek_blog_prefill`, `tbo_delta_stages = 0`): each MoE layer of each
  micro-batch in three stages, [attention, gate, launch dispatch] / [wait dispatch,
  routed experts, launch combine] / [shared experts, wait combine, output] (the last
  runs on into the next layer's attention), the two micro-batches' stages alternating
  A, B, A, B on one compute stream (operations.py `execute_overlapped_operations`),
  DeepEP's kernels on its one communication stream in launch order. A's dispatch runs
  under B's attention, B's dispatch under A's experts, A's combine under B's experts,
  B's combine under A's shared experts and next attention. kvstage replays that
  schedule layer by layer (`schedule_s`; compute.py `_two_batch_prefill` prices the stages): two queues, each op starting when its queue
  is free and what it waits for is done. [A] The shared experts and the rest of the
  dense matmuls are counted with the attention stage, after the combine's wait (the
  wait comes before the shared experts in SGLang: this hides a little less).
- **The split's own cost.** Each micro-batch's matmuls have half the rows (a lower
  MFU, `Efficiency.gemm_share`) and read the weights again (the roofline per matmul
  kind); each pays its own kernels (twice the fixed cost); and the matmuls run on the
  SMs DeepEP's normal kernels leave ([C] `_compute_moe_deepseek_blog_prefill`:
  `deep_gemm_num_sms = multi_processor_count - DeepEPConfig.num_sms`, none on ROCm;
  DeepEP's default `Buffer.num_sms = 20`, [C] deepseek-ai/DeepEP deep_ep/buffer.py,
  which SGLang keeps unless `--deepep-config` sets it), [A] a matmul's FLOP rate in
  proportion to its SMs, its weight reads not slowed.
- **Contention beside the communication.** While a DeepEP kernel runs on the
  communication stream, the compute stream's kernels share the GPU with it:
  - the matmuls (already on the SMs DeepEP leaves) run slower still, HBM, L2 and power
    shared: [P] DeepSeek's own trace, https://github.com/deepseek-ai/profile-data
    (commit 4496024) `train.json` (H800, EP64, DeepEP's internode kernels on 20 SMs,
    their FP8 GEMMs launched on the other 112 whether or not a DeepEP kernel runs): the
    same GEMM at the same place of the chunk's four layers (balanced routing, so the
    same shapes), alone on the GPU and under a DeepEP dispatch or combine, at ten
    places: 3,062 us alone, 3,234 us under (x1.056; the FP8 GEMMs x1.03-1.07 each, a
    small cuBLAS BF16 GEMM x1.16; the forward pass's three FP8 GEMMs alone x1.059).
    benchmarks/overlap_contention.py reads it.
    `GEMM_CONTENTION` holds it for the Hopper GPUs (H800 measured; H100 and H200 the
    same GH100, above); [A] none on A100 and MI300X, where it was not measured;
  - the attention runs on the SMs DeepEP's kernels leave: it is not DeepGEMM, so
    SGLang gives it no SM count, and a DeepEP block holds nearly all its SM's
    registers ([P] the same trace: internode dispatch 20 blocks of 512 threads at 113
    registers, combine 20 of 800 at 72: 57,856 and 57,600 of an SM's 65,536), so no attention
    block fits beside it: its rate x `sm_share` while overlapped, [A] no contention
    beyond that (none measured for it: the trace's attention always ran overlapped);
  - the rest (the kernels' fixed costs, the TP all-reduce) is not slowed.
  A stage slows only while the communication stream is busy (`schedule_s`: a stage
  starting at t beside communication queued until c runs at 1 / its slowdown until c,
  at full rate after), [A] its slowdown the blend of its parts' (a stage's kernels run
  in order, the slowdown spread over them evenly). The same trace's memory-bound
  kernels (casts, norms, transposes) ran x1.24 slower under DeepEP; kvstage prices none
  of them in a prefill forward beyond their launch cost (kernels.py), so nothing to
  slow here.
- **Limits.** The overlap cannot hide more communication than there is compute: one
  compute stream and one communication stream, so a forward is never shorter than all
  its compute, nor than all its communication (nor than the FLOPs and HBM bounds of
  the whole batch). With little to hide, the split's own cost makes it slower than
  one batch, as SGLang notes ("may smartly disable TBO when batch size is too small b/c
  it will slow down", two_batch_overlap.py) and LMSYS measured in decode (-27% at 32
  tokens a device).

Published effect ([P] the LMSYS post above, "Ablation Study: Two-batch Overlap"): in
prefill, "a 27% to 35% throughput increase compared to the vanilla setup, even when
processing the same token count per device", and 40.5% with the larger batch TBO's
memory saving allows; per kernel, TBO's kernels ran slower than without it ("reduced
streaming multiprocessors (SMs) with TBO, potential noisy neighbor effects"), and the
communication kernels slower than DeepEP's unit tests, which "is achievable when
disabling TBO". kvstage prices the SM reservation and the contention measured in
DeepSeek's trace (above), not the post's own figures (see
docs/results/2026-12-04-published-serving-prefill-tbo.md and
docs/results/2026-12-04-published-serving-tbo-contention.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "DEEPEP_NORMAL_SMS",
    "DEEPEP_RESERVED_SMS",
    "GEMM_CONTENTION",
    "TOKEN_DISTRIBUTION_THRESHOLD",
    "Piece",
    "attention_contention",
    "schedule_s",
    "sm_share",
    "split_chunks",
    "split_halves",
]

DEEPEP_NORMAL_SMS = 20  # [C] DeepEP deep_ep/buffer.py `Buffer.num_sms`
TOKEN_DISTRIBUTION_THRESHOLD = 0.48  # [C] SGLang server_args `tbo_token_distribution_threshold`
# (SMs of the GPU, SMs DeepEP's normal kernels hold while the matmuls run): [D] H100 SXM5
# 132 SMs (https://developer.nvidia.com/blog/nvidia-hopper-architecture-in-depth/), the
# H200 the same GH100 configuration (https://www.nvidia.com/en-us/data-center/h200/:
# "the same Hopper architecture"), [P] H800 132 (DeepSeek-V3 technical report, section
# 3.2.2, https://arxiv.org/abs/2412.19437: 20 "out of 132 SMs" for communication),
# [D] A100 108 (NVIDIA A100 Tensor Core GPU Architecture whitepaper); [D] MI300X 304
# compute units (AMD's datasheet, gpus.py's page), of which SGLang reserves none on
# ROCm ([C] `deep_gemm_num_sms = None` under `_is_hip`). Other GPUs: refused
# (shared/scenario/schema.py `_check_tbo`), their SM count not sourced here.
DEEPEP_RESERVED_SMS: dict[str, tuple[int, int]] = {
    "h100-sxm": (132, DEEPEP_NORMAL_SMS),
    "h200": (132, DEEPEP_NORMAL_SMS),
    "h800": (132, DEEPEP_NORMAL_SMS),
    "a100-80g": (108, DEEPEP_NORMAL_SMS),
    "mi300x": (304, 0),
}
# A matmul's time under a DeepEP normal kernel over its time alone, both on the SMs
# DeepEP leaves: [P] deepseek-ai/profile-data train.json, 3,234 / 3,062 us, DeepSeek's
# GEMMs at ten places on H800 (see above; benchmarks/overlap_contention.py); H100 and
# H200 the same GH100 die. Other GPUs: not measured, none priced.
GEMM_CONTENTION: dict[str, float] = {"h100-sxm": 1.056, "h200": 1.056, "h800": 1.056}


@dataclass(frozen=True, slots=True)
class Piece:
    """`count` chunks of `tokens` tokens, each after `context` tokens of its prompt's KV;
    `ends`: of them, those that end their prompt (the LM head's rows)."""

    count: int
    tokens: int
    context: int
    ends: int

    @property
    def total(self) -> int:
        return self.count * self.tokens

    @property
    def keys(self) -> float:
        """Keys its queries attend to: token i of a chunk to context + i + 1."""
        return self.count * self.tokens * (self.context + (self.tokens + 1) / 2)


def split_halves(
    tokens: int, context: int, prompts: int
) -> tuple[tuple[Piece, ...], tuple[Piece, ...]] | None:
    """SGLang's split of a forward of `prompts` chunks of `tokens` tokens after `context`
    (see above): whole prompts where the halves balance within the threshold, else
    two chunks at half the tokens; None when it has fewer than two tokens."""
    total = tokens * prompts
    if total < 2:
        return None
    # the balanced split of equal lengths: half the prompts, the larger half first
    best = (prompts + 1) // 2 if prompts > 1 else 0
    share = best * tokens / total
    if TOKEN_DISTRIBUTION_THRESHOLD <= share <= 1 - TOKEN_DISTRIBUTION_THRESHOLD:
        return (Piece(best, tokens, context, best),), (
            Piece(prompts - best, tokens, context, prompts - best),
        )
    half = total // 2
    whole, cut = divmod(half, tokens)  # A: `whole` prompts and `cut` tokens of the next
    rest = prompts - whole - (1 if cut else 0)
    a = [Piece(whole, tokens, context, whole)]
    b = [Piece(rest, tokens, context, rest)]
    if cut:  # the cut prompt: its first part in A, the rest (and its end) in B
        a.append(Piece(1, cut, context, 0))
        b.insert(0, Piece(1, tokens - cut, context + cut, 1))
    return tuple(p for p in a if p.count), tuple(p for p in b if p.count)


def split_chunks(
    chunks: Sequence[tuple[int, int]],
) -> tuple[tuple[Piece, ...], tuple[Piece, ...]] | None:
    """The split of a packed forward of unequal chunks (computed tokens, context before
    them), each a sequence's end: equal chunks as `split_halves`; else by whole chunks
    where the halves' tokens are closest (ties: the larger half first, as
    `split_halves`), within the threshold, else at half the tokens, the chunk there cut
    in two, its second part attending to the first; None when it has fewer than two
    tokens. [A] the same rule as SGLang's `compute_split_seq_index` on unequal lengths
    (see above), read from its description, not checked against it case by case."""
    if len({(t, c) for t, c in chunks}) == 1:
        return split_halves(chunks[0][0], chunks[0][1], len(chunks))
    total = sum(t for t, _ in chunks)
    if total < 2:
        return None
    best, left, gap, at = 0, 0, total, 0
    for i, (t, _) in enumerate(chunks[:-1], start=1):
        left += t
        if abs(2 * left - total) <= gap:
            best, gap, at = i, abs(2 * left - total), left
    pieces = [Piece(1, t, c, 1) for t, c in chunks]
    if best and TOKEN_DISTRIBUTION_THRESHOLD <= at / total <= 1 - TOKEN_DISTRIBUTION_THRESHOLD:
        return tuple(pieces[:best]), tuple(pieces[best:])
    half, a, b, seen = total // 2, [], [], 0
    for p in pieces:
        if seen + p.tokens <= half:
            a.append(p)
        elif seen >= half:
            b.append(p)
        else:  # the cut chunk: its first part in A, the rest (and its end) in B
            cut = half - seen
            a.append(Piece(1, cut, p.context, 0))
            b.append(Piece(1, p.tokens - cut, p.context + cut, 1))
        seen += p.tokens
    return tuple(a), tuple(b)


def sm_share(gpu: str) -> float:
    """The share of `gpu`'s SMs the matmuls of a TBO forward run on (see above)."""
    sms, reserved = DEEPEP_RESERVED_SMS[gpu]
    return (sms - reserved) / sms


def attention_contention(gpu: str) -> float:
    """How much longer `gpu`'s attention takes beside a DeepEP kernel: on the SMs it
    leaves (see above)."""
    return 1.0 / sm_share(gpu)


def _beside(start: float, busy: float, work: float, slow: float) -> float:
    """When a stage of `work` seconds alone, starting at `start`, ends: `slow` times
    slower while the communication stream is busy (until `busy`), at full rate after."""
    window = max(0.0, busy - start)
    if work * slow <= window:
        return start + work * slow
    return start + window + work - window / slow


def schedule_s(
    attn: Sequence[float],
    moe: Sequence[float],
    dispatch: Sequence[float],
    combine: Sequence[float],
    layers: int,
    attn_slow: Sequence[float] = (1.0, 1.0),
    moe_slow: Sequence[float] = (1.0, 1.0),
) -> float:
    """The forward's time as SGLang's prefill schedule runs the two micro-batches (see
    above), every layer alike: per layer and micro-batch i an attention stage
    (`attn[i]` seconds a layer alone) and an expert stage (`moe[i]`) on the compute
    stream, its dispatch after the first and its combine after the second on the
    communication stream; each stage waits for its own communication, and runs
    `attn_slow[i]` (`moe_slow[i]`) times slower while communication runs beside it.
    Every communication kernel a stage can meet was queued before it starts (its own
    comes after it), back to back: the stream is busy from the stage's start until
    `comm`."""
    compute = comm = 0.0  # when each stream is next free
    combined = [0.0, 0.0]  # when each micro-batch's last combine lands
    for _ in range(layers):
        dispatched = [0.0, 0.0]
        for i in (0, 1):
            compute = _beside(max(compute, combined[i]), comm, attn[i], attn_slow[i])
            comm = max(comm, compute) + dispatch[i]
            dispatched[i] = comm
        for i in (0, 1):
            compute = _beside(max(compute, dispatched[i]), comm, moe[i], moe_slow[i])
            comm = max(comm, compute) + combine[i]
            combined[i] = comm
    return max(compute, *combined)
