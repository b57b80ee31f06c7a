"""The fits of `kvstage calibrate`: weighted least-squares lines through measured times.

Pure numpy, so tests can feed them synthetic points. One line fit serves every
measurement (`fit_line`): the bulk writes and the fill (`fit_latency_bandwidth`), the
batches' per-request overhead (`fit_per_request`) and the posting probe's lines
(kvstage/calibrate/posting.py); the copy kernels' fit has a launch count per point
instead of an intercept (`fit_copy`). The same rules hold for all of them:

- relative weighting (default): each point weighs 1/t^2, so the fit minimises relative
  errors: over four decades of sizes the small points set the fixed cost and the large
  ones the rate, instead of the largest points' noise swamping the intercept;
- a negative fixed cost is noise: it is clamped to 0 and the slope refitted through the
  origin; a slope below 0 (time falling with size or count) is noise too: clamped to 0.
  A fit that needs a rate out of the slope (a bandwidth) refuses a slope of 0;
- r2 is the weighted R^2 (1 when the points are all alike and the line meets them, 0
  when it misses them); residuals are relative, (measured - fitted) / fitted, one per
  point in input order.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "CopyFit",
    "LineFit",
    "LinearFit",
    "PerRequestFit",
    "fit_copy",
    "fit_latency_bandwidth",
    "fit_line",
    "fit_per_request",
    "fit_table",
    "median_of",
]


class LineFit(NamedTuple):
    """t(n) = intercept_s + n * slope_s (both >= 0)."""

    intercept_s: float
    slope_s: float
    r2: float
    residuals: list[float]


class LinearFit(NamedTuple):
    """t = latency_s + bytes / bandwidth_Bps."""

    latency_s: float
    bandwidth_Bps: float
    r2: float
    residuals: list[float]


class PerRequestFit(NamedTuple):
    """t(n) = intercept_s + n * slope_s for a batch of n ops of op_bytes each;
    per_request_s = slope_s - op_bytes / bandwidth (clamped at 0)."""

    per_request_s: float
    intercept_s: float
    slope_s: float
    r2: float
    residuals: list[float]


class CopyFit(NamedTuple):
    """t = launches * launch_s + bytes / bandwidth_Bps (bytes copied once)."""

    launch_s: float
    bandwidth_Bps: float
    r2: float
    residuals: list[float]


def fit_table(f: LineFit | LinearFit | PerRequestFit | CopyFit) -> dict[str, Any]:
    """A fit as the calibration sidecar writes it: every field by its name, the
    residuals as `residuals_rel` (they are relative)."""
    out: dict[str, Any] = f._asdict()
    out["residuals_rel"] = out.pop("residuals")
    return out


def _as_points(x: Sequence[float], y: Sequence[float], what: str) -> tuple[np.ndarray, np.ndarray]:
    xa = np.asarray(x, dtype=np.float64).reshape(-1)
    ya = np.asarray(y, dtype=np.float64).reshape(-1)
    if xa.shape != ya.shape:
        raise ValueError(f"{what}: {xa.size} x values but {ya.size} times")
    if xa.size < 2:
        raise ValueError(f"{what}: need at least 2 points, got {xa.size}")
    if not (np.all(np.isfinite(xa)) and np.all(np.isfinite(ya))):
        raise ValueError(f"{what}: points must be finite")
    if np.any(ya <= 0):
        raise ValueError(f"{what}: times must be > 0")
    if np.any(xa < 0):
        raise ValueError(f"{what}: sizes/counts must be >= 0")
    return xa, ya


def _weights(y: np.ndarray, relative: bool) -> np.ndarray:
    return 1.0 / (y * y) if relative else np.ones_like(y)


def _two_terms(u: np.ndarray, x: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[float, float]:
    """argmin over (a, b) of sum w (y - a u - b x)^2 with a >= 0 (else refitted as b x
    alone) and b >= 0."""
    sw = np.sqrt(w)
    (a, b), *_ = np.linalg.lstsq(np.column_stack([u, x]) * sw[:, None], y * sw, rcond=None)
    if a < 0:
        a = 0.0
        b = float(np.sum(w * x * y) / np.sum(w * x * x)) if np.any(x > 0) else 0.0
    return float(a), max(0.0, float(b))


def _quality(y: np.ndarray, fitted: np.ndarray, w: np.ndarray) -> tuple[float, list[float]]:
    """(weighted R^2, relative residuals)."""
    ybar = float(np.sum(w * y) / np.sum(w))
    ss_tot = float(np.sum(w * (y - ybar) ** 2))
    ss_res = float(np.sum(w * (y - fitted) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)
    res = (y - fitted) / np.where(fitted > 0, fitted, y)
    return r2, [float(v) for v in res]


def fit_line(
    counts: Sequence[float],
    seconds: Sequence[float],
    *,
    relative: bool = True,
    what: str = "fit_line",
) -> LineFit:
    """Fit t = a + b n by (weighted) least squares, a, b >= 0 (see the module docstring);
    `what` names the fit in the message of a ValueError for bad points."""
    x, y = _as_points(counts, seconds, what)
    w = _weights(y, relative)
    a, b = _two_terms(np.ones_like(x), x, y, w)
    r2, res = _quality(y, a + b * x, w)
    return LineFit(a, b, r2, res)


def _rate(slope: float, what: str) -> float:
    """1 / slope: the rate of a fit that needs one (a bandwidth)."""
    if not slope > 0:
        raise ValueError(
            f"{what}: time does not grow with size (slope {slope:.3g}); cannot fit a bandwidth"
        )
    return 1.0 / slope


def fit_latency_bandwidth(
    sizes: Sequence[float], seconds: Sequence[float], *, relative: bool = True
) -> LinearFit:
    """Fit t = latency + bytes / bandwidth (`fit_line`). `sizes` in bytes, `seconds` the
    measured times (medians of reps); a fit whose time does not grow with size has no
    bandwidth (ValueError)."""
    f = fit_line(sizes, seconds, relative=relative, what="fit_latency_bandwidth")
    return LinearFit(f.intercept_s, _rate(f.slope_s, "fit_latency_bandwidth"), f.r2, f.residuals)


def fit_per_request(
    counts: Sequence[float],
    seconds: Sequence[float],
    *,
    op_bytes: float,
    bandwidth_Bps: float,
    relative: bool = True,
) -> PerRequestFit:
    """Fit t(n) = a + c * n over batches of n ops of `op_bytes` each.

    The fixed part `a` is the batch's latency; `c` is what one more op costs: its
    bytes (op_bytes / bandwidth_Bps, from `fit_latency_bandwidth`) plus the
    per-request overhead, per_request_s = c - op_bytes / bandwidth_Bps (>= 0).
    """
    if not (bandwidth_Bps > 0 and math.isfinite(bandwidth_Bps)):
        raise ValueError(
            f"fit_per_request: bandwidth_Bps must be finite and > 0, got {bandwidth_Bps}"
        )
    if op_bytes < 0:
        raise ValueError(f"fit_per_request: op_bytes must be >= 0, got {op_bytes}")
    f = fit_line(counts, seconds, relative=relative, what="fit_per_request")
    _rate(f.slope_s, "fit_per_request")
    per = max(0.0, f.slope_s - op_bytes / bandwidth_Bps)
    return PerRequestFit(per, f.intercept_s, f.slope_s, f.r2, f.residuals)


def fit_copy(
    nbytes: Sequence[float],
    seconds: Sequence[float],
    launches: Sequence[float] | None = None,
    *,
    relative: bool = True,
) -> CopyFit:
    """Fit t = launches * launch + bytes / bandwidth (kernels; one launch per point if
    `launches` is None). Several kernels (e.g. gather and a W-block scatter) can be
    fitted together, each point with its own launch count."""
    x, y = _as_points(nbytes, seconds, "fit_copy")
    n = np.ones_like(x) if launches is None else np.asarray(launches, dtype=np.float64).reshape(-1)
    if n.shape != x.shape or np.any(n < 1):
        raise ValueError("fit_copy: launches must be >= 1, one per point")
    w = _weights(y, relative)
    launch, inv_bw = _two_terms(n, x, y, w)
    bandwidth = _rate(inv_bw, "fit_copy")
    r2, res = _quality(y, launch * n + inv_bw * x, w)
    return CopyFit(launch, bandwidth, r2, res)


def median_of(reps: Sequence[Sequence[float]]) -> list[float]:
    """Median of each point's repetitions."""
    return [float(statistics.median(r)) for r in reps]
