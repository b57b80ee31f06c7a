"""What every scenario table shares: the strict, frozen base model and the
bounded number types its fields use."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

MIB = 1 << 20


def mib_to_bytes(mib: float) -> int:
    """MiB (a scenario's *_mb fields) to bytes, truncated: the one formula everything
    that turns a pool size into bytes uses (the app's through kvstage/fmt.py)."""
    return int(mib * MIB)


# --------------------------------------------------------------------------- field types

# Upper bounds keep absurd values (from typos or fuzzing) from turning into huge
# loops or float overflow downstream; they are far above any real deployment.
PosInt = Annotated[int, Field(ge=1)]
NonNegInt = Annotated[int, Field(ge=0)]
TPSize = Annotated[int, Field(ge=1, le=1024)]
PosFloat = Annotated[float, Field(gt=0, le=1e15)]
NonNegFloat = Annotated[float, Field(ge=0, le=1e15)]
PoolMiB = Annotated[float, Field(ge=0, le=1e9)]


class _Table(BaseModel):
    """Common config: unknown keys rejected, TOML types taken literally, immutable.

    strict=True because TOML values are already typed: `tp = true` or `tp = 2.5`
    should be an error, not silently 1 or truncated. (A float field accepts an int.)
    frozen=True because the cross-field checks ran at validation; mutating a field
    afterwards would bypass them. Use `apply_overrides` / `scenario_from_dict`.
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)
