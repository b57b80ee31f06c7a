"""Simulating a cluster as independent groups of instances (`[cluster] shard`).

With round-robin routing every room's route is fixed before the run. Two instances
affect each other only through a room routed between them (its messages, its writes
into the decode instance's ring) or through a NIC they share (instances packed onto one
node's rails). Group the instances by those two relations (union-find) and each group
is a closed world: no event of one ever reaches another. Each group then runs as its
own `Simulation` over its own ranks and rooms (sim/driver.py `shard=`), and the results
are merged: records in time order, counts summed, the latest end.

Why: one simulation of the whole cluster touches every instance's state in turn, so
each event costs more as the cluster grows (CPU caches: benchmarks/cluster_speed.py),
while a group is as small as a few instances whatever the cluster's size. The latencies
are the same (tests/test_shard.py); records of different groups at the same instant
may come in another order than in one simulation.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from operator import attrgetter

import simpy

from kvstage.shared.cluster import Sessions, cluster_sessions, shard_problem
from kvstage.shared.runtime import merge_failures
from kvstage.shared.scenario import Scenario
from kvstage.shared.workload import generate_requests
from kvstage.sim.cluster import cluster_nics
from kvstage.sim.driver import SimResult, Simulation, gc_paused
from kvstage.sim.links import Fabric

__all__ = ["Group", "independent_groups", "simulate_scenario", "simulate_sharded"]

Group = tuple[frozenset[int], frozenset[int]]  # (prefill instances, decode instances)


def independent_groups(scenario: Scenario) -> list[Group]:
    """The scenario's instances in groups that share no room and no NIC, in order of
    their first prefill instance."""
    _require_shardable(scenario)
    return _groups(scenario, cluster_sessions(scenario, generate_requests(scenario))[0])


def _require_shardable(scenario: Scenario) -> None:
    problem = shard_problem(scenario)
    if problem:
        raise ValueError(f"cannot shard the cluster: {problem}")


def _groups(scenario: Scenario, ss: Sessions) -> list[Group]:
    parent: dict[tuple[str, int], tuple[str, int]] = {}

    def find(x: tuple[str, int]) -> tuple[str, int]:
        root = x
        while parent.setdefault(root, root) != root:
            root = parent[root]
        while parent[x] != root:  # path compression
            parent[x], x = root, parent[x]
        return root

    def union(a: tuple[str, int], b: tuple[str, int]) -> None:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)

    for i in range(ss.prefill_instances):
        find(("prefill", i))
    for j in range(ss.decode_instances):
        find(("decode", j))
    for route in set(ss.routes.values()):
        union(("prefill", route[0]), ("decode", route[1]))
    if not ss.single:  # one instance each: one group anyway
        prefill_nics, decode_nics = cluster_nics(
            Fabric(simpy.Environment()), scenario, ss, scenario.links.resolved()
        )
        for side, nics, tp in (
            ("prefill", prefill_nics, ss.prefill_tp),
            ("decode", decode_nics, ss.decode_tp),
        ):
            first: dict[int, int] = {}  # NIC -> the first instance seen on it
            for rank, nic in enumerate(nics):
                inst = rank // tp
                union((side, first.setdefault(id(nic), inst)), (side, inst))
    groups: dict[tuple[str, int], tuple[set[int], set[int]]] = {}
    for node in list(parent):
        p, d = groups.setdefault(find(node), (set(), set()))
        (p if node[0] == "prefill" else d).add(node[1])
    out = [(frozenset(p), frozenset(d)) for p, d in groups.values()]
    return sorted(out, key=lambda g: (min(g[0], default=1 << 30), min(g[1], default=1 << 30)))


def simulate_scenario(
    scenario: Scenario,
    *,
    check: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> SimResult:
    """The scenario's simulation: in independent groups where `[cluster] shard` asks
    for it, else as one."""
    if scenario.cluster.shard:
        return simulate_sharded(scenario, check=check, progress=progress)
    return Simulation(scenario, check=check, progress=progress).run()


def simulate_sharded(
    scenario: Scenario,
    *,
    check: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> SimResult:
    """Simulate each independent group on its own and merge the results (one group:
    the plain simulation)."""
    _require_shardable(scenario)
    requests = generate_requests(scenario)
    sessions, router = cluster_sessions(scenario, requests)
    groups = _groups(scenario, sessions)
    if len(groups) == 1:
        return Simulation(
            scenario, check=check, progress=progress, workload=(requests, sessions, router)
        ).run()
    wall = time.perf_counter()
    # each group's rooms, in order (a room's route stays inside its group)
    group_of = {i: k for k, (prefill, _) in enumerate(groups) for i in prefill}
    rooms: list[list] = [[] for _ in groups]
    for req in requests:
        rooms[group_of[sessions.route(req.room)[0]]].append(req)
    ended_before = 0
    results: list[SimResult] = []
    # the earlier groups' records stay alive: a collection between groups would walk them all
    with gc_paused():
        for group, mine in zip(groups, rooms, strict=True):
            if not mine:
                continue  # instances no room was routed to: nothing happens there

            def report(done: int, _n: int, base: int = ended_before) -> None:
                if progress is not None:
                    progress(base + done, len(requests))

            results.append(
                Simulation(
                    scenario,
                    check=check,
                    progress=report,
                    shard=group,
                    workload=(mine, sessions, router),
                ).run()
            )
            ended_before += results[-1].rooms_done + results[-1].rooms_failed
    return merge_results(scenario, requests, results, time.perf_counter() - wall)


def merge_results(
    scenario: Scenario, requests: list, results: list[SimResult], wall_s: float
) -> SimResult:
    """One result from the groups' results: records merged in time order (each group's
    are in the order it emitted them), the ranks in global order, counts summed."""
    ranks = sorted(
        (rank for r in results for rank in r.ranks), key=lambda x: (x.role != "prefill", x.rank)
    )
    return SimResult(
        scenario=scenario,
        requests=requests,
        # each group's records are in time order: a stable sort on the end merges them
        records=sorted((rec for r in results for rec in r.records), key=attrgetter("end")),
        violations=[v for r in results for v in r.violations],
        events=sum(r.events for r in results),
        sim_time_s=max(r.sim_time_s for r in results),
        wall_s=wall_s,
        rooms_done=sum(r.rooms_done for r in results),
        rooms_failed=sum(r.rooms_failed for r in results),
        failures=merge_failures(ranks),
        ranks=ranks,
        rejected=dict(sorted(room for r in results for room in r.rejected.items())),
    )
