"""The trace file of `workload.trace`: its CSV format and the reader of both formats.

A file whose name ends in `.jsonl` is a Mooncake trace (JSON Lines, its reader and
format in trace_mooncake.py); one ending in `.csv` is a CSV in this format (the
workload generator, shared/workload.py, says how rows are used); any other name is
refused, naming the two allowed:

- the first line that is not blank and not a `#` comment is the header: the columns
  arrival_s and prompt_tokens, optionally prefix_tokens and output_tokens, in any
  order, each once;
- then one row per request, with as many fields as the header: arrival_s a finite
  number of seconds >= 0, prompt_tokens an integer >= 1, prefix_tokens and
  output_tokens (either may be left empty) integers >= 0;
- blank lines and lines starting with `#` are skipped anywhere; rows need not be
  sorted by arrival (the generator sorts, ties keep file order); UTF-8, a byte-order
  mark is accepted.

The loader reads the file once when a scenario that uses it is loaded
(loading.py), so `kvstage validate` refuses a bad trace exactly as `sim`, `hw` and
`sweep` do; any problem is one ScenarioError naming the file, the line and the
column, the value given and what is allowed.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvstage.shared.csv_file import read_csv_file
from kvstage.shared.scenario.errors import ScenarioError
from kvstage.shared.scenario.trace_mooncake import read_mooncake
from kvstage.shared.scenario.trace_row import TraceRow

__all__ = ["TRACE_COLUMNS", "TRACE_SUFFIXES", "TraceRow", "read_trace"]

TRACE_COLUMNS = ("arrival_s", "prompt_tokens", "prefix_tokens", "output_tokens")
_REQUIRED_COLUMNS = ("arrival_s", "prompt_tokens")
_FORMAT = "arrival_s,prompt_tokens[,prefix_tokens][,output_tokens]"


def _parse_int(text: str, column: str, where: str, minimum: int) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise ScenarioError(
            f"{where}: {column} = {text!r}: expected an integer >= {minimum}"
        ) from None
    if value < minimum:
        raise ScenarioError(f"{where}: {column} = {value}: must be >= {minimum}")
    return value


def _parse_arrival(text: str, where: str) -> float:
    try:
        arrival = float(text)
    except ValueError:
        raise ScenarioError(
            f"{where}: arrival_s = {text!r}: expected a number of seconds >= 0"
        ) from None
    if not math.isfinite(arrival) or arrival < 0:
        raise ScenarioError(f"{where}: arrival_s = {text!r}: must be a finite number >= 0")
    return arrival


def _check_header(header: list[str], where: str) -> None:
    unknown = [c for c in header if c not in TRACE_COLUMNS]
    missing = [c for c in _REQUIRED_COLUMNS if c not in header]
    twice = sorted({c for c in header if header.count(c) > 1})
    if not (unknown or missing or twice):
        return
    what = []
    if missing:
        what.append(f"missing {', '.join(missing)}")
    if unknown:
        what.append(f"unknown {', '.join(repr(c) for c in unknown)}")
    if twice:
        what.append(f"{', '.join(twice)} given twice")
    hint = ""
    if all(_is_number(c) for c in header):
        hint = " (the first line that is not blank or a # comment must be the header)"
    raise ScenarioError(
        f"{where}: bad header {','.join(header)!r} ({'; '.join(what)}); expected columns "
        f"{_FORMAT} (any order, each once){hint}"
    )


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _lines(reader: Any) -> Iterator[list[str]]:
    """The reader's lines that are not blank and not comments."""
    for cells in reader:
        if not cells or not "".join(cells).strip() or cells[0].lstrip().startswith("#"):
            continue
        yield cells


def _rows(reader: Any, p: Path) -> list[TraceRow]:
    rows: list[TraceRow] = []
    header: list[str] | None = None
    for cells in _lines(reader):
        where = f"{p}:{reader.line_num}"
        if header is None:
            header = [c.strip() for c in cells]
            _check_header(header, where)
            continue
        if len(cells) != len(header):
            raise ScenarioError(
                f"{where}: {len(cells)} fields, expected {len(header)} ({','.join(header)})"
            )
        row = dict(zip(header, cells, strict=True))
        arrival = _parse_arrival(row["arrival_s"], where)
        prompt = _parse_int(row["prompt_tokens"], "prompt_tokens", where, 1)
        optional = {}
        for column in ("prefix_tokens", "output_tokens"):
            text = row.get(column, "").strip()
            optional[column] = _parse_int(text, column, where, 0) if text else None
        rows.append(
            TraceRow(
                arrival,
                prompt,
                optional["prefix_tokens"],
                reader.line_num,
                optional["output_tokens"],
            )
        )
    if header is None:
        raise ScenarioError(
            f"{p}: the trace file is empty; expected a header line {_FORMAT} and then one "
            "row per request"
        )
    if not rows:
        raise ScenarioError(
            f"{p}: trace has no data rows after its header; expected at least one row of "
            f"{','.join(header)}"
        )
    return rows


TRACE_SUFFIXES = (".csv", ".jsonl")


# The rows of the last files read, by path and content (a digest of the bytes): a plan
# loads one scenario per configuration, each naming the same trace, and parsing a
# 22,000-row Mooncake trace took about a second each time. A file whose bytes changed
# is read again.
_READ: dict[tuple[str, bytes], list[TraceRow]] = {}
_READ_KEEP = 4  # files kept


def read_trace(path: str | Path) -> list[TraceRow]:
    """Rows of a trace file: Mooncake JSON Lines when its name ends in `.jsonl`, a CSV
    when it ends in `.csv` (the format is this module's docstring).

    Any problem -- a name of another type, a missing or unreadable file, an empty one,
    a bad header, a bad row -- raises one ScenarioError naming the file and line.
    The same bytes at the same path give the rows read before (a new list of them).
    """
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in TRACE_SUFFIXES:
        raise ScenarioError(
            f"{p}: a trace file of type {suffix or '(none)'!r}; allowed: a CSV ({_FORMAT}) "
            "ending in .csv, or a Mooncake trace (JSON Lines) ending in .jsonl"
        )
    key = _content_key(p)
    rows = _READ.get(key) if key is not None else None
    if rows is None:
        rows = _read(p, suffix)  # a missing or unreadable file: the reader says so
        if key is not None and _content_key(p) == key:  # not rewritten while read
            if len(_READ) >= _READ_KEEP:
                del _READ[next(iter(_READ))]
            _READ[key] = rows
    return list(rows)


def _content_key(p: Path) -> tuple[str, bytes] | None:
    try:
        return str(p), hashlib.blake2b(p.read_bytes(), digest_size=16).digest()
    except OSError:
        return None


def _read(p: Path, suffix: str) -> list[TraceRow]:
    if suffix == ".jsonl":
        return read_mooncake(p)
    return read_csv_file(
        p, "trace file", "workload.trace", ScenarioError, lambda reader: _rows(reader, p)
    )
