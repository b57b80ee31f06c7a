"""Cost figures of a plan's configurations from a price per GPU-hour.

`--gpu-hour-cost h100-sxm=2.5,h200=3.6` (`parse_gpu_costs`) prices each catalogue GPU
(kvstage/shared/serving/gpus.py names them) per GPU-hour, in any currency; without it
no cost is given. Per simulated configuration (`cost_figures`):

* `cost_per_hour`: prefill GPUs x the prefill GPU's price + decode GPUs x the decode
  GPU's price;
* `cost_per_m_input_tokens`: what the prefill side costs per million prompt tokens it
  serves over the steady window: prefill cost per hour / (input tokens/s x 3,600) x 1e6;
* `cost_per_m_output_tokens`: the decode side's cost per million generated tokens, the
  same way with the decode GPUs and output tokens/s.

A disaggregated cluster splits its GPUs by the work: prefill GPUs compute the prompt,
decode GPUs generate, so each side's cost is charged to its own tokens, and a
million input tokens plus a million output tokens cost the sum of the two figures.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from kvstage.explore.executor import ExploreError

__all__ = ["COST_COLUMNS", "add_costs", "cost_figures", "parse_gpu_costs"]

COST_COLUMNS = ("cost_per_hour", "cost_per_m_input_tokens", "cost_per_m_output_tokens")


def parse_gpu_costs(text: str | None) -> dict[str, float] | None:
    """`NAME=PRICE,...` -> {name: price per GPU-hour}; ExploreError (one line) when a
    name is not a catalogue GPU or a price is not a number >= 0."""
    if text is None:
        return None
    from kvstage.shared.serving.gpus import GPUS, gpu_names

    out: dict[str, float] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, eq, price = (x.strip() for x in item.partition("="))
        if not eq or not name:
            raise ExploreError(
                f"--gpu-hour-cost {text!r}: {item!r} is not NAME=PRICE (e.g. h100-sxm=2.5,h200=3.6)"
            )
        if name not in GPUS:
            raise ExploreError(f"--gpu-hour-cost: unknown GPU {name!r}; allowed: {gpu_names()}")
        try:
            value = float(price)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0:
            raise ExploreError(
                f"--gpu-hour-cost: {name}={price!r}: the price per GPU-hour must be a number >= 0"
            )
        if name in out:
            raise ExploreError(f"--gpu-hour-cost: {name} is priced twice")
        out[name] = value
    if not out:
        raise ExploreError(f"--gpu-hour-cost {text!r}: no NAME=PRICE given (e.g. h200=3.6)")
    return out


def cost_figures(row: dict[str, Any], prices: dict[str, float]) -> dict[str, float | None]:
    """The cost columns of one row (None where a GPU has no price or a side serves no tokens)."""
    out: dict[str, float | None] = dict.fromkeys(COST_COLUMNS)
    pg, dg = prices.get(row.get("prefill_gpu")), prices.get(row.get("decode_gpu"))
    if pg is None or dg is None:
        return out
    prefill = row["cluster.prefill_instances"] * row["prefill.tp"] * pg
    decode = row["cluster.decode_instances"] * row["decode.tp"] * dg
    out["cost_per_hour"] = prefill + decode
    gpus = row["gpus"]
    for key, side, tokens in (
        ("cost_per_m_input_tokens", prefill, row.get("input_tokens_per_gpu_s")),
        ("cost_per_m_output_tokens", decode, row.get("output_tokens_per_gpu_s")),
    ):
        if tokens:
            out[key] = side / (tokens * gpus * 3600) * 1e6
    return out


def add_costs(rows: Sequence[dict[str, Any]], prices: dict[str, float] | None) -> None:
    """Fill the cost columns of every simulated row (in place); nothing without prices."""
    for row in rows:
        row.update(dict.fromkeys(COST_COLUMNS))
        if prices and row.get("input_tokens_per_gpu_s") is not None:
            row.update(cost_figures(row, prices))
