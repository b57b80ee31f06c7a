"""A request: the unit of work both modes replay (shared/workload.py draws them)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Request"]


@dataclass(frozen=True, slots=True)
class Request:
    """One request: its room id, when it arrives, and how much KV it needs moved."""

    room: int
    arrival_s: float
    prompt_tokens: int
    prefix_tokens: int
    output_tokens: int = 0  # tokens to generate, from a trace that says (0: not known)
    hash_ids: tuple[int, ...] = ()  # the prompt's 512-token blocks, from a Mooncake trace
