"""Where SLURM puts each rank: prefill and decode on separate nodes.

SLURM's default block distribution fills the job's first node, then the next, in
task order; ranks are numbered prefill first (`placement.role_of`), so P4 + D2 on
two nodes of three tasks puts one prefill rank beside both decode ranks, and one
writer in four never crosses a NIC. `scripts/kvstage.sbatch` with PLACEMENT=split
(its default on more than one node) instead writes a SLURM_HOSTFILE from
`split_hosts` and starts the ranks with `srun --distribution=arbitrary`: the prefill
ranks fill nodes from the first, and the decode ranks start on the node after the
last prefill one, so every KV byte crosses the network, as between a prefill and a
decode instance in a PD deployment.

    python -m kvstage.hw.launch.hostfile RUN_DIR/scenario.toml > hostfile

reads the job's nodes (`scontrol show hostnames $SLURM_JOB_NODELIST`) and task slots
per node ($SLURM_NTASKS_PER_NODE, else the first count of $SLURM_TASKS_PER_NODE) and
prints one host per rank; a job with too few nodes is one line on stderr, exit 2.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Mapping

from kvstage.hw.transport.placement import PlacementError
from kvstage.shared.serving.capacity import scenario_gpus

__all__ = ["split_hosts", "slots_per_node", "main"]


def split_hosts(nodes: list[str], slots: int, prefill: int, decode: int) -> list[str]:
    """The host of each global rank (prefill 0..P-1, then decode): the prefill ranks
    fill `slots` per node from the first node, the decode ranks from the next node on."""
    if slots < 1 or prefill < 1 or decode < 1:
        raise PlacementError(
            f"split placement needs at least one task slot per node and one rank per role "
            f"(slots {slots}, prefill {prefill}, decode {decode})"
        )
    p_nodes, d_nodes = -(-prefill // slots), -(-decode // slots)
    if p_nodes + d_nodes > len(nodes):
        raise PlacementError(
            f"PLACEMENT=split needs {p_nodes + d_nodes} nodes of {slots} task slots (prefill "
            f"{prefill} ranks on {p_nodes}, decode {decode} on {d_nodes}), the job has "
            f"{len(nodes)}; allowed: sbatch -N {p_nodes + d_nodes}, more --ntasks-per-node, or "
            f"PLACEMENT=packed (SLURM's block order, roles may share a node)"
        )
    hosts = [nodes[i // slots] for i in range(prefill)]
    return hosts + [nodes[p_nodes + i // slots] for i in range(decode)]


def slots_per_node(env: Mapping[str, str]) -> int:
    """Task slots per node of this job, from SLURM's variables."""
    text = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "")
    m = re.match(r"\s*(\d+)", text)
    if not m:
        raise PlacementError(
            "neither $SLURM_NTASKS_PER_NODE nor $SLURM_TASKS_PER_NODE gives the tasks per node: "
            "submit with --ntasks-per-node"
        )
    return int(m.group(1))


def _job_nodes(env: Mapping[str, str]) -> list[str]:
    nodelist = env.get("SLURM_JOB_NODELIST", "")
    if not nodelist:
        raise PlacementError("$SLURM_JOB_NODELIST is not set: not inside a SLURM job")
    done = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise PlacementError(f"scontrol show hostnames {nodelist}: {done.stderr.strip()}")
    return done.stdout.split()


def main(argv: list[str] | None = None) -> int:
    from kvstage.shared.scenario import ScenarioError, load_scenario

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m kvstage.hw.launch.hostfile SCENARIO.toml", file=sys.stderr)
        return 2
    try:
        s = load_scenario(args[0])
        hosts = split_hosts(_job_nodes(os.environ), slots_per_node(os.environ), *scenario_gpus(s))
    except (PlacementError, ScenarioError, OSError) as e:
        print(f"kvstage.sbatch: {e}", file=sys.stderr)
        return 2
    print("\n".join(hosts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
