"""One request of a trace file, whichever its format (trace_csv.py, trace_mooncake.py)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TraceRow"]


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One request of a trace file; `line` is its line number in the file."""

    arrival_s: float
    prompt_tokens: int
    prefix_tokens: int | None
    line: int
    output_tokens: int | None = None  # tokens generated, when the trace says
    # ids of the prompt's 512-token blocks (Mooncake traces; shared/serving/prefix_cache.py)
    hash_ids: tuple[int, ...] = ()
