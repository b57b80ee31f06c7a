"""Printing a table so that every name in it stays whole.

A rich table wider than the console is squeezed: each column is cut with an ellipsis,
the name column too ("llama…"), and that is the one column a reader needs. So a table
that fits is printed as a table; one that does not (a pipe or a log at 80 columns, a
narrow terminal) is printed as plain text instead: its title, then per row its first
cell (the name) on a line of its own and the other cells as "header: value" pairs,
wrapped to the console's width under it. A table without a header (name and value
rows) prints one "name: value" line per row, wrapped the same way. Nothing is cut.
"""

from __future__ import annotations

import textwrap

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

__all__ = ["plain_lines", "print_table"]

INDENT = "  "


def print_table(console: Console, table: Table) -> None:
    """`table` as a table when it fits the console's width, else as plain text."""
    natural = Measurement.get(console, console.options.update_width(1 << 20), table).maximum
    if natural <= console.width:
        console.print(table)
        return
    for line in plain_lines(console, table, console.width):
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def _plain(console: Console, cell: object) -> str:
    if isinstance(cell, str):
        return console.render_str(cell).plain  # markup as the table would have read it
    if isinstance(cell, Text):
        return cell.plain
    return str(cell)


def _wrap(text: str, width: int, first: str = INDENT) -> list[str]:
    return textwrap.wrap(
        text,
        width=width,
        initial_indent=first,
        subsequent_indent=INDENT,
        break_on_hyphens=False,
    ) or [first.rstrip()]


def plain_lines(console: Console, table: Table, width: int) -> list[str]:
    """The lines of `table` as plain text, none wider than `width` (a single word
    longer than the width, which no name is, would be broken)."""
    lines: list[str] = []
    if table.title:
        lines += _wrap(_plain(console, table.title), width, first="")
    columns = table.columns
    headers = [_plain(console, c.header) for c in columns]
    cells = [[_plain(console, x) for x in c._cells] for c in columns]
    for row in range(table.row_count):
        values = [col[row] if row < len(col) else "" for col in cells]
        name, rest = values[0], values[1:]
        if not table.show_header:
            lines += _wrap(f"{name}: {'  '.join(v for v in rest if v)}", width, first="")
            continue
        lines.append(name)
        pairs = [f"{h}: {v}" for h, v in zip(headers[1:], rest, strict=True) if v]
        if pairs:
            lines += _wrap("; ".join(pairs), width)
    return lines
