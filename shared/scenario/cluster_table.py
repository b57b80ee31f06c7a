"""[cluster]: prefill and decode instances, the router, and how they sit on nodes.

Without the table a scenario is one prefill instance talking to one decode instance,
as before. With it, every decode instance owns its own staging ring per rank, shared
by the sessions of every prefill instance the router sends its rooms from.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from kvstage.shared.scenario.fieldtypes import _Table

__all__ = ["ClusterConfig"]

Instances = Annotated[int, Field(ge=1, le=4096)]


class ClusterConfig(_Table):
    """[cluster]: instance counts, the router, and the node layout.

    router: round-robin (request i -> prefill instance i mod N, decode instance i mod
    M); least-outstanding (the instances with the fewest rooms not yet ended);
    staging-aware (prefill: least outstanding; decode: the instance whose ranks have
    the most free staging ring and KV pages, then the fewest outstanding rooms);
    cache-aware (prefill: the instance whose prefix cache holds the longest prefix of
    the request's hash_ids, then the fewest outstanding rooms; decode: least
    outstanding; docs/prefix-reuse.md).
    Nodes: instances are packed onto nodes of `gpus_per_node` GPUs in order, prefill
    instances first, decode instances on nodes of their own; a node's `nics_per_node`
    NICs are rail-aligned (GPU i uses NIC i * nics_per_node // gpus_per_node) and
    shared by every rank on that rail. Unset: `gpus_per_node / links.gpus_per_nic`.
    fold: simulate local prefill rank 0 of each instance and the decode ranks it writes
    to; the others' messages and NIC traffic are mirrored (sim/fold.py). Same latencies,
    a fraction of the cost; refused where the ranks are not alike (faults, host model).
    shard: simulate each independent group of instances on its own (sim/shard.py): with
    round-robin routing, instances that share no room and no NIC never affect each other,
    so each group runs as a small simulation and their records are merged in time order.
    Same latencies; the cost per request no longer grows with the cluster. Refused with
    a load-aware router (it couples every instance) and with the host model.
    max_local_prefill_length: conditional disaggregation (simulation only): a prompt
    whose uncached tokens (its prompt less the decode's cached prefix) are at most this
    many is prefilled on its decode instance, its chunks mixed into the decode batch's
    steps, and moves no KV; longer ones go to a prefill instance. [C] Dynamo's
    disaggregated router (ai-dynamo/dynamo lib/llm/src/disagg_router.rs
    `prefill_remote`: remote when `prefill_length - prefix_hit_length >
    max_local_prefill_length`). None or "off" (the default): every prompt is prefilled
    on a prefill instance.
    """

    prefill_instances: Instances = 1
    decode_instances: Instances = 1
    router: Literal["round-robin", "least-outstanding", "staging-aware", "cache-aware"] = (
        "round-robin"
    )
    gpus_per_node: Annotated[int, Field(ge=1, le=1024)] = 8
    nics_per_node: Annotated[int, Field(ge=1, le=1024)] | None = None
    # simulate one rank per set of symmetric ranks (sim/fold.py): for speed at scale
    fold: bool = False
    # simulate each independent group of instances on its own (sim/shard.py)
    shard: bool = False
    # conditional disaggregation: prompts of at most this many uncached tokens are
    # prefilled on their decode instance (None: none are)
    max_local_prefill_length: int | None = None

    @field_validator("max_local_prefill_length", mode="before")
    @classmethod
    def _local_tokens(cls, v: object) -> object:
        if v is None or (isinstance(v, str) and v.strip().lower() == "off"):
            return None
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(
                "a whole number of tokens >= 0 (a prompt with at most that many uncached "
                'tokens is prefilled on its decode instance) or "off"'
            )
        return v

    @model_validator(mode="after")
    def _nics_fit(self) -> ClusterConfig:
        if self.nics_per_node is not None and self.nics_per_node > self.gpus_per_node:
            raise ValueError(
                f"nics_per_node ({self.nics_per_node}) must be <= gpus_per_node "
                f"({self.gpus_per_node}): a NIC serves one or more GPUs"
            )
        if self.max_local_prefill_length is not None and (self.fold or self.shard):
            raise ValueError(
                "max_local_prefill_length (prompts prefilled on their decode instance) "
                "cannot be combined with fold or shard: set one or the other"
            )
        return self

    def prefills_locally(self, prompt_tokens: int, prefix_tokens: int) -> bool:
        """Whether a prompt is prefilled on its decode instance (the class docstring)."""
        limit = self.max_local_prefill_length
        return limit is not None and prompt_tokens - prefix_tokens <= limit

    @property
    def single(self) -> bool:
        """One instance each: the one-to-one case."""
        return self.prefill_instances == 1 and self.decode_instances == 1
