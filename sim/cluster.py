"""The cluster's hardware in simulated time: which NIC each rank sends through, and
what a load-aware router sees of every instance.

Instances are packed onto nodes in order of their global ranks (shared/cluster.py):
prefill instances first, then decode instances on nodes of their own. A node's NICs
are rail-aligned: GPU slot i uses NIC i * nics // gpus_per_node, so every rank on
that rail, of whichever instance, shares that NIC through the fair fabric.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstage.shared.cluster import InstanceLoad, Sessions
from kvstage.shared.runtime import RankRuntime
from kvstage.shared.scenario import Scenario
from kvstage.shared.scenario.profiles import ResolvedLinks
from kvstage.sim.links import Fabric

__all__ = ["cluster_nics", "instance_loads"]


def cluster_nics(fabric: Fabric, scenario: Scenario, sessions: Sessions, links: ResolvedLinks) -> tuple[list, list]:
    """The NIC of every global prefill rank and every global decode rank."""
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
            made[key] = fabric.add_nic(f"{side}-node{key[1]}-{'gpu' if links.placement == 'intra' else 'nic'}{key[2]}", bw)
        return made[key]

    return ([nic("prefill", p) for p in range(sessions.prefill_ranks)],
            [nic("decode", d) for d in range(sessions.decode_ranks)])


def instance_loads(runtimes: Sequence[RankRuntime], tp: int) -> list[InstanceLoad]:
    """What a router sees of each instance (its ranks are runtimes[i*tp:(i+1)*tp])."""
    loads = []
    for i in range(0, len(runtimes), tp):
        group = [rt for rt in runtimes[i:i + tp] if rt is not None]  # folded ranks are None
        ring = [rt.machine.ring.size - rt.machine.ring.used_bytes for rt in group if hasattr(rt.machine, "ring")]
        loads.append(InstanceLoad(
            outstanding=group[0].outstanding,
            free_ring_bytes=min(ring) if ring else 0,
            free_kv_pages=min(rt.free_kv_pages for rt in group),
        ))
    return loads
