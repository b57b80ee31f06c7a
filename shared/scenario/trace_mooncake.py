"""The Mooncake trace format (JSON Lines) of `workload.trace`: its reader.

Mooncake's published traces (and SGLang's and others' benchmark tools that replay
them) hold one JSON object per line:

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

- `timestamp`: the arrival in milliseconds (a finite number >= 0), here arrival_s =
  timestamp / 1000 (`workload.trace_speedup` then divides it);
- `input_length`: the prompt in tokens (an integer >= 1) -> prompt_tokens;
- `output_length` (optional): the tokens generated (an integer >= 0) -> the request's
  output_tokens (the decode side generates them: TPOT, KV held until the last token);
- `hash_ids` (optional): ids of the prompt's 512-token blocks, block i holding tokens
  [512 i, 512 (i + 1)) (the last one may be partial), each id naming the block's
  content after the same prefix, so two prompts share a prefix exactly as far as
  their leading ids agree -> the request's hash_ids, which the prefill instance's
  prefix cache looks up (shared/serving/prefix_cache.py: cached tokens skip the forward).
  That is not `decode.prefix_tokens`, a prefix the *decode* already holds, which
  shortens the transfer; a prefill-side hit does not (docs/prefix-reuse.md).
Other keys are ignored. Blank lines are skipped; lines need not be sorted.

A file is read in this format when its name ends in `.jsonl` (`read_trace` in
trace_csv.py chooses). Any problem is one ScenarioError naming the file, the line,
the key, the value given and what is allowed, like the CSV reader's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from kvstage.shared.scenario.errors import ScenarioError
from kvstage.shared.scenario.trace_row import TraceRow

__all__ = ["MOONCAKE_FORMAT", "read_mooncake"]

MOONCAKE_FORMAT = (
    'one JSON object per line: {"timestamp": ms, "input_length": tokens'
    '[, "output_length": tokens, "hash_ids": [block ids]]}'
)


def _int(obj: dict[str, Any], key: str, where: str, minimum: int) -> int | None:
    if key not in obj:
        return None
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
        raise ScenarioError(
            f"{where}: {key} = {json.dumps(value)}: expected an integer >= {minimum}"
        )
    if value < minimum:
        raise ScenarioError(f"{where}: {key} = {json.dumps(value)}: must be >= {minimum}")
    return int(value)


def _row(obj: Any, where: str, line: int) -> TraceRow:
    if not isinstance(obj, dict):
        raise ScenarioError(
            f"{where}: expected a JSON object, got {json.dumps(obj)[:60]}; {MOONCAKE_FORMAT}"
        )
    missing = [k for k in ("timestamp", "input_length") if k not in obj]
    if missing:
        raise ScenarioError(f"{where}: missing {', '.join(missing)}; {MOONCAKE_FORMAT}")
    ts = obj["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts) or ts < 0:
        raise ScenarioError(
            f"{where}: timestamp = {json.dumps(ts)}: expected milliseconds, a finite number >= 0"
        )
    ids = obj.get("hash_ids", [])
    if not isinstance(ids, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        raise ScenarioError(
            f"{where}: hash_ids = {json.dumps(ids)[:60]}: expected a list of integers "
            "(one id per 512-token block of the prompt)"
        )
    prompt = _int(obj, "input_length", where, 1)
    assert prompt is not None
    output = _int(obj, "output_length", where, 0)
    return TraceRow(ts / 1000.0, prompt, None, line, output, tuple(ids))


def read_mooncake(p: Path) -> list[TraceRow]:
    """Rows of a Mooncake JSON Lines trace (the format is this module's docstring)."""
    try:
        text = p.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise ScenarioError(f"{p}: no such trace file (workload.trace)") from None
    except UnicodeDecodeError as exc:
        raise ScenarioError(f"{p}: not UTF-8 text: {exc}") from None
    except OSError as exc:
        raise ScenarioError(f"{p}: cannot read trace: {exc}") from None
    rows: list[TraceRow] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{p}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ScenarioError(
                f"{where}: not JSON ({exc.msg}, column {exc.colno}); {MOONCAKE_FORMAT}"
            ) from None
        rows.append(_row(obj, where, n))
    if not rows:
        raise ScenarioError(
            f"{p}: the trace file is empty; expected Mooncake JSON Lines, {MOONCAKE_FORMAT}"
        )
    return rows
