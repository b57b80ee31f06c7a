"""The decode side's numbers: KV capacity and the time of one generation step.

KV capacity (per decode rank, in tokens): what shared/scenario/physics.py leaves for
KV on one decode GPU (its memory x `decode.memory_utilization`, less this rank's part
of the weights and the activations), over the KV bytes one token takes on this rank.
Admission waits until a room's pages (transferred prompt plus its output tokens) fit.

A generation step of the continuous batch reads this rank's weights once and the KV of
every request in the batch once (decode is memory bound), so its time is
`(weights + batch KV bytes) / (HBM bandwidth x decode_hbm)` plus the per-step
overhead, the bandwidth from the decode GPU's datasheet (shared/scenario/gpus.py) and
the efficiencies from the scenario (`Scenario.efficiency`). Every request in the
batch gets one token per step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstage.shared.scenario.physics import GIB, side_memory

if TYPE_CHECKING:
    from kvstage.shared.scenario import Scenario

__all__ = ["GIB", "DecodeModel"]


class DecodeModel:
    """A decode instance's capacity and step time, from the scenario."""

    def __init__(self, scenario: Scenario) -> None:
        s, g = scenario, scenario.geometry()
        mem = side_memory(s, "decode")
        self.memory = mem
        self.kv_bytes_per_token = mem.kv_bytes_per_token  # on one decode rank
        self.weight_bytes = mem.weight_bytes
        eff = s.efficiency()
        self.hbm_Bps = s.gpu("decode").hbm_Bps * eff.decode_hbm
        self.step_overhead_s = eff.step_overhead_s
        self.page_size = g.page_size
        self.capacity_tokens: int = mem.kv_tokens

    @property
    def capacity_pages(self) -> int:
        return self.capacity_tokens // self.page_size

    def step_time_s(self, batch_kv_tokens: int) -> float:
        """One step of a batch holding `batch_kv_tokens` tokens of KV in all."""
        return (
            self.step_overhead_s
            + (self.weight_bytes + batch_kv_tokens * self.kv_bytes_per_token) / self.hbm_Bps
        )
