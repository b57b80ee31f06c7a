"""Reading and writing the trace of a run (Parquet, or JSONL when asked).

Both modes hand over `TraceRecord`s; this is the only place that knows the file
formats, so every later tool reads simulation and hardware runs the same way.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from itertools import starmap
from operator import attrgetter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from kvstage.shared.trace import TRACE_FIELDS, TRACE_TYPES, TraceRecord

_ARROW = {"str": pa.string(), "int": pa.int64(), "float": pa.float64()}
SCHEMA = pa.schema([("mode", pa.string())] + [(n, _ARROW[TRACE_TYPES[n]]) for n in TRACE_FIELDS])


_GETTERS = {name: attrgetter(name) for name in TRACE_FIELDS}


def to_table(records: Sequence[TraceRecord], mode: str) -> pa.Table:
    # Column by column, with C-level getters: a 1,000-request run has ~250k rows.
    columns = [pa.repeat(pa.scalar(mode, pa.string()), len(records))]
    for name in TRACE_FIELDS:
        columns.append(pa.array(list(map(_GETTERS[name], records)), SCHEMA.field(name).type))
    return pa.Table.from_arrays(columns, schema=SCHEMA)


def write_trace(path: Path, records: Sequence[TraceRecord], mode: str) -> Path:
    """Write `records`; the suffix (.parquet or .jsonl) picks the format."""
    path = Path(path)
    if path.suffix == ".jsonl":
        with path.open("w") as fh:
            for r in records:
                row = {"mode": mode, **{n: getattr(r, n) for n in TRACE_FIELDS}}
                fh.write(json.dumps(row, separators=(",", ":")) + "\n")
        return path
    # No statistics or timestamps that would vary: same records, same bytes.
    pq.write_table(to_table(records, mode), path, compression="zstd", write_statistics=False)
    return path


def find_trace(run_dir: Path) -> Path:
    run_dir = Path(run_dir)
    if run_dir.is_file():
        return run_dir
    for name in ("trace.parquet", "trace.jsonl"):
        if (run_dir / name).exists():
            return run_dir / name
    raise FileNotFoundError(f"no trace.parquet or trace.jsonl in {run_dir}")


def read_table(path: Path) -> pa.Table:
    path = find_trace(path)
    if path.suffix == ".jsonl":
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return pa.Table.from_pylist(rows, schema=SCHEMA)
    return pq.read_table(path, schema=SCHEMA)


def read_records(path: Path) -> tuple[str, list[TraceRecord]]:
    """(mode, records) of a trace file or run directory."""
    table = read_table(path)
    cols = table.to_pydict()
    mode = cols["mode"][0] if cols["mode"] else ""
    # TRACE_FIELDS is TraceRecord's field order, so rows build positionally.
    records = list(starmap(TraceRecord, zip(*(cols[n] for n in TRACE_FIELDS), strict=True)))
    return mode, records
