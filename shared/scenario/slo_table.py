"""[slo]: the service-level targets a run is judged by.

Each target bounds one per-request figure of summary.json (kvstage/metrics/rooms.py): a
request meets the SLO when it finished and every target given holds for it
(the clients' figures, docs/metrics.md: `ttft_s`: arrival -> first token at the client;
`tpot_s`: (E2E - TTFT) / (N - 1), 0 for one token, as `vllm bench serve --goodput`
counts; `e2e_s`: arrival -> last token). A failed request misses. Without targets
nothing is judged and summary.json has no SLO keys.
"""

from __future__ import annotations

from kvstage.shared.scenario.fieldtypes import PosFloat, _Table

__all__ = ["SLO_METRICS", "SloConfig"]

SLO_METRICS = ("ttft_s", "tpot_s", "e2e_s")


class SloConfig(_Table):
    """[slo]: targets in seconds, each optional (> 0)."""

    ttft_s: PosFloat | None = None
    tpot_s: PosFloat | None = None
    e2e_s: PosFloat | None = None

    def targets(self) -> dict[str, float]:
        """The targets given, by metric name (empty: no SLO)."""
        return {k: v for k in SLO_METRICS if (v := getattr(self, k)) is not None}
