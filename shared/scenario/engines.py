"""Serving-engine presets (`[engine] preset = NAME`): how a serving engine's prefill host
spends CPU on each KV transfer, and on which thread (the simulator's model is
sim/engine_host.py).

Without `[engine]` the simulator posts on the transfer engine's own posting threads
(the profile's per_request_us / per_batch_us / post_threads, sim/links.py). With a preset
the engine's host does the descriptor work instead, where the engine's code does it;
the link's posting costs are then not charged a second time (the NIC message rate and
bandwidth still are).

The descriptor work of one transfer call of n descriptors is

    build    n * build_ns      (numpy or Python: the address arrays / lists)
    prepare  n * prepare_ns    (NIXL get_xfer_descs + initialize_xfer; 0 where the
                                lists were prepared once, prep_xfer_dlist)
    post     n * post_ns + post_call_us   (transfer / make_prepped_xfer / batch_transfer)

Each request also pays `request_us` between its arrival and its room opening (the
serving stack outside the forward: HTTP, tokenization, streaming; a delay, not a queue)
and each scheduler iteration `launch_us` of Python.

The descriptor work is charged on the scheduler thread (`post_on = "scheduler"`) or on
a transfer worker (`"worker"`), holding the rank process's interpreter lock for the
parts flagged `*_gil`. Descriptors follow `granularity`: "layout" (kvstage's slice-path request
count: one per token, or per page where a head slice is a whole token row,
shared/layout.py `slice_requests`), or "block" (one per (page, layer, K/V): a
head-major block layout makes a block's head slice contiguous).

Sources (every number): [C] code read, [P] a published measurement, [M] kvstage's
descriptor probe (hw/probes/descriptors.py, `kvstage calibrate --descriptors`; the
figures below are from this repository's 2-core VM, host memory, NIXL / UCX),
[A] an assumption.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["ENGINE_PRESETS", "EnginePreset", "engine_names"]

# [M] scenarios/profiles/measured/descriptors-nixl-vm.json (`kvstage calibrate
# --descriptors` on this repository's 2-core VM, 2026-12-02, load ~5: noisy; host
# memory, NIXL/UCX loopback): t(n) = per_call + n * per_descriptor over n = 256..65,536,
# per descriptor:
#   numpy build of (n, 3) address arrays    20.2 ns  (R^2 0.98)
#   Python address lists (Mooncake)          219 ns  (R^2 0.57: 0.2 us at n = 4,096,
#                                                     2.7 us at 65,536, superlinear)
#   index arrays into prepared lists         3.6 ns  (R^2 0.76)
#   get_xfer_descs x2 + initialize_xfer     55.7 ns  (R^2 0.67)
#   make_prepped_xfer                       31.8 ns  (R^2 0.84)
#   transfer (loopback: UCX copies too)      674 ns  (R^2 0.87; an upper bound of a post)
_BUILD_NUMPY_NS = 20.2
_BUILD_PYLIST_NS = 219.0
_PREPARE_NS = 55.7
_PREPPED_NS = 31.8
_INDEX_NS = 3.6
# [P] posting one RDMA work request through UCX/verbs: the message rate bounds the NIC
# side separately (sim/links.py). The CPU side: a verbs post is ~0.1 us per request
# (scenarios/profiles/rdma-400g.toml, inter_per_request_us and its sources).
_POST_NS = 100.0
_POST_CALL_US = 11.0  # [M] make_prepped_xfer + transfer of one batch (rdma-400g.toml)
# [P] SGLang's CPU time per scheduler iteration (schedule a batch, build its ForwardBatch,
# launch, process its result, stream): tenstorrent/tt-inference-server issue #3560
# (https://github.com/tenstorrent/tt-inference-server/issues/3560, 2026-05-18): SGLang
# with a CPU mock forward that busy-waits 1 / 380 s = 2.632 ms, `vllm bench serve
# --random-input-len 128 --max-concurrency 1`: median TPOT 2.94 ms, so 0.31 ms per
# iteration outside the forward (one request in the batch).
_LAUNCH_US = 310.0
# [P] the same measurement: median TTFT 9.54 ms with one 2.632 ms forward and one such
# iteration, so 9.54 - 2.632 - 0.31 = 6.6 ms per request outside the forward and the
# scheduler loop: HTTP, chat template and tokenization (128 tokens), the scheduler's
# receive, detokenization, the first SSE chunk. Colocated (not disaggregated), one host.
_REQUEST_US = 6600.0
# [A] check_xfer_state of the handles of one room, per loop turn (NixlKVSender.poll [C])
_POLL_US = 2.0
_ENQUEUE_US = 20.0  # [A] a queue put and a handle (Python) per transfer call


@dataclass(frozen=True)
class EnginePreset:
    name: str
    summary: str
    post_on: Literal["scheduler", "worker"]
    queues: int  # transfer queues (one worker thread each) per rank; 0: none
    pool: int  # pool threads per queue that run the calls (Mooncake's executors)
    granularity: Literal["layout", "block"]
    build_ns: float
    build_gil: bool
    prepare_ns: float
    post_ns: float
    post_call_us: float
    post_gil: bool
    enqueue_us: float  # on the scheduler, per call handed to a worker
    launch_us: float  # on the scheduler, per forward launch (Python: holds the GIL)
    poll_us: float  # on the scheduler, per room in flight and loop turn
    overlap: bool  # launch batch k+1 before processing batch k's results
    # per request, outside the forward, the transfer and the scheduler loop (HTTP,
    # tokenization, detokenization, streaming): a delay between the request's arrival
    # and its room opening, not a queue (the tokenizer manager is asyncio); 0: not charged
    request_us: float
    # the prefill batch's token budget; None: the scenario's prefill.chunked_prefill_size
    # ([C] SGLang's PrefillAdder fills a batch up to the chunk budget); 0: one room per forward
    batch_tokens: int | None
    source: str

    def build_s(self, n: int) -> float:
        return n * self.build_ns * 1e-9

    def prepare_s(self, n: int) -> float:
        return n * self.prepare_ns * 1e-9

    def post_s(self, n: int) -> float:
        return n * self.post_ns * 1e-9 + (self.post_call_us * 1e-6 if n else 0.0)

    def split(self, n: int) -> tuple[float, float]:
        """(seconds holding the GIL, seconds without it) of one call of n descriptors."""
        gil = free = 0.0
        for part, holds in (
            (self.build_s(n), self.build_gil),
            (self.prepare_s(n), True),  # [A] nixl's pybind calls hold the GIL
            (self.post_s(n), self.post_gil),
        ):
            if holds:
                gil += part
            else:
                free += part
        return gil, free


_SGLANG_LOOP = (
    "[C] sgl-project/sglang python/sglang/srt/disaggregation/prefill.py: the prefill "
    "scheduler runs the batch, then process_batch_result_disagg_prefill -> send_kv_chunk "
    "-> NixlKVSender.send, then process_disagg_prefill_inflight_queue (poll); early "
    "server_args.py set disable_overlap_schedule for the prefill server"
)

ENGINE_PRESETS: dict[str, EnginePreset] = {
    p.name: p
    for p in (
        EnginePreset(
            name="sglang-nixl",
            summary="slice descriptors built with numpy, posted on the scheduler thread",
            post_on="scheduler",
            queues=0,
            pool=0,
            granularity="layout",
            build_ns=_BUILD_NUMPY_NS,
            build_gil=True,
            prepare_ns=_PREPARE_NS,
            post_ns=_POST_NS,
            post_call_us=_POST_CALL_US,
            post_gil=True,
            enqueue_us=0.0,
            launch_us=_LAUNCH_US,
            poll_us=_POLL_US,
            overlap=False,
            request_us=_REQUEST_US,
            batch_tokens=None,
            source=(
                "[C] sglang nixl/conn.py: NixlKVManager.send_kvcache_slice builds one "
                "(address, length, device) per (layer, K/V, token), get_xfer_descs + "
                "initialize_xfer + transfer, synchronously in NixlKVSender.send on the "
                "scheduler thread (SGLang PR #22536's baseline); " + _SGLANG_LOOP
            ),
        ),
        EnginePreset(
            name="sglang-nixl-prepped",
            summary="lists prepared once; make_prepped_xfer on a transfer worker",
            post_on="worker",
            queues=4,
            pool=1,
            granularity="layout",
            build_ns=_INDEX_NS,
            build_gil=True,
            prepare_ns=_PREPPED_NS,
            post_ns=_POST_NS,
            post_call_us=_POST_CALL_US,
            post_gil=False,
            enqueue_us=_ENQUEUE_US,
            launch_us=_LAUNCH_US,
            poll_us=_POLL_US,
            overlap=False,
            request_us=_REQUEST_US,
            batch_tokens=None,
            source=(
                "[C] sglang nixl/conn.py after PR #26406: prep_xfer_dlist once per peer, "
                "transfer_queues (SGLANG_DISAGGREGATION_QUEUE_SIZE, default 4) with one "
                "worker each running make_prepped_xfer + transfer; the scheduler only "
                "puts a TransferKVChunk; " + _SGLANG_LOOP
            ),
        ),
        EnginePreset(
            name="sglang-mooncake",
            summary="4 queues x up to 3 pool workers; Python list building holds the GIL",
            post_on="worker",
            queues=4,
            pool=3,
            granularity="layout",
            build_ns=_BUILD_PYLIST_NS,
            build_gil=True,
            prepare_ns=0.0,
            post_ns=_POST_NS,
            post_call_us=_POST_CALL_US,
            post_gil=False,
            enqueue_us=_ENQUEUE_US,
            launch_us=_LAUNCH_US,
            poll_us=0.0,
            overlap=False,
            request_us=_REQUEST_US,
            batch_tokens=None,
            source=(
                "[C] sglang mooncake/conn.py: transfer_queues = QUEUE_SIZE (4) FastQueues, "
                "each a transfer_worker thread and a ThreadPoolExecutor of "
                "THREAD_POOL_SIZE // QUEUE_SIZE (pool min(max(4, 0.75 cpus // 8), 12): up "
                "to 3) workers; a room's queue is its destination sessions' port sum mod 4; "
                "send_kvcache_slice builds Python address lists (GIL), "
                "batch_transfer_sync releases it"
            ),
        ),
        EnginePreset(
            name="vllm-nixl",
            summary="block-granular descriptors prepared once, posted on a worker",
            post_on="worker",
            queues=1,
            pool=1,
            granularity="block",
            build_ns=_INDEX_NS,
            build_gil=True,
            prepare_ns=_PREPPED_NS,
            post_ns=_POST_NS,
            post_call_us=_POST_CALL_US,
            post_gil=False,
            enqueue_us=_ENQUEUE_US,
            launch_us=_LAUNCH_US,
            poll_us=0.0,
            overlap=False,
            request_us=0.0,
            batch_tokens=None,
            source=(
                "[C] vllm-project/vllm .../kv_connector/v1/nixl_connector.py: "
                "register_kv_caches prepares per-block descriptor lists (split by heads for "
                "a TP ratio, HND layout), _read_blocks issues make_prepped_xfer + transfer "
                "from block ids, off the engine-core scheduler process; vLLM reads from the "
                "decode side, modeled here as the same work on the prefill rank's worker; no "
                "per-request figure for vLLM's HTTP and tokenizer path measured the way "
                "_REQUEST_US is was found, so request_us is 0 (not charged)"
            ),
        ),
    )
}


def engine_names() -> list[str]:
    return list(ENGINE_PRESETS)
