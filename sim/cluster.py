"""The cluster's hardware in simulated time: which NIC each rank sends through, and
what a load-aware router sees of every instance (`LiveLoads`: kept current as ranks
handle events, so routing a request does not read the whole cluster).

Instances are packed onto nodes in order of their global ranks (shared/cluster.py):
prefill instances first, then decode instances on nodes of their own. A node's NICs
are rail-aligned: GPU slot i uses NIC i * nics // gpus_per_node, so every rank on
that rail, of whichever instance, shares that NIC through the fair fabric.
"""

from __future__ import annotations

import math
from collections.abc import Container, Sequence
from dataclasses import replace

from kvstage.shared.cluster import InstanceLoad, Router, Sessions, least
from kvstage.shared.runtime import RankRuntime
from kvstage.shared.scenario import Scenario
from kvstage.shared.scenario.profiles import ResolvedLinks
from kvstage.shared.workload import Request
from kvstage.sim.links import Fabric

__all__ = ["LiveLoads", "cluster_nics"]


def cluster_nics(
    fabric: Fabric,
    scenario: Scenario,
    sessions: Sessions,
    links: ResolvedLinks,
    instances: tuple[Container[int], Container[int]] | None = None,
) -> tuple[list, list]:
    """The NIC of every global prefill rank and every global decode rank; with
    `instances` (prefill instances, decode instances: one shard of a large cluster,
    sim/shard.py), None for the ranks of every other instance."""
    c = scenario.cluster
    bw = links.link.bandwidth_bytes_s
    gpn = c.gpus_per_node
    nics = c.nics_per_node or max(1, gpn // links.gpus_per_nic)
    made: dict[tuple[str, int, int], object] = {}

    def nic(side: str, rank: int) -> object:
        node, slot = divmod(rank, gpn)
        if links.placement == "intra":  # one NVLink port per GPU
            key = (side, node, slot)
        else:
            key = (side, node, slot * nics // gpn)
        if key not in made:
            made[key] = fabric.add_nic(
                f"{side}-node{key[1]}-{'gpu' if links.placement == 'intra' else 'nic'}{key[2]}", bw
            )
        return made[key]

    if instances is None:
        return (
            [nic("prefill", p) for p in range(sessions.prefill_ranks)],
            [nic("decode", d) for d in range(sessions.decode_ranks)],
        )
    # a shard holds every instance its NICs are shared with: the others' are never used
    pi, di = instances
    return (
        [
            nic("prefill", p) if p // sessions.prefill_tp in pi else None
            for p in range(sessions.prefill_ranks)
        ],
        [
            nic("decode", d) if d // sessions.decode_tp in di else None
            for d in range(sessions.decode_ranks)
        ],
    )


def _load(group: Sequence[RankRuntime]) -> InstanceLoad:
    """What a router sees of one instance (its simulated ranks)."""
    ring = [
        rt.machine.ring.size - rt.machine.ring.used_bytes
        for rt in group
        if hasattr(rt.machine, "ring")
    ]
    return InstanceLoad(
        outstanding=group[0].outstanding,
        free_ring_bytes=min(ring) if ring else 0,
        free_kv_pages=min(rt.free_kv_pages for rt in group),
    )


class LiveLoads:
    """A load-aware router's view of every instance, kept current as the run goes.

    Reading every instance's load at each arrival cost O(instances) Python work per
    request (at 128 prefill + 64 decode instances, 12-23% of the run's CPU).
    Instead each instance's rank key (`Router.key`) is kept, and only the instances
    whose ranks handled an event since the last arrival (`touch`) are read again: an
    instance's load changes only through its ranks' events and `assign`. The choice is
    then the least key, lowest index first, as `Router.route` makes it from fresh loads.
    """

    def __init__(
        self,
        router: Router,
        prefill: Sequence[RankRuntime | None],
        prefill_tp: int,
        decode: Sequence[RankRuntime | None],
        decode_tp: int,
    ) -> None:
        self._router = router
        self._groups = {
            role: [
                [rt for rt in ranks[i : i + tp] if rt is not None]  # folded ranks are None
                for i in range(0, len(ranks), tp)
            ]
            for role, ranks, tp in (("prefill", prefill, prefill_tp), ("decode", decode, decode_tp))
        }
        self._loads = {role: [_load(g) for g in groups] for role, groups in self._groups.items()}
        self._keys = {
            role: [router.key(role, x) for x in loads] for role, loads in self._loads.items()
        }
        self._dirty: set[RankRuntime] = set()
        # instances that take no new request (an autoscaler's: starting up, draining,
        # not asked for; kvstage/explore/autoscale_disagg.py); empty: all take them
        self.closed: dict[str, set[int]] = {"prefill": set(), "decode": set()}

    def outstanding(self, role: str) -> list[int]:
        """Each instance of `role`'s rooms routed to it and not ended there."""
        return [g[0].outstanding if g else 0 for g in self._groups[role]]

    def touch(self, rt: RankRuntime) -> None:
        """`rt` handled an event or got a room: its instance's load may have moved."""
        self._dirty.add(rt)

    def route(self, request: Request | None = None) -> tuple[int, int]:
        """(prefill instance, decode instance) for the request arriving now."""
        for rt in self._dirty:
            i = rt.instance
            load = self._loads[rt.role][i] = _load(self._groups[rt.role][i])
            self._keys[rt.role][i] = self._router.key(rt.role, load)
        self._dirty.clear()
        prefill = self._keys["prefill"]
        if self._router.policy == "cache-aware" and request is not None and request.hash_ids:
            # what each instance's cache holds of this request: read at every arrival
            prefill = [
                self._router.key("prefill", replace(load, cached_blocks=_cached(g, request)))
                for g, load in zip(self._groups["prefill"], self._loads["prefill"], strict=True)
            ]
        decode = self._keys["decode"]
        if self.closed["prefill"] or self.closed["decode"]:
            prefill, decode = (
                _open(prefill, self.closed["prefill"]),
                _open(decode, self.closed["decode"]),
            )
        return least(prefill), least(decode)


CLOSED = (math.inf,)  # a key above every instance's: a closed instance is never least


def _open(keys: list, closed: set[int]) -> list:
    """`keys` with the closed instances' keys raised above every open one's."""
    return [CLOSED if i in closed else k for i, k in enumerate(keys)]


def _cached(group: Sequence[RankRuntime], request: Request) -> int:
    """Leading blocks of the request in the prefix cache of an instance (its ranks keep
    the same cache: the first one's)."""
    cache = group[0].prefix_cache
    return cache.match(request.hash_ids) if cache is not None else 0
