"""The request list of a scenario: a pure, seeded function of the scenario.

Both modes call `generate_requests(scenario)` and so replay the very same requests
(docs/design.md, "Layout"): same rooms, arrival times, prompt lengths and prefixes. It
uses its own `random.Random` instances (never the global generator) and only the
stdlib. The only input besides the scenario is `workload.trace` when the scenario
names one: a CSV (a name ending in .csv) with the header
arrival_s,prompt_tokens[,prefix_tokens][,output_tokens] and one row per request, or a
Mooncake trace (JSON Lines, a name ending in .jsonl: timestamp in ms, input_length,
output_length, hash_ids) (the formats and
their reader, `read_trace`, are shared/scenario/trace_csv.py and trace_mooncake.py).
The trace is read once, when the scenario loads: a bad trace is refused then, and its
rows stay with the scenario (`WorkloadConfig.rows`), so drawing the requests again
reads no file.

Processes (`workload.arrival`), all starting with a request at t = 0:
- fixed:   request i at i / rate_per_s.
- poisson: exponential gaps with mean 1 / rate_per_s.
- burst:   groups of burst_size requests arriving together, one group every
           burst_size / rate_per_s seconds (the same mean rate as `fixed`).
- trace:   arrival_s of the trace rows, divided by workload.trace_speedup (2: the
           trace replayed twice as fast); every row, or the first `requests` rows
           when workload.requests is given (`trace_rows` says how many of how many).

A trace (`workload.trace`) supplies everything it has unless the scenario overrides
it: naming one makes `arrival` and `prompt` default to "trace" (the schema fills them
in), and a row's output_tokens and prefix_tokens are used when the scenario sets no
workload.output_tokens.

Prompt lengths (`workload.prompt`): fixed prompt_tokens; uniform integers in
[prompt_min, prompt_max]; lognormal with median prompt_tokens and sigma
prompt_sigma, clamped to [prompt_min, prompt_max]; trace: the rows' prompt_tokens (in
row order, repeating when there are fewer rows than requests and arrivals do not
come from the trace). Every prompt is then clamped to [1, workload.max_prompt_tokens].

Prefix: decode.prefix_tokens, or a row's prefix_tokens when the CSV gives one, capped
at the prompt rounded down to a page multiple. A CSV prefix that is not page aligned
is kept as is: the protocol must fail that room with a reason, which is worth testing.

Output tokens: workload.output_tokens when the scenario sets it, else the row's
output length (a Mooncake trace's output_length, a CSV's output_tokens column), else 0.

Block hash ids (Mooncake's `hash_ids`, ids of the prompt's 512-token blocks) go to the
request when its prompt is the row's (prompt = "trace"), cut to the blocks of the
prompt after the cap; the prefill's prefix cache (shared/serving/prefix_cache.py) keys on them.
"""

from __future__ import annotations

import math
import random

from kvstage.shared.request import Request
from kvstage.shared.scenario import Scenario, WorkloadConfig
from kvstage.shared.scenario.trace_csv import TraceRow, read_trace
from kvstage.shared.serving.prefix_cache import BLOCK_TOKENS

__all__ = ["Request", "TraceRow", "generate_requests", "read_trace", "trace_rows"]


def _arrivals(w: WorkloadConfig, n: int, rng: random.Random) -> list[float]:
    if w.arrival == "fixed":
        return [i / w.rate_per_s for i in range(n)]
    if w.arrival == "burst":
        return [(i // w.burst_size) * w.burst_size / w.rate_per_s for i in range(n)]
    # poisson: first request at 0 so a run never starts idle; gaps ~ Exp(rate).
    out, t = [], 0.0
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(w.rate_per_s)
    return out


def _prompt(w: WorkloadConfig, rng: random.Random) -> int:
    if w.prompt == "uniform":
        return rng.randint(w.prompt_min, w.prompt_max)
    if w.prompt == "lognormal":
        x = rng.lognormvariate(math.log(w.prompt_tokens), w.prompt_sigma)
        return min(max(round(x), w.prompt_min), w.prompt_max)
    return w.prompt_tokens


def _rows(w: WorkloadConfig) -> list[TraceRow]:
    """The trace's rows as the scenario's loader read them ([] without a trace); a
    scenario built some other way reads its trace here, once."""
    if not w.uses_trace:
        return []
    if w.rows is None:
        w.keep_rows(read_trace(w.trace))
    return w.rows


def generate_requests(scenario: Scenario) -> list[Request]:
    """The scenario's requests, sorted by arrival, rooms numbered 0..n-1.

    Arrivals and prompt lengths draw from two generators derived from
    `random.Random(workload.seed)`, so changing the prompt distribution keeps the
    arrival times (and vice versa): sweeps compare like with like.
    """
    w = scenario.workload
    page = scenario.decode.page_size
    master = random.Random(w.seed)
    arrival_rng = random.Random(master.getrandbits(64))
    prompt_rng = random.Random(master.getrandbits(64))

    rows = _rows(w)
    if w.arrival == "trace":
        rows = rows if w.requests is None else rows[: w.requests]
        n = len(rows)
        arrivals = [r.arrival_s / w.trace_speedup for r in rows]
    else:
        assert w.requests is not None  # the schema fills it for generated arrivals
        n = w.requests
        arrivals = _arrivals(w, n, arrival_rng)

    cap = w.max_prompt_tokens
    items: list[tuple[float, int, int, int, tuple[int, ...]]] = []
    for i in range(n):
        row = rows[i % len(rows)] if rows else None
        from_row = w.prompt == "trace" and row is not None
        prompt = row.prompt_tokens if from_row else _prompt(w, prompt_rng)
        prompt = max(1, prompt if cap is None else min(prompt, cap))
        prefix = scenario.decode.prefix_tokens
        if row is not None and row.prefix_tokens is not None:
            prefix = row.prefix_tokens
        prefix = min(prefix, prompt // page * page)
        output = w.output_tokens
        if output is None:
            output = row.output_tokens if row is not None and row.output_tokens is not None else 0
        ids = row.hash_ids[: -(-prompt // BLOCK_TOKENS)] if from_row else ()
        items.append((arrivals[i], prompt, prefix, output, ids))

    items.sort(key=lambda it: it[0])  # stable: ties (bursts, trace) keep their order
    return [Request(room, *item) for room, item in enumerate(items)]


def trace_rows(scenario: Scenario) -> tuple[int, int] | None:
    """(rows replayed, rows in the trace) of a workload whose arrivals are a trace's,
    else None: "N of M trace rows" (workload.requests = N < M replays the first N)."""
    w = scenario.workload
    if w.arrival != "trace" or not w.trace:
        return None
    total = len(_rows(w))
    return (total if w.requests is None else min(w.requests, total)), total
