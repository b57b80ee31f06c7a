"""Rank numbering across instances, and which instances serve each room.

A cluster has N prefill instances of TP P and M decode instances of TP D. Every
rank has a *global* index, `instance * TP + local rank`: that is the number messages,
trace rows and drivers use, so a decode rank tells the sessions of different prefill
instances apart (prefill rank 0 of instance 1 is session P), and a prefill rank tells
the rings of different decode instances apart. The geometry (head slices, writer
blocks, fan-in) is per instance pair and takes *local* ranks.

With one instance each, global == local and every room is served by instance 0 of
each side: the one-to-one case, unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstage.shared.layout import Geometry

if TYPE_CHECKING:
    from kvstage.shared.scenario import Scenario
    from kvstage.shared.workload import Request

__all__ = [
    "ROUTERS",
    "InstanceLoad",
    "Router",
    "Sessions",
    "cluster_sessions",
    "fold_problem",
    "hardware_sessions",
    "least",
    "shard_problem",
]

# the routing policies `cluster.router` names (shared/scenario/cluster_table.py)
ROUTERS = ("round-robin", "least-outstanding", "staging-aware", "cache-aware")


class Sessions:
    """Global rank numbering and the route (prefill instance, decode instance) of each
    room. Rooms without a route are served by instance 0 of each side."""

    def __init__(
        self, geometry: Geometry, prefill_instances: int = 1, decode_instances: int = 1
    ) -> None:
        if prefill_instances < 1 or decode_instances < 1:
            raise ValueError(
                f"instances must be >= 1, got {prefill_instances} prefill, {decode_instances} decode"
            )
        self.geometry = geometry
        self.prefill_instances = prefill_instances
        self.decode_instances = decode_instances
        # ranks of one prefill instance: its TP group in each pipeline stage
        self.prefill_tp = geometry.prefill_ranks
        self.decode_tp = geometry.decode_tp
        self.routes: dict[int, tuple[int, int]] = {}
        self._writers: dict[tuple[int, int], list[int]] = {}
        self._targets: dict[tuple[int, int], list[int]] = {}

    @property
    def single(self) -> bool:
        return self.prefill_instances == 1 and self.decode_instances == 1

    @property
    def prefill_ranks(self) -> int:
        return self.prefill_instances * self.prefill_tp

    @property
    def decode_ranks(self) -> int:
        return self.decode_instances * self.decode_tp

    def ranks(self, role: str) -> int:
        return self.prefill_ranks if role == "prefill" else self.decode_ranks

    def tp(self, role: str) -> int:
        return self.prefill_tp if role == "prefill" else self.decode_tp

    def instance(self, role: str, rank: int) -> int:
        return rank // self.tp(role)

    def local(self, role: str, rank: int) -> int:
        return rank % self.tp(role)

    def route(self, room: int) -> tuple[int, int]:
        return self.routes.get(room, (0, 0))

    def serves(self, role: str, rank: int, room: int) -> bool:
        """Whether the instance of this rank serves the room."""
        return self.route(room)[0 if role == "prefill" else 1] == self.instance(role, rank)

    def writers(self, room: int, decode_rank: int) -> list[int]:
        """The global prefill ranks that write the room into this (global) decode rank."""
        key = (self.route(room)[0], decode_rank)
        w = self._writers.get(key)
        if w is None:
            w = _shift(
                self._writers,
                key,
                self.prefill_tp,
                self.geometry.writers(decode_rank % self.decode_tp),
            )
        return w

    def targets(self, room: int, prefill_rank: int) -> list[int]:
        """The global decode ranks this (global) prefill rank writes the room into."""
        key = (self.route(room)[1], prefill_rank)
        t = self._targets.get(key)
        if t is None:
            t = _shift(
                self._targets,
                key,
                self.decode_tp,
                self.geometry.targets(prefill_rank % self.prefill_tp),
            )
        return t

    def all_writers(self, decode_rank: int) -> list[int]:
        """Every session that may write into this decode rank: its writers in every
        prefill instance."""
        local = self.geometry.writers(decode_rank % self.decode_tp)
        return [i * self.prefill_tp + p for i in range(self.prefill_instances) for p in local]

    def peers(self, role: str, rank: int) -> list[tuple[str, int]]:
        """The ranks a rank exchanges messages and bytes with, (role, rank): a prefill
        rank's decode targets, a decode rank's writers (over every instance)."""
        if role == "prefill":
            return [("decode", d) for d in self.all_targets(rank)]
        return [("prefill", p) for p in self.all_writers(rank)]

    def all_targets(self, prefill_rank: int) -> list[int]:
        """Every decode rank this prefill rank may write into, over all decode instances."""
        local = self.geometry.targets(prefill_rank % self.prefill_tp)
        return [i * self.decode_tp + d for i in range(self.decode_instances) for d in local]


def _shift(cache: dict, key: tuple[int, int], tp: int, local: list[int]) -> list[int]:
    """Local ranks of instance key[0] as global ranks, remembered under key (hot path)."""
    out = cache[key] = [key[0] * tp + r for r in local]
    return out


@dataclass(frozen=True, slots=True)
class InstanceLoad:
    """What a router sees of one instance when a request arrives."""

    outstanding: int  # rooms routed to it that have not ended there
    free_ring_bytes: int = 0  # decode: the least free staging ring over its ranks
    free_kv_pages: int = 0  # decode: the least free KV pages over its ranks
    # prefill, cache-aware: leading blocks of the arriving request in its prefix cache
    cached_blocks: int = 0


class Router:
    """Assigns each request a (prefill instance, decode instance).

    round-robin depends only on the request's position, so it is decided before the
    run (every rank of a hardware run computes the same routes); the other policies
    look at the instances' load when the request arrives (simulation)."""

    def __init__(self, policy: str, prefill_instances: int, decode_instances: int) -> None:
        if policy not in ROUTERS:
            raise ValueError(f"router {policy!r} not allowed (allowed: {', '.join(ROUTERS)})")
        self.policy = policy
        self.prefill_instances = prefill_instances
        self.decode_instances = decode_instances

    @property
    def static(self) -> bool:
        return self.policy == "round-robin" or (
            self.prefill_instances == 1 and self.decode_instances == 1
        )

    def static_route(self, index: int) -> tuple[int, int]:
        return index % self.prefill_instances, index % self.decode_instances

    def route(
        self, index: int, prefill: Sequence[InstanceLoad], decode: Sequence[InstanceLoad]
    ) -> tuple[int, int]:
        if self.static:
            return self.static_route(index)
        return least([self.key("prefill", x) for x in prefill]), least(
            [self.key("decode", x) for x in decode]
        )

    def key(self, role: str, load: InstanceLoad) -> tuple[int, ...]:
        """How a load-aware policy ranks an instance: the least key wins."""
        if role == "decode" and self.policy == "staging-aware":
            return -min(load.free_ring_bytes, 1 << 62), -load.free_kv_pages, load.outstanding
        if role == "prefill" and self.policy == "cache-aware":
            return -load.cached_blocks, load.outstanding
        return (load.outstanding,)


def least(keys: Sequence[tuple[int, ...]]) -> int:
    """The index of the smallest key; ties go to the lowest index (deterministic)."""
    return min(range(len(keys)), key=keys.__getitem__)  # min keeps the first of equals


def pipeline_problem(scenario: Scenario) -> str | None:
    """Why hardware mode cannot run this scenario's prefill pipeline stages
    (`prefill.pp` > 1), or None. Each stage's TP ranks hold and send only their layers'
    KV: the layout, the Sessions and the rank runtime map that (shared/layout.py
    `Geometry.prefill_pp`), and the simulator runs it (sim/forward.py
    `PipelineForward`), but hardware mode's KV pools, kernels and launch know ranks
    that hold every layer."""
    pp = scenario.prefill.pp
    if pp == 1:
        return None
    return (
        f"prefill.pp = {pp}: each pipeline stage's TP ranks send only their own layers' KV; "
        "the simulator runs that (kvstage sim), hardware mode's KV pools and kernels do not "
        "yet; allowed: prefill.pp = 1"
    )


def simulated_pipeline_problem(scenario: Scenario) -> str | None:
    """Why the simulator cannot run this scenario's prefill pipeline stages, or None:
    its GPU model runs them (sim/forward.py `PipelineForward`); the cpu-loop host model
    and an [engine]'s scheduler loops do not."""
    pp = scenario.prefill.pp
    if pp == 1:
        return None
    if scenario.links.resolved().host is not None:
        why = "the cpu-loop host model (links.host) fills each rank's KV on its own loop"
    elif scenario.engine.resolved():
        why = "an [engine]'s scheduler loops (sim/engine_host.py) run one TP group"
    else:
        return None
    return f"prefill.pp = {pp}: {why}, not pipeline stages; allowed: prefill.pp = 1 here"


def cluster_sessions(scenario: Scenario, requests: Sequence[Request]) -> tuple[Sessions, Router]:
    """The scenario's Sessions, with every route already decided when the router is static."""
    c = scenario.cluster
    sessions = Sessions(scenario.geometry(), c.prefill_instances, c.decode_instances)
    router = Router(c.router, c.prefill_instances, c.decode_instances)
    if router.static and not sessions.single:
        for i, req in enumerate(requests):
            sessions.routes[req.room] = router.static_route(i)
    return sessions, router


def hardware_sessions(scenario: Scenario, requests: Sequence[Request]) -> tuple[Sessions, Router]:
    """Sessions for a hardware run, where every rank must compute the same routes on its
    own: only a static router (round-robin) can do that."""
    problem = pipeline_problem(scenario)
    if problem:
        raise ValueError(problem)
    sessions, router = cluster_sessions(scenario, requests)
    if not router.static:
        raise ValueError(
            f"cluster.router = '{router.policy}' decides from the instances' load as requests arrive, "
            'which only the simulator sees; hardware mode routes "round-robin" (set cluster.router)'
        )
    return sessions, router


def shard_problem(scenario: Scenario) -> str | None:
    """Why this scenario's instances cannot be simulated in independent groups, or None."""
    c = scenario.cluster
    if c.router != "round-robin" and not c.single:
        return (
            f"router {c.router!r} routes each request by every instance's load, so no instance is "
            "independent of the others (allowed: round-robin)"
        )
    if scenario.links.resolved().host is not None:
        return "the cpu-loop host model shares one host's CPU between every rank"
    if scenario.prefill.pp > 1:
        return "the prefill's pipeline stages are simulated as one group (prefill.pp > 1)"
    return None


def fold_problem(scenario: Scenario) -> str | None:
    """Why this scenario's ranks cannot be folded, or None."""
    f = scenario.faults
    if (
        f.drop
        or f.duplicate
        or f.delay
        or f.match
        or f.abort
        or f.stall_scatter
        or f.late_scatter
        or f.late_session
        or f.kill
    ):
        return "[faults] act on single ranks or messages, so the ranks are no longer alike"
    if scenario.links.resolved().host is not None:
        return "the cpu-loop host model shares one host's CPU between every rank"
    if scenario.prefill.pp > 1:
        return "the prefill's pipeline stages hold different layers (prefill.pp > 1)"
    g = scenario.geometry()
    if any(not g.targets(p) for p in range(g.prefill_tp)):
        return (
            "some prefill ranks write to no decode rank (MLA with more prefill than decode ranks)"
        )
    return None
