"""Fit the posting probe's points (kvstage.hw.probes.posting): what a transfer request
costs the rank that posts it, the engine's small-write message rate, and whether two
batches posted at once serialise. Pure numpy, so tests can feed synthetic points.

- posting: the median time to "posted" of a batch of n writes, fitted as
  t(n) = per_batch + n * per_request; `fresh` (descriptors built per batch) and, for
  NIXL, `prepped` (descriptor lists prepared once): prep per request = fresh slope -
  prepped slope.
- message rate: the time from "posted" to "done", fitted as a + n / rate. When the
  engine finishes the writes inside the posting call (NIXL over loopback: UCX copies
  with CMA while posting) there is nothing left to fit, and the rate is reported as
  not separable (the profile then gives 0: no separate limit).
- serialisation: for two ranks (two processes) and for two threads of one process,
  the median over repetitions of the later of the two batches' times, divided by the
  median time of one batch alone. About 1: the two overlap; about 2: they serialise.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvstage.calibrate.fit import LineFit, fit_line, fit_table, median_of

__all__ = ["Overlap", "PostingFit", "fit_posting", "overlap"]

# Overlap ratios below this say "overlap", above SERIAL_AT "serialise", else "partial".
OVERLAP_BELOW = 1.35
SERIAL_AT = 1.7


class Overlap(NamedTuple):
    """Two batches posted at once vs one alone (ratios of medians; see module doc)."""

    post_ratio: float
    done_ratio: float
    alone_post_s: float
    alone_done_s: float
    pair_post_s: float
    pair_done_s: float

    @property
    def verdict(self) -> str:
        r = self.done_ratio
        return "overlap" if r < OVERLAP_BELOW else "serialise" if r >= SERIAL_AT else "partial"


def overlap(
    alone: Sequence[Sequence[float]], pairs: Sequence[Sequence[Sequence[float]]]
) -> Overlap:
    """`alone`: (posted, done) per repetition of one batch; `pairs`: per repetition the
    two batches' (posted, done), both timed from the common start."""
    if not alone or not pairs:
        raise ValueError("overlap: need the batch alone and at least one pair")
    a_post = statistics.median(p for p, _ in alone)
    a_done = statistics.median(d for _, d in alone)
    p_post = statistics.median(max(x[0] for x in rep) for rep in pairs)
    p_done = statistics.median(max(x[1] for x in rep) for rep in pairs)
    return Overlap(
        p_post / a_post if a_post > 0 else float("nan"),
        p_done / a_done if a_done > 0 else float("nan"),
        a_post,
        a_done,
        p_post,
        p_done,
    )


@dataclass
class PostingFit:
    """The fitted posting costs of one engine (see module doc)."""

    backend: str
    op_bytes: int
    fresh: LineFit
    prepped: LineFit | None
    message: LineFit | None
    two_ranks: Overlap
    two_threads: Overlap
    cores: int
    after_fraction: float = 1.0  # largest batch: (done - posted) / posted

    @property
    def per_batch_s(self) -> float:
        return (self.prepped or self.fresh).intercept_s

    @property
    def per_request_s(self) -> float:
        """Posting per request with descriptors reused where the engine can (else fresh)."""
        return (self.prepped or self.fresh).slope_s

    @property
    def prep_per_request_s(self) -> float:
        """Descriptor preparation per request that reuse saves (0 without prepped lists)."""
        return max(0.0, self.fresh.slope_s - self.prepped.slope_s) if self.prepped else 0.0

    @property
    def message_rate(self) -> float:
        """Small writes per second after posting; 0 when not separable from posting (the
        largest batch finished within 5% of its posting time, or no line fits)."""
        m = self.message
        if m is None or m.slope_s <= 0 or m.r2 < 0.5 or self.after_fraction < 0.05:
            return 0.0
        return 1.0 / m.slope_s

    def table(self) -> dict[str, Any]:
        """The sidecar's [fit.posting]."""

        def line(f: LineFit | None) -> dict[str, Any] | None:
            return None if f is None else fit_table(f)

        return {
            "model": "posted(n) = per_batch + n * per_request; done(n) - posted(n) = a + n / message_rate",
            "op_bytes": self.op_bytes,
            "fresh": line(self.fresh),
            "prepped": line(self.prepped),
            "message": line(self.message),
            "per_batch_s": self.per_batch_s,
            "per_request_s": self.per_request_s,
            "prep_per_request_s": self.prep_per_request_s,
            "message_rate_per_s": self.message_rate,
            "two_ranks": {**self.two_ranks._asdict(), "verdict": self.two_ranks.verdict},
            "two_threads": {**self.two_threads._asdict(), "verdict": self.two_threads.verdict},
            "cores": self.cores,
        }

    def toml_lines(self) -> list[str]:
        """Comment lines for the profile: what was measured, with R^2 and the verdicts."""
        f, p, r, t = self.fresh, self.prepped, self.two_ranks, self.two_threads
        out = [
            f"# Posting ({self.backend}, engine called directly, batches of n x {self.op_bytes} B writes):",
            f"#   fresh descriptors: posted(n) = {f.intercept_s * 1e6:.1f} us + n * {f.slope_s * 1e6:.3f} us, "
            f"R^2 {f.r2:.4f}",
        ]
        if p is not None:
            out.append(
                f"#   prepped lists (make_prepped_xfer): {p.intercept_s * 1e6:.1f} us + n * "
                f"{p.slope_s * 1e6:.3f} us, R^2 {p.r2:.4f}"
            )
        m = self.message
        if self.message_rate:
            assert m is not None
            out.append(
                f"#   after posting: {m.intercept_s * 1e6:.1f} us + n / {self.message_rate / 1e6:.3f} M/s, "
                f"R^2 {m.r2:.4f}"
            )
        else:
            out.append(
                "#   the writes complete inside the posting call: no separate message rate (0)"
            )
        out.append(
            f"#   two ranks at once: {r.done_ratio:.2f}x one alone ({r.verdict}); two threads of one "
            f"process: {t.done_ratio:.2f}x ({t.verdict}); {self.cores} cores"
        )
        return out


def fit_posting(raw: dict[str, Any]) -> PostingFit:
    """Fit the raw points of `kvstage.hw.probes.posting.measure_posting`."""
    sw = raw["sweep"]
    counts = sw["counts"]
    fresh = fit_line(counts, median_of(sw["fresh"]["post_s"]))
    prepped = fit_line(counts, median_of(sw["prepped"]["post_s"])) if sw.get("prepped") else None
    mode = sw["prepped"] if sw.get("prepped") else sw["fresh"]
    after = [
        float(statistics.median(d - p for p, d in zip(ps, ds, strict=True)))
        for ps, ds in zip(mode["post_s"], mode["done_s"], strict=True)
    ]
    message = None
    if min(after) > 0:
        message = fit_line(counts, after, relative=False)
    big = counts.index(max(counts))
    posted_big = float(statistics.median(mode["post_s"][big]))
    return PostingFit(
        backend=raw.get("backend", "?"),
        op_bytes=int(sw["op_bytes"]),
        fresh=fresh,
        prepped=prepped,
        message=message,
        two_ranks=overlap(raw["two_ranks"]["alone"], raw["two_ranks"]["pairs"]),
        two_threads=overlap(raw["threads"]["alone"], raw["threads"]["pairs"]),
        cores=int(raw.get("cores", 0)),
        after_fraction=max(0.0, after[big]) / posted_big if posted_big > 0 else 1.0,
    )
