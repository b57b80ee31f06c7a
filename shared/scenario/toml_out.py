"""A small TOML writer: tomllib only reads.

`dumps_toml` writes nested dicts of str/int/float/bool/dates/lists so that tomllib
reads the same dict back; `Scenario.to_toml` (what a run directory stores) uses it, and error
messages use `_toml_value` to show a value as the user would have written it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from datetime import date, datetime, time
from typing import Any

__all__ = ["dumps_toml"]

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else _toml_str(key)


def _toml_str(s: str) -> str:
    out = ['"']
    for ch in s:
        if ch == "\\":
            out.append("\\\\")
        elif ch == '"':
            out.append('\\"')
        elif ch in "\n\t\r":
            out.append({"\n": "\\n", "\t": "\\t", "\r": "\\r"}[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)  # shortest round-trip form, always valid TOML
    if isinstance(v, str):
        return _toml_str(v)
    if isinstance(v, datetime | date | time):
        return v.isoformat()
    if isinstance(v, Mapping):
        inner = ", ".join(f"{_toml_key(str(k))} = {_toml_value(x)}" for k, x in v.items())
        return "{" + (f" {inner} " if inner else "") + "}"
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if v is None:
        raise TypeError("TOML has no null")
    raise TypeError(f"cannot write {type(v).__name__} as TOML")


def dumps_toml(data: Mapping[str, Any]) -> str:
    """A small TOML writer for nested dicts of str/int/float/bool/lists (None skipped).

    tomllib only reads; this writes what tomllib reads back to the same dict.
    """
    lines: list[str] = []
    _emit_table(data, (), lines)
    return "\n".join(lines).lstrip("\n") + "\n"


def _emit_table(data: Mapping[str, Any], prefix: tuple[str, ...], lines: list[str]) -> None:
    scalars = [(k, v) for k, v in data.items() if v is not None and not isinstance(v, Mapping)]
    tables = [(k, v) for k, v in data.items() if isinstance(v, Mapping)]
    if prefix and (scalars or not tables):
        lines.append("")
        lines.append("[" + ".".join(_toml_key(p) for p in prefix) + "]")
    for k, v in scalars:
        lines.append(f"{_toml_key(str(k))} = {_toml_value(v)}")
    for k, v in tables:
        _emit_table(v, (*prefix, str(k)), lines)
