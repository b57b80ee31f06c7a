"""The decode side's numbers: KV capacity and the time of one generation step.

KV capacity (per decode rank, in tokens): what shared/serving/memory.py leaves for
KV on one decode GPU (its memory x `decode.memory_utilization`, less this rank's part
of the weights and the activations), over the KV bytes one token takes on this rank.
Admission waits until a room's pages (transferred prompt plus its output tokens) fit.

A generation step of the continuous batch (at most `decode.max_running_requests`
requests) takes what shared/serving/compute.py `decode_step` says: the larger of the bytes
it reads (the weights it touches, all of a dense model's, the experts the batch picks
of a MoE model's, plus the batch's KV) over HBM x decode_hbm and its FLOPs over peak
x MFU, plus the per-step overhead, the TP all-reduces and any expert all-to-all.
Every request in the batch gets one token per step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstage.shared.serving.compute import decode_step
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
        self.step_overhead_s = eff.step_overhead_s
        self.page_size = g.page_size
        self.capacity_tokens: int = mem.kv_tokens
        self.max_batch: int = s.decode.max_running_requests
        # per batch size: (memory s, its slope per KV token, compute s, its slope, the rest);
        # both times are linear in the KV (bytes read, attention FLOPs), so two points
        # of decode_step give them exactly and a step costs two multiplies
        self._lines: dict[int, tuple[float, float, float, float, float]] = {}

    @property
    def capacity_pages(self) -> int:
        return self.capacity_tokens // self.page_size

    def step(self, batch_kv_tokens: float, batch: int = 1) -> DecodeStep:
        """The parts of one step (shared/serving/compute.py `DecodeStep`)."""
        return decode_step(self.scenario, batch, batch_kv_tokens)

    def step_time_s(self, batch_kv_tokens: float, batch: int = 1) -> float:
        """One step of `batch` requests holding `batch_kv_tokens` tokens of KV in all."""
        line = self._lines.get(batch)
        if line is None:
            a, b = decode_step(self.scenario, batch, 0), decode_step(self.scenario, batch, _KV)
            rest = a.overhead_s + a.allreduce_s + a.alltoall_s
            line = (a.memory_s, (b.memory_s - a.memory_s) / _KV, a.compute_s, 0.0, rest)
            line = (*line[:3], (b.compute_s - a.compute_s) / _KV, rest)
            self._lines[batch] = line
        m0, dm, c0, dc, rest = line
        return max(m0 + dm * batch_kv_tokens, c0 + dc * batch_kv_tokens) + rest


_KV = 1 << 20  # the second point of each line (any KV count would do)
