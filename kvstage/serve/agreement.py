"""Does a benchmark client see what `kvstage serve` simulated? Request by request.

`served.jsonl` (kvstage/serve/timeline.py) holds, per request, kvstage's own figures
(simulated TTFT, TPOT, ITL, E2E) and how late each token's chunk left the server.
A client's per-request records hold what it measured. `pair` matches the two by
(prompt tokens, output tokens), which the workload makes unique, and checks that the
client counted the same tokens the server did; `differences` gives, per metric, the
client's figure minus kvstage's simulated one, and the part of it the server's own lag
explains (the client's figure minus the figure as sent): what is left is the client's
timing noise (its clock, its event loop, the loopback).

The client's records come from kvstage's reader of its files (kvstage/measured/:
AIPerf's `profile_export.jsonl` is `kvstage.measured.aiperf.read_records`).
"""

from __future__ import annotations

import json
from pathlib import Path

from kvstage.measured.measurement import MeasuredRequest
from kvstage.serve.timeline import client_figures

__all__ = ["client_view", "differences", "pair", "read_served"]

METRICS = ("ttft_s", "tpot_s", "e2e_s", "itl_s")


def read_served(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def client_view(req: MeasuredRequest) -> dict[str, object]:
    """A measured request's figures under served.jsonl's names (TPOT as the clients
    define it, from its E2E, TTFT and output tokens)."""
    n, ttft, e2e = req.output_tokens, req.ttft_s, req.e2e_s
    tpot = (e2e - ttft) / (n - 1) if n > 1 and ttft is not None and e2e is not None else None
    return {"ttft_s": ttft, "tpot_s": tpot, "e2e_s": e2e, "itl_s": list(req.itls_s or [])}


def pair(client: list[MeasuredRequest], served: list[dict]) -> list[tuple[MeasuredRequest, dict]]:
    """Each client record with the served request of the same (prompt, output) tokens;
    a ValueError when the two disagree on what was asked or counted."""
    by_key: dict[tuple[int, int], dict] = {}
    for row in served:
        key = (row["prompt_tokens"], row["output_tokens"])
        if key in by_key:
            raise ValueError(f"two served requests of {key} (prompt, output) tokens: ambiguous")
        by_key[key] = row
    failed = [r.error for r in client if r.error]
    if failed:
        raise ValueError(f"{len(failed)} client request(s) failed, the first: {failed[0]}")
    if len(client) != len(served):
        raise ValueError(f"the client recorded {len(client)} requests, the server {len(served)}")
    out = []
    for rec in client:
        row = by_key.get((rec.prompt_tokens, rec.output_tokens))
        if row is None:
            raise ValueError(
                f"the client's request of {rec.prompt_tokens} prompt and {rec.output_tokens} "
                "output tokens was not served with those counts"
            )
        out.append((rec, row))
    return out


def _sent_figures(row: dict) -> dict[str, object]:
    """kvstage's figures of the request as its chunks actually left the server."""
    sent = [t + late for t, late in zip(row["token_s"], row["sent_late_s"], strict=True)]
    return client_figures(row["arrival_s"], sent)


def differences(pairs: list[tuple[MeasuredRequest, dict]]) -> dict[str, dict[str, list[float]]]:
    """Per metric: `vs_sim`, the client's figure minus kvstage's simulated one, and
    `vs_sent`, minus the figure as sent (the client's own noise); one value a request
    (ITL: one a gap)."""
    out: dict[str, dict[str, list[float]]] = {m: {"vs_sim": [], "vs_sent": []} for m in METRICS}
    for rec, row in pairs:
        sent, theirs = _sent_figures(row), client_view(rec)
        for m in METRICS:
            mine = theirs[m]
            if mine is None or row[m] is None:
                continue
            if m == "itl_s":
                out[m]["vs_sim"] += [a - b for a, b in zip(mine, row[m], strict=True)]
                out[m]["vs_sent"] += [a - b for a, b in zip(mine, sent[m], strict=True)]
            else:
                out[m]["vs_sim"].append(mine - row[m])
                out[m]["vs_sent"].append(mine - sent[m])
    return out
