"""Does a benchmark client see what `kvstage serve` simulated? Request by request.

`served.jsonl` (kvstage/serve/timeline.py) holds, per request, kvstage's own figures
(simulated TTFT, TPOT, ITL, E2E) and how late each token's chunk left the server.
A client's per-request records hold what it measured. `pair` matches the two by
(prompt tokens, output tokens), which the workload makes unique, and checks that the
client counted the same tokens the server did; `differences` gives, per metric, the
client's figure minus kvstage's simulated one, and the part of it the server's own lag
explains (the client's figure minus the figure as sent): what is left is the client's
timing noise (its clock, its event loop, the loopback).

The client read here is AIPerf (`profile_export.jsonl`: one record a request, metrics
in ms under `time_to_first_token`, `inter_token_latency` (its TPOT),
`request_latency`, `inter_chunk_latency`; `input_sequence_length`,
`output_sequence_length`; records of the `warmup` phase are skipped).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ClientRecord", "differences", "pair", "read_aiperf", "read_served"]

METRICS = ("ttft_s", "tpot_s", "e2e_s", "itl_s")


@dataclass(frozen=True)
class ClientRecord:
    """One request as a client measured it (seconds)."""

    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    tpot_s: float | None
    e2e_s: float
    itl_s: tuple[float, ...]


def read_served(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _ms(metrics: dict, key: str, where: str):
    try:
        value = metrics[key]["value"]
    except (KeyError, TypeError):
        raise ValueError(f"{where}: no metrics.{key}.value") from None
    return [v / 1e3 for v in value] if isinstance(value, list) else value / 1e3


def read_aiperf(path: Path) -> list[ClientRecord]:
    """AIPerf's `profile_export.jsonl`: the profiling phase's requests (an errored one
    is an error: the server should not fail a request of a benchmark)."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        rec, where = json.loads(line), f"{path}:{n}"
        if (rec.get("metadata") or {}).get("benchmark_phase", "profiling") != "profiling":
            continue
        if rec.get("error"):
            raise ValueError(f"{where}: the request failed: {rec['error']}")
        m = rec.get("metrics") or {}
        osl = int(m.get("output_sequence_length", {}).get("value", 0))
        out.append(
            ClientRecord(
                prompt_tokens=int(m.get("input_sequence_length", {}).get("value", 0)),
                output_tokens=osl,
                ttft_s=_ms(m, "time_to_first_token", where),
                tpot_s=_ms(m, "inter_token_latency", where) if osl > 1 else None,
                e2e_s=_ms(m, "request_latency", where),
                itl_s=tuple(_ms(m, "inter_chunk_latency", where)) if osl > 1 else (),
            )
        )
    return out


def pair(client: list[ClientRecord], served: list[dict]) -> list[tuple[ClientRecord, dict]]:
    """Each client record with the served request of the same (prompt, output) tokens;
    a ValueError when the two disagree on what was asked or counted."""
    by_key: dict[tuple[int, int], dict] = {}
    for row in served:
        key = (row["prompt_tokens"], row["output_tokens"])
        if key in by_key:
            raise ValueError(f"two served requests of {key} (prompt, output) tokens: ambiguous")
        by_key[key] = row
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
    from kvstage.serve.timeline import client_figures

    sent = [t + late for t, late in zip(row["token_s"], row["sent_late_s"], strict=True)]
    return client_figures(row["arrival_s"], sent)


def differences(pairs: list[tuple[ClientRecord, dict]]) -> dict[str, dict[str, list[float]]]:
    """Per metric: `vs_sim`, the client's figure minus kvstage's simulated one, and
    `vs_sent`, minus the figure as sent (the client's own noise); one value a request
    (ITL: one a gap)."""
    out: dict[str, dict[str, list[float]]] = {m: {"vs_sim": [], "vs_sent": []} for m in METRICS}
    for rec, row in pairs:
        sent = _sent_figures(row)
        for m in METRICS:
            mine = getattr(rec, m)
            if mine is None or row[m] is None:
                continue
            if m == "itl_s":
                out[m]["vs_sim"] += [a - b for a, b in zip(mine, row[m], strict=True)]
                out[m]["vs_sent"] += [a - b for a, b in zip(mine, sent[m], strict=True)]
            else:
                out[m]["vs_sim"].append(mine - row[m])
                out[m]["vs_sent"].append(mine - sent[m])
    return out
