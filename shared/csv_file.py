"""A CSV file a user names in a scenario (a trace, a kernel table): opened and parsed
with the same one-line errors, `FILE[:LINE]: what is wrong`, never a traceback."""

from __future__ import annotations

import csv
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["read_csv_file"]

T = TypeVar("T")


def read_csv_file(
    path: str | Path,
    what: str,
    key: str,
    error: type[Exception],
    parse: Callable[[Any], T],
    *,
    dicts: bool = False,
) -> T:
    """`parse(reader)` over the CSV file at `path` (a `csv.DictReader` if `dicts`, else a
    `csv.reader`), a UTF-8 BOM allowed. `what` names the file for the user ("trace
    file"), `key` the scenario key that named it; each failure to open or decode the file
    is one `error`, naming the file and, for bad CSV, the line."""
    p = Path(path)
    try:
        fh = p.open(newline="", encoding="utf-8-sig")
    except FileNotFoundError:
        raise error(f"{p}: no such {what} ({key})") from None
    except OSError as exc:
        raise error(f"{p}: cannot read the {what}: {exc}") from None
    with fh:
        reader = csv.DictReader(fh) if dicts else csv.reader(fh)
        try:
            return parse(reader)
        except csv.Error as exc:
            raise error(f"{p}:{reader.line_num}: bad CSV: {exc}") from None
        except UnicodeDecodeError as exc:
            raise error(f"{p}: not UTF-8 text: {exc}") from None
