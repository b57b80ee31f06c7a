"""Reading a tool's JSON with checks that name the line (or record) and the field: the
helpers every JSON reader of kvstage/measured/ shares."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvstage.measured.measurement import MeasuredError, MeasuredRequest


def json_file(path: Path) -> Any:
    """The whole file as one JSON value."""
    try:
        return json.loads(Path(path).read_text())
    except ValueError as exc:
        raise MeasuredError(path, str(exc.lineno), "(file)", f"not JSON ({exc.msg})") from None


def json_lines(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """Every non-empty line of a JSONL file as (line number, object)."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise MeasuredError(path, str(n), "(line)", f"not JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise MeasuredError(path, str(n), "(line)", "not a JSON object")
        out.append((n, obj))
    if not out:
        raise MeasuredError(path, "", "(file)", "empty")
    return out


def number(path: Path, where: str, record: dict, key: str, *, kind: type = float) -> Any:
    """record[key] as a number of `kind`, or one error naming the field."""
    value = record.get(key)
    if value is None:
        raise MeasuredError(path, where, key, "missing")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise MeasuredError(path, where, key, f"not a number: {value!r}")
    if kind is int and value != int(value):
        raise MeasuredError(path, where, key, f"not a whole number: {value!r}")
    return kind(value)


def per_request_lists(path: Path, where: str, record: dict, keys: tuple[str, ...]) -> int:
    """The per-request lists `keys` of a record, all present and of one length."""
    n = None
    for key in keys:
        value = record.get(key)
        if not isinstance(value, list):
            raise MeasuredError(path, where, key, "missing or not a list")
        if n is not None and len(value) != n:
            raise MeasuredError(path, where, key, f"{len(value)} entries, {keys[0]} has {n}")
        n = len(value)
    return n or 0


def listed_request(
    path: Path, where: str, rec: dict, i: int, *, arrival_s: float, e2e_s: float | None
) -> MeasuredRequest:
    """Request `i` of the per-request lists bench_serving and vllm bench serve share
    (`input_lens`, `output_lens`, `ttfts`, `itls`, `errors`); `e2e_s` None: TTFT plus
    the gaps."""
    error = rec["errors"][i] or ""
    gaps, ttft = rec["itls"][i], rec["ttfts"][i]
    if not isinstance(gaps, list) or not all(isinstance(g, int | float) for g in gaps):
        raise MeasuredError(path, where, f"itls[{i}]", "not a list of seconds")
    if not isinstance(ttft, int | float):
        raise MeasuredError(path, where, f"ttfts[{i}]", f"not a number: {ttft!r}")
    return MeasuredRequest(
        arrival_s=arrival_s,
        ttft_s=None if error else float(ttft),
        e2e_s=e2e_s if e2e_s is not None or error else float(ttft) + sum(gaps),
        output_tokens=int(rec["output_lens"][i] or 0),
        prompt_tokens=int(rec["input_lens"][i] or 0),
        itls_s=[float(g) for g in gaps],
        error=str(error),
    )
