"""Numbers, JSON and colours, one way for the whole application.

- `ms`, `pct`: a time in seconds as milliseconds and a relative difference as a signed
  percentage, for tables; "-" for a figure that is missing (None, NaN or infinite);
- `json_safe`, `json_text`: JSON has no NaN or infinity: such a float is written as null
  (a metric that had no samples), every key as a string;
- `MIB`, `mib_to_bytes`: the scenario's own (kvstage/shared/scenario/fieldtypes.py), so a
  pool size read back from a run directory is the bytes the run had;
- `quantile`: linear interpolation between the two nearest ranks (numpy's default);
- `OKABE_ITO`: the colour-blind safe palette every figure draws with.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from kvstage.shared.scenario.fieldtypes import MIB, mib_to_bytes

__all__ = ["MIB", "json_safe", "json_text", "mib_to_bytes", "ms", "pct", "quantile"]


def _missing(x: float | None) -> bool:
    return x is None or not math.isfinite(x)


def ms(x: float | None) -> str:
    """Seconds as "1,234.56 ms"; "-" when missing."""
    return "-" if _missing(x) else f"{x * 1e3:,.2f} ms"


def pct(x: float | None) -> str:
    """A relative difference as "+12.3%"; "-" when missing."""
    return "-" if _missing(x) else f"{x:+.1%}"


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
    """The `p` quantile (0..1) of the sorted, non-empty `xs`."""
    pos = (len(xs) - 1) * p
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
