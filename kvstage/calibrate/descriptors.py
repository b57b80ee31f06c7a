"""Fit the descriptor probe's points (kvstage.hw.probes.descriptors): what one KV-slice
transfer descriptor costs a serving engine's host, in parts, and what the interpreter
lock does between a busy Python thread and a transfer worker. Pure numpy (tests feed
synthetic points).

- parts: per part (numpy build, Python list build, index arrays, get_xfer_descs,
  get_xfer_descs + initialize_xfer = prepare, transfer = post, make_prepped_xfer,
  its transfer), the median of each count's repetitions fitted as t(n) = per_call +
  n * per_descriptor, with R^2 (kvstage/calibrate/fit.py `fit_line`).
- GIL: worker slowdown = the worker's batches per second alone / beside a busy Python
  thread; Python slowdown = the Python thread's iterations per second alone / beside
  the worker. A fair share of the lock between two pure-Python threads gives 2 for
  both (sim/engine_host.py `Gil`); a worker that mostly releases the lock gives ~1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvstage.calibrate.fit import LineFit, fit_line, median_of

__all__ = ["DescriptorFit", "fit_descriptors"]

# probe key -> (name in the fit, what it is)
PARTS: dict[str, tuple[str, str]] = {
    "build_s": ("build_numpy", "numpy (n, 3) source and destination arrays"),
    "pylist_s": ("build_pylist", "Python address lists, one element per descriptor"),
    "index_s": ("index", "index arrays into lists prepared once"),
    "descs_s": ("xfer_descs", "get_xfer_descs of both arrays"),
    "prepare_s": ("prepare", "get_xfer_descs x2 + initialize_xfer"),
    "post_s": ("post", "transfer of an initialized handle, to its return"),
    "prep_s": ("make_prepped", "make_prepped_xfer from indices"),
    "prep_post_s": ("prepped_post", "transfer of a prepped handle, to its return"),
}


@dataclass(frozen=True)
class DescriptorFit:
    engine: str
    counts: tuple[int, ...]
    parts: dict[str, LineFit]
    gil: dict[str, float]

    @property
    def worker_slowdown(self) -> float:
        g = self.gil
        return g["worker_batches_per_s_alone"] / max(g["worker_batches_per_s_beside_python"], 1e-12)

    @property
    def python_slowdown(self) -> float:
        g = self.gil
        return g["python_iters_per_s_alone"] / max(g["python_iters_per_s_beside_worker"], 1e-12)

    def per_descriptor_ns(self, part: str) -> float:
        return self.parts[part].slope_s * 1e9

    def table(self) -> dict[str, Any]:
        """The sidecar's [fit.descriptors]: each part's fit with its R^2."""
        return {
            "engine": self.engine,
            "counts": list(self.counts),
            "model": "t(n) = per_call + n * per_descriptor (median of repetitions)",
            "parts": {
                name: {
                    "what": PARTS_BY_NAME[name],
                    "per_descriptor_ns": f.slope_s * 1e9,
                    "per_call_us": f.intercept_s * 1e6,
                    "r2": f.r2,
                    "residuals_rel": f.residuals,
                }
                for name, f in self.parts.items()
            },
            "gil": {
                **self.gil,
                "worker_slowdown": self.worker_slowdown,
                "python_slowdown": self.python_slowdown,
                "fair_share_predicts": 2.0,
            },
        }


PARTS_BY_NAME = {name: what for name, what in PARTS.values()}


def fit_descriptors(raw: dict[str, Any]) -> DescriptorFit:
    """Fit the probe's raw points (hw/probes/descriptors.py `measure_descriptors`)."""
    counts = [int(n) for n in raw["counts"]]
    parts = {}
    for key, (name, _) in PARTS.items():
        reps = raw["sweep"].get(key)
        if reps:
            parts[name] = fit_line(counts, median_of(reps), what=f"descriptors {name}")
    return DescriptorFit(raw.get("engine", "nixl"), tuple(counts), parts, dict(raw["gil"]))
