"""GPU model: closed-form kernel durations and one in-order stream per rank.

Gather/scatter kernels are memory bound (they read and write every byte once), so
their duration is launch overhead plus 2*bytes over HBM bandwidth. (The prefill
forward's duration is the scenario's: `prefill_forward_s` in shared/serving/compute.py, see sim/forward.py.)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuParams:
    """mem_bandwidth_Bps: HBM bytes/s; launch_s: per-kernel launch overhead (s)."""

    mem_bandwidth_Bps: float
    launch_s: float

    def __post_init__(self) -> None:
        if not self.mem_bandwidth_Bps > 0:
            raise ValueError(f"mem_bandwidth_Bps must be > 0, got {self.mem_bandwidth_Bps}")
        if not self.launch_s >= 0:
            raise ValueError(f"launch_s must be >= 0, got {self.launch_s}")


def copy_time(params: GpuParams, nbytes: int, launches: int = 1) -> float:
    """Seconds for a gather/scatter of ``nbytes`` in ``launches`` kernels (read + write)."""
    return launches * params.launch_s + 2.0 * nbytes / params.mem_bandwidth_Bps


class SerialStream:
    """An in-order stream as a single 'busy until' clock: O(1) per job, no process.

    Jobs on one stream run back to back in submission order, so a job submitted at `now` starts at
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

    def retime_last(self, end: float, took: float, start: float, duration: float) -> float:
        """The last job, which ends at `end` after `took` seconds of busy time, now runs
        from `start` for `duration` (a prefill forward another chunk joined before it
        started); its new end. Only the last job may change: nothing was reserved after
        it."""
        if self._free_at != end:
            raise ValueError(f"only the last job may change: it ends at {self._free_at}")
        self._free_at = start + duration
        self.busy_s += duration - took
        return self._free_at
