"""The decode side's numbers: KV capacity and the time of one generation step.

KV capacity (per decode rank, in tokens): the share `decode.memory_utilization` of
`decode.gpu_memory_gib`, less this rank's part of the weights (all parameters, every
expert of a MoE model, divided over the decode TP), over the KV bytes one token takes
on this rank. Admission waits until a room's pages (transferred prompt plus its output
tokens) fit.

A generation step of the continuous batch reads this rank's weights once and the KV of
every request in the batch once (decode is memory bound), so its time is
`(weights + batch KV bytes) / HBM bandwidth` plus one kernel launch per layer, the
bandwidth and launch cost from the links profile's GPU numbers. Every request in the
batch gets one token per step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstage.shared.scenario import Scenario

__all__ = ["DecodeModel"]

GIB = 1 << 30


class DecodeModel:
    """A decode instance's capacity and step time, from the scenario."""

    def __init__(self, scenario: Scenario) -> None:
        s, g = scenario, scenario.geometry()
        self.kv_bytes_per_token = g.block_bytes(1, g.decode_heads)  # on one decode rank
        self.weight_bytes = s.model.params_b * 1e9 * s.model.dtype_bytes / s.decode.tp
        links = s.links.resolved()
        self.hbm_Bps = links.mem_bandwidth_bytes_s
        self.step_overhead_s = links.kernel_launch_s * g.layers
        self.page_size = g.page_size
        self.capacity_tokens: int | None = None
        if s.decode.gpu_memory_gib is not None:
            usable = s.decode.gpu_memory_gib * GIB * s.decode.memory_utilization - self.weight_bytes
            if usable < self.kv_bytes_per_token * g.grid_pages * g.page_size:
                raise ValueError(
                    f"at decode.memory_utilization {s.decode.memory_utilization} it holds {usable / GIB:.1f} GiB after this rank's "
                    f"{self.weight_bytes / GIB:.1f} GiB of weights, less than one chunk of KV: "
                    f"raise gpu_memory_gib or decode.tp"
                )
            self.capacity_tokens = int(usable // self.kv_bytes_per_token)

    @property
    def capacity_pages(self) -> int | None:
        return None if self.capacity_tokens is None else self.capacity_tokens // self.page_size

    def step_time_s(self, batch_kv_tokens: int) -> float:
        """One step of a batch holding `batch_kv_tokens` tokens of KV in all."""
        return (
            self.step_overhead_s
            + (self.weight_bytes + batch_kv_tokens * self.kv_bytes_per_token) / self.hbm_Bps
        )
