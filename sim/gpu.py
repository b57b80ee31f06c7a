"""GPU model: closed-form kernel durations and one in-order stream per rank.

Gather/scatter kernels are memory bound (they read and write every byte once), so
their duration is launch overhead plus 2*bytes over HBM bandwidth. A prefill
forward is compute bound; it comes from a measured tokens/s if the profile has one,
else from FLOPs over sustained TFLOPs.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import simpy


@dataclass(frozen=True)
class GpuParams:
    """mem_bandwidth_Bps: HBM bytes/s; launch_s: per-kernel launch overhead (s);
    tflops: sustained dense TFLOP/s (1e12 FLOP/s); tokens_per_s: measured prefill
    throughput, preferred over ``tflops`` when given."""

    mem_bandwidth_Bps: float
    launch_s: float
    tflops: float | None = None
    tokens_per_s: float | None = None

    def __post_init__(self) -> None:
        if not self.mem_bandwidth_Bps > 0:
            raise ValueError(f"mem_bandwidth_Bps must be > 0, got {self.mem_bandwidth_Bps}")
        if not self.launch_s >= 0:
            raise ValueError(f"launch_s must be >= 0, got {self.launch_s}")
        for name in ("tflops", "tokens_per_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 or None, got {value}")


def copy_time(params: GpuParams, nbytes: int, launches: int = 1) -> float:
    """Seconds for a gather/scatter of ``nbytes`` in ``launches`` kernels (read + write)."""
    return launches * params.launch_s + 2.0 * nbytes / params.mem_bandwidth_Bps


def forward_time(params: GpuParams, tokens: int, flops_per_token: float) -> float:
    """Seconds for a prefill forward over ``tokens`` tokens.

    ``flops_per_token`` is typically 2 * parameter count (per rank); it is only
    used when the profile has no measured ``tokens_per_s``.
    """
    if params.tokens_per_s is not None:
        return tokens / params.tokens_per_s
    if params.tflops is None:
        raise ValueError("GpuParams needs tokens_per_s or tflops to time a forward")
    return tokens * flops_per_token / (params.tflops * 1e12)


class Stream:
    """One in-order GPU stream: jobs run one at a time, in submission order."""

    def __init__(self, env: simpy.Environment, name: str = "") -> None:
        self.env = env
        self.name = name
        self._slot = simpy.Resource(env, capacity=1)  # FIFO queue = stream order
        self.busy_s = 0.0
        self.jobs_done = 0

    def run(self, duration: float) -> Generator[simpy.Event, Any, tuple[float, float]]:
        """Process body: wait for the stream, occupy it ``duration`` s; returns (start, end)."""
        with self._slot.request() as req:
            yield req
            start = self.env.now
            yield self.env.timeout(duration)
        self.busy_s += duration
        self.jobs_done += 1
        return start, self.env.now

    def submit(self, duration: float) -> simpy.Process:
        """``env.process(self.run(duration))``: enqueue now, its value is (start, end)."""
        return self.env.process(self.run(duration))

    @property
    def queued(self) -> int:
        """Jobs waiting behind the one running."""
        return len(self._slot.queue)


class SerialStream:
    """An in-order stream as a single 'busy until' clock: O(1) per job, no process.

    The driver's hot path uses this instead of `Stream`: jobs on one stream run
    back to back in submission order, so a job submitted at `now` starts at
    max(now, end of the previous job) and its end time is known at submission.
    """

    __slots__ = ("_free_at", "busy_s", "jobs")

    def __init__(self) -> None:
        self._free_at = 0.0
        self.busy_s = 0.0
        self.jobs = 0

    def free_at(self, now: float) -> float:
        """When a job submitted at `now` would start."""
        return self._free_at if self._free_at > now else now

    def reserve(self, now: float, duration: float) -> float:
        """Enqueue a job of `duration` seconds at `now`; returns its end time."""
        start = self._free_at if self._free_at > now else now
        self._free_at = start + duration
        self.busy_s += duration
        self.jobs += 1
        return self._free_at
