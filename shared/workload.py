"""The request list of a scenario: a pure, seeded function of the scenario.

Both modes call `generate_requests(scenario)` and so replay the very same requests
(DESIGN.md, "Layout"): same rooms, arrival times, prompt lengths and prefixes. It
uses its own `random.Random` instances (never the global generator) and only the
stdlib. The only input besides the scenario is `workload.trace_csv` when the
scenario names one.

Processes (`workload.arrival`), all starting with a request at t = 0:
- fixed:   request i at i / rate_per_s.
- poisson: exponential gaps with mean 1 / rate_per_s.
- burst:   groups of burst_size requests arriving together, one group every
           burst_size / rate_per_s seconds (the same mean rate as `fixed`).
- trace:   arrival_s of the CSV rows; at most `requests` rows (the first ones).

Prompt lengths (`workload.prompt`): fixed prompt_tokens; uniform integers in
[prompt_min, prompt_max]; lognormal with median prompt_tokens and sigma
prompt_sigma, clamped to [prompt_min, prompt_max]; csv: the rows' prompt_tokens (in
row order, repeating when there are fewer rows than requests and arrivals do not
come from the trace). Every prompt is then clamped to [1, workload.max_prompt_tokens].

Prefix: decode.prefix_tokens, or a row's prefix_tokens when the CSV gives one, capped
at the prompt rounded down to a page multiple. A CSV prefix that is not page aligned
is kept as is: the protocol must fail that room with a reason, which is worth testing.
"""

from __future__ import annotations

import csv
import math
import random
from dataclasses import dataclass
from pathlib import Path

from kvstage.shared.scenario import Scenario, ScenarioError, WorkloadConfig

__all__ = ["Request", "TraceRow", "generate_requests", "read_trace"]

TRACE_COLUMNS = ("arrival_s", "prompt_tokens", "prefix_tokens")
_REQUIRED_COLUMNS = ("arrival_s", "prompt_tokens")


@dataclass(frozen=True, slots=True)
class Request:
    """One request: its room id, when it arrives, and how much KV it needs moved."""

    room: int
    arrival_s: float
    prompt_tokens: int
    prefix_tokens: int


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One data row of a trace CSV; `line` is its line number in the file."""

    arrival_s: float
    prompt_tokens: int
    prefix_tokens: int | None
    line: int


def _parse_int(text: str, column: str, where: str, minimum: int) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise ScenarioError(f"{where}: {column} = {text!r}: expected an integer") from None
    if value < minimum:
        raise ScenarioError(f"{where}: {column} = {value}: must be >= {minimum}")
    return value


def read_trace(path: str | Path) -> list[TraceRow]:
    """Rows of a trace CSV with header arrival_s,prompt_tokens[,prefix_tokens].

    Blank lines and lines starting with '#' are skipped. Any bad row raises a
    ScenarioError naming the file and line.
    """
    p = Path(path)
    try:
        fh = p.open(newline="", encoding="utf-8")
    except FileNotFoundError:
        raise ScenarioError(f"{p}: no such trace file (workload.trace_csv)") from None
    except OSError as exc:
        raise ScenarioError(f"{p}: cannot read trace: {exc}") from None
    rows: list[TraceRow] = []
    header: list[str] | None = None
    with fh:
        reader = csv.reader(fh)
        try:
            for cells in reader:
                where = f"{p}:{reader.line_num}"
                if not cells or not "".join(cells).strip() or cells[0].lstrip().startswith("#"):
                    continue
                if header is None:
                    header = [c.strip() for c in cells]
                    unknown = [c for c in header if c not in TRACE_COLUMNS]
                    missing = [c for c in _REQUIRED_COLUMNS if c not in header]
                    if unknown or missing or len(set(header)) != len(header):
                        raise ScenarioError(
                            f"{where}: bad header {','.join(header)!r}; expected columns "
                            "arrival_s,prompt_tokens[,prefix_tokens] (any order, each once)"
                        )
                    continue
                if len(cells) != len(header):
                    raise ScenarioError(
                        f"{where}: {len(cells)} fields, expected {len(header)} ({','.join(header)})"
                    )
                row = dict(zip(header, cells, strict=True))
                try:
                    arrival = float(row["arrival_s"])
                except ValueError:
                    raise ScenarioError(
                        f"{where}: arrival_s = {row['arrival_s']!r}: expected a number"
                    ) from None
                if not math.isfinite(arrival) or arrival < 0:
                    raise ScenarioError(
                        f"{where}: arrival_s = {row['arrival_s']!r}: must be a finite number >= 0"
                    )
                prompt = _parse_int(row["prompt_tokens"], "prompt_tokens", where, 1)
                prefix_text = row.get("prefix_tokens", "").strip()
                prefix = _parse_int(prefix_text, "prefix_tokens", where, 0) if prefix_text else None
                rows.append(TraceRow(arrival, prompt, prefix, reader.line_num))
        except csv.Error as exc:
            raise ScenarioError(f"{p}:{reader.line_num}: bad CSV: {exc}") from None
        except UnicodeDecodeError as exc:
            raise ScenarioError(f"{p}: not UTF-8 text: {exc}") from None
    if not rows:
        raise ScenarioError(f"{p}: trace has no data rows (workload.trace_csv)")
    return rows


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

    rows = (
        read_trace(w.trace_csv)
        if w.trace_csv and (w.arrival == "trace" or w.prompt == "csv")
        else []
    )
    if w.arrival == "trace":
        rows = rows[: w.requests]
        n = len(rows)
        arrivals = [r.arrival_s for r in rows]
    else:
        n = w.requests
        arrivals = _arrivals(w, n, arrival_rng)

    cap = w.max_prompt_tokens
    items: list[tuple[float, int, int]] = []
    for i in range(n):
        row = rows[i % len(rows)] if rows else None
        prompt = (
            row.prompt_tokens if (w.prompt == "csv" and row is not None) else _prompt(w, prompt_rng)
        )
        prompt = max(1, prompt if cap is None else min(prompt, cap))
        prefix = scenario.decode.prefix_tokens
        if row is not None and row.prefix_tokens is not None:
            prefix = row.prefix_tokens
        prefix = min(prefix, prompt // page * page)
        items.append((arrivals[i], prompt, prefix))

    items.sort(key=lambda it: it[0])  # stable: ties (bursts, trace) keep their order
    return [Request(room, t, prompt, prefix) for room, (t, prompt, prefix) in enumerate(items)]
