"""Folding the symmetric ranks of a TP group into one simulated rank (`[cluster] fold`).

In a fault-free run every prefill rank of an instance does the same thing at the same
time: the group computes each chunk together, and every rank gathers and writes
equally sized blocks to its decode ranks at once. So only a representative is
simulated: local prefill rank 0 of each instance, and the decode ranks it writes to.
What the other ranks would have done reaches the simulated ones anyway:

- messages: a representative's message to a decode rank is also delivered as sent by
  each other writer of that room at that decode rank (same room and chunk, its own
  prefill rank, writer index and the nonce the decode handed it), so fan-in counts
  every writer as before;
- the fabric: every other prefill rank's write is started as a flow through its own
  NICs at the representative's moment, so the NICs they share see the same traffic
  (only its completion has nobody to tell);
- messages to ranks that are not simulated are not delivered.

Gathers and scatters of the other ranks run on their own GPUs and touch nothing the
simulated ranks share, so they are left out. Every room's latencies are those of the
unfolded run, and the simulated ranks write the same rows, except that messages of
one instant may be handled in another order, so a row's snapshot of ring occupancy
can differ (tests/test_fold.py); totals summed over rows (payload bytes, transfer
requests) count only the simulated ranks. Refused where ranks are not symmetric: faults aimed at ranks, the
cpu-loop host model (ranks share the host's CPU), MLA with more prefill than decode
ranks (some prefill ranks write nothing).
"""

from __future__ import annotations

from dataclasses import fields
from functools import cache
from typing import TYPE_CHECKING

from kvstage.shared.cluster import fold_problem

if TYPE_CHECKING:
    from kvstage.shared.events import SliceWrite, Write
    from kvstage.shared.runtime import RankRuntime
    from kvstage.sim.driver import Simulation

__all__ = ["Fold", "fold_problem"]  # fold_problem: shared/cluster.py


@cache
def _fields(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


class Fold:
    """Which ranks are simulated, and what the others would have sent and written."""

    def __init__(self, sim: Simulation) -> None:
        g, ss = sim.geometry, sim.sessions
        self.sim = sim
        self.tp = g.prefill_tp
        self.prefill = {i * g.prefill_tp for i in range(ss.prefill_instances)}
        self.decode = {
            j * g.decode_tp + d for j in range(ss.decode_instances) for d in g.targets(0)
        }
        self._link = sim.scenario.links.resolved().link

    def simulated(self, role: str, rank: int) -> bool:
        return rank in (self.prefill if role == "prefill" else self.decode)

    def mirrors(self, msg, decode_rank: int) -> list:
        """The same message as every other writer of its room at `decode_rank` sends it."""
        writers = self.sim.sessions.writers(msg.room, decode_rank)
        if len(writers) == 1:
            return []
        cls = type(msg)
        slots = _fields(cls)
        values = [getattr(msg, f) for f in slots]
        at_rank, at_writer, at_nonce = (
            slots.index("prefill_rank"),
            slots.index("writer") if "writer" in slots else -1,
            slots.index("nonce") if "nonce" in slots else -1,
        )
        decode = self.sim.decode[decode_rank].machine if at_nonce >= 0 else None
        chunk = getattr(msg, "chunk", -1)
        out = []
        for w, p in enumerate(writers):
            if p != msg.prefill_rank:  # (dataclasses.replace is slow on this hot path)
                values[at_rank] = p
                if at_writer >= 0:
                    values[at_writer] = w
                if decode is not None:  # the nonce the decode handed that writer
                    values[at_nonce] = decode.nonce_for(cls, msg.room, chunk, p)
                out.append(cls(*values))
        return out

    def ghost_writes(self, rt: RankRuntime, a: Write | SliceWrite, requests: int) -> None:
        """The other prefill ranks of the instance write their blocks now, through their NICs."""
        sim, ss = self.sim, self.sim.sessions
        j = ss.targets(a.room, rt.rank).index(a.decode_rank)
        for p in range(rt.rank + 1, rt.rank + self.tp):
            d = ss.targets(a.room, p)[j]
            sim.fabric.transfer(
                sim.prefill_nic[p], sim.decode_nic[d], a.nbytes, self._link, requests, poster=p
            )
