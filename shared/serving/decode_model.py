"""The decode side's numbers: KV capacity and the time of one generation step.

KV capacity (per decode rank, in tokens): what shared/serving/memory.py leaves for
KV on one decode GPU (its memory x `decode.memory_utilization`, less this rank's part
of the weights and the activations), over the KV bytes one token takes on this rank.
Admission waits until a room's pages (transferred prompt plus its output tokens) fit.

A generation step of the continuous batch (at most `decode.max_running_requests`
requests) takes what shared/serving/compute.py `decode_step` says: its kernels one after
another, the weight matmuls the longer of their reads and FLOPs, the attention the
longer of the batch's KV reads and its FLOPs, plus the kernels' fixed costs, a
speculative step's draft, the per-step overhead, the TP all-reduces and any expert
all-to-all. Every request in the batch gets one token per step (accept_length with
`decode.speculative`, sim/decode_batch.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstage.shared.serving.compute import decode_step
from kvstage.shared.serving.engine_step import engine_step
from kvstage.shared.serving.gpus import efficiency, side_gpu
from kvstage.shared.serving.memory import GIB, side_memory

if TYPE_CHECKING:
    from kvstage.shared.scenario import Scenario
    from kvstage.shared.serving.compute import DecodeStep

__all__ = ["GIB", "DecodeModel"]


class DecodeModel:
    """A decode instance's capacity and step time, from the scenario."""

    def __init__(self, scenario: Scenario) -> None:
        s, g = scenario, scenario.geometry()
        self.scenario = s
        mem = side_memory(s, "decode")
        self.memory = mem
        self.kv_bytes_per_token = mem.kv_bytes_per_token  # on one decode rank
        self.weight_bytes = mem.weight_bytes  # held (a MoE step may read fewer)
        eff = efficiency(s)
        self.hbm_Bps = side_gpu(s, "decode").hbm_Bps * eff.decode_hbm
        self.step_overhead_s = engine_step(s).host_s
        self.page_size = g.page_size
        self.capacity_tokens: int = mem.kv_tokens
        self.max_batch: int = s.decode.max_running_requests
        # per batch size: (KV read s, its slope per KV token, attention s, its slope, the
        # rest); the attention's two times are linear in the KV (bytes read, FLOPs) and
        # nothing else grows with it, so two points of decode_step give them exactly and
        # a step costs two multiplies
        self._lines: dict[int, tuple[float, float, float, float, float]] = {}
        self._host: dict[int, DecodeStep] = {}

    @property
    def capacity_pages(self) -> int:
        return self.capacity_tokens // self.page_size

    def step(self, batch_kv_tokens: float, batch: int = 1) -> DecodeStep:
        """The parts of one step (shared/serving/compute.py `DecodeStep`)."""
        return decode_step(self.scenario, batch, batch_kv_tokens)

    def step_time_s(self, batch_kv_tokens: float, batch: int = 1) -> float:
        """One step of `batch` requests holding `batch_kv_tokens` tokens of KV in all."""
        if self.scenario.decode.two_batch_overlap:  # its overlap is not linear in the KV
            return decode_step(self.scenario, batch, batch_kv_tokens).total_s
        line = self._lines.get(batch)
        if line is None:
            a, b = decode_step(self.scenario, batch, 0), decode_step(self.scenario, batch, _KV)
            rest = a.gpu_s - max(a.kv_memory_s, a.attention_s)  # none of it grows with KV
            dm = (b.kv_memory_s - a.kv_memory_s) / _KV
            line = (a.kv_memory_s, dm, a.attention_s, (b.attention_s - a.attention_s) / _KV, rest)
            self._lines[batch] = line
            self._host[batch] = a
        m0, dm, c0, dc, rest = line
        gpu_s = max(m0 + dm * batch_kv_tokens, c0 + dc * batch_kv_tokens) + rest
        return self._host[batch].with_host(gpu_s)  # the engine's host work, under or after


_KV = 1 << 20  # the second point of each line (any KV count would do)
