"""Numbers, JSON and colours, one way for the whole application.

- `ms`, `secs`, `pct`, `share`, `num`, `fixed`: a time in seconds as milliseconds, or
  as milliseconds below a second and seconds above, a relative difference as a signed
  percentage, a share (a utilization) as a percentage, any number by a format spec and
  a number with fixed decimals, for tables; "-" for a figure that is missing (None, NaN
  or infinite; an infinite share is "infinite");
- `csv_cell`: a value as a CSV cell (None empty, booleans true / false, lists and
  tables as JSON);
- `json_safe`, `json_text`: JSON has no NaN or infinity: such a float is written as null
  (a metric that had no samples), every key as a string;
- `MIB`, `mib_to_bytes`: the scenario's own (kvstage/shared/scenario/fieldtypes.py), so a
  pool size read back from a run directory is the bytes the run had;
- `quantile`: linear interpolation between the two nearest ranks (numpy's default), NaN
  of no values;
- `OKABE_ITO`: the colour-blind safe palette every figure draws with.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from kvstage.shared.scenario.fieldtypes import MIB, mib_to_bytes

__all__ = [
    "MIB",
    "csv_cell",
    "fixed",
    "json_safe",
    "json_text",
    "mib_to_bytes",
    "ms",
    "num",
    "pct",
    "quantile",
    "secs",
    "share",
]


def _missing(x: float | None) -> bool:
    return x is None or not math.isfinite(x)


def ms(x: float | None) -> str:
    """Seconds as "1,234.56 ms"; "-" when missing."""
    return "-" if _missing(x) else f"{x * 1e3:,.2f} ms"


def secs(x: float | None) -> str:
    """Seconds as "12.3 ms" below a second, "1,234.56 s" above; "-" when missing."""
    if _missing(x):
        return "-"
    return f"{x * 1e3:,.1f} ms" if x < 1 else f"{x:,.2f} s"


def pct(x: float | None) -> str:
    """A relative difference as "+12.3%"; "-" when missing."""
    return "-" if _missing(x) else f"{x:+.1%}"


def share(x: float | None) -> str:
    """A share of a whole (a utilization) as "42%"; "infinite" when infinite (no
    capacity at all), "-" when missing."""
    if x is not None and math.isinf(x):
        return "infinite"
    return "-" if _missing(x) else f"{x:.0%}"


def num(x: float | None, unit: str = "", scale: float = 1.0, spec: str = ".3g") -> str:
    """`x` times `scale` by the format `spec`, then `unit`; "-" when missing."""
    if _missing(x):
        return "-"
    return f"{x if scale == 1.0 else x * scale:{spec}}{unit}"


def fixed(x: float | None, unit: str = "", digits: int = 2) -> str:
    """An int whole with thousands separators, a float with `digits` decimals; "-"
    when missing."""
    if _missing(x):
        return "-"
    return f"{x:,}{unit}" if isinstance(x, int) else f"{x:,.{digits}f}{unit}"


def csv_cell(v: Any) -> Any:
    """A value as a CSV cell: None empty, a bool true / false, a list or table as JSON."""
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list | dict):
        return json.dumps(v)
    return v


def json_safe(obj: Any) -> Any:
    """`obj` with every non-finite float as None, dict keys as strings, tuples as lists."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return obj


def json_text(obj: Any, indent: int = 2) -> str:
    """`obj` as JSON text (`json_safe`), one trailing newline."""
    return json.dumps(json_safe(obj), indent=indent) + "\n"


def quantile(xs: Sequence[float], p: float) -> float:
    """The `p` quantile (0..1, clamped) of the sorted `xs`; NaN when there are none."""
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * min(max(p, 0.0), 1.0)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


# Okabe & Ito (2008), "Color Universal Design".
OKABE_ITO = {
    "orange": "#E69F00",
    "sky_blue": "#56B4E9",
    "green": "#009E73",
    "yellow": "#F0E442",
    "blue": "#0072B2",
    "vermillion": "#D55E00",
    "purple": "#CC79A7",
    "black": "#000000",
}
