"""SLURM placement: prefill and decode ranks on separate nodes (hw/launch/hostfile.py), and the
batch script's PLACEMENT switch, without SLURM (fake scontrol and srun on PATH)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvstage.hw.launch.hostfile import slots_per_node, split_hosts
from kvstage.hw.transport.placement import PlacementError, role_of

ROOT = Path(__file__).resolve().parent.parent


def test_prefill_and_decode_never_share_a_node():
    nodes = ["n1", "n2", "n3", "n4"]
    for slots, P, D in [(4, 4, 2), (3, 4, 2), (8, 2, 8), (2, 4, 2), (4, 1, 1)]:
        hosts = split_hosts(nodes, slots, P, D)
        assert len(hosts) == P + D
        prefill = {h for g, h in enumerate(hosts) if role_of(g, P, D)[0] == "prefill"}
        decode = {h for g, h in enumerate(hosts) if role_of(g, P, D)[0] == "decode"}
        assert not prefill & decode, (slots, P, D, hosts)
        assert all(hosts.count(h) <= slots for h in hosts), (slots, P, D, hosts)
    # the case the default block order got wrong: P4 + D2 on nodes of 3
    assert split_hosts(nodes, 3, 4, 2) == ["n1", "n1", "n1", "n2", "n3", "n3"]


def test_too_few_nodes_says_how_many():
    with pytest.raises(PlacementError, match=r"needs 3 nodes of 3 task slots.*the job has 2"):
        split_hosts(["n1", "n2"], 3, 4, 2)
    assert slots_per_node({"SLURM_TASKS_PER_NODE": "4(x2)"}) == 4
    assert slots_per_node({"SLURM_NTASKS_PER_NODE": "3", "SLURM_TASKS_PER_NODE": "9"}) == 3
    with pytest.raises(PlacementError, match="--ntasks-per-node"):
        slots_per_node({})


# scontrol: the job's nodes; srun: records its options and the hostfile, starts nothing
FAKE_SCONTROL = (
    '#!/usr/bin/env bash\n[[ "$1 $2" == "show hostnames" ]] || exit 1\n'
    'printf "%s\\n" nodeA nodeB nodeC | head -n "$SLURM_JOB_NUM_NODES"\n'
)
FAKE_SRUN = (
    '#!/usr/bin/env bash\necho "$*" >"$FAKE_OUT/srun.args"\n'
    'cp "${SLURM_HOSTFILE:-/dev/null}" "$FAKE_OUT/hostfile.seen"\nexit 0\n'
)
# the launcher: writes what the real one writes before ranks start, then waits a little
FAKE_KVSTAGE = """#!/usr/bin/env bash
out=""; while [[ $# -gt 0 ]]; do [[ $1 == --out ]] && out=$2; shift; done
mkdir -p "$out"; cp "$SCENARIO" "$out/scenario.toml"; echo s >"$out/run.secret"; sleep 0.5
"""


def _job(tmp_path: Path, nodes: int, slots: int, **extra: str) -> subprocess.CompletedProcess:
    fake = tmp_path / "bin"
    fake.mkdir()
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        (fake / name).write_text(text)
        (fake / name).chmod(0o755)
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / "kvstage").write_text(FAKE_KVSTAGE)
    (venv / "kvstage").chmod(0o755)
    (venv / "python").symlink_to(Path(sys.executable))
    env = {
        "PATH": f"{fake}:/usr/bin:/bin",
        "FAKE_OUT": str(tmp_path),
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NUM_NODES": str(nodes),
        "SLURM_JOB_NODELIST": "node[A-C]",
        "SLURM_NTASKS_PER_NODE": str(slots),
        "SLURM_NTASKS": str(nodes * slots),
        "SLURM_SUBMIT_DIR": str(ROOT),
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29999",
        "SCENARIO": str(ROOT / "scenarios" / "llama3-8b-p4-d2.toml"),
        "RUN_DIR": str(tmp_path / "run"),
        "KVSTAGE": str(venv / "kvstage"),
        **extra,
    }
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "kvstage.sbatch")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_sbatch_splits_the_roles_by_default(tmp_path):
    done = _job(tmp_path, nodes=2, slots=4)
    assert done.returncode == 0, done.stderr
    args = (tmp_path / "srun.args").read_text()
    assert "--distribution=arbitrary" in args and "--ntasks=6" in args
    hosts = (tmp_path / "hostfile.seen").read_text().split()
    assert hosts == ["nodeA"] * 4 + ["nodeB"] * 2  # prefill on node A, decode on node B


def test_sbatch_placement_refusals_are_one_line(tmp_path):
    (tmp_path / "a").mkdir()
    few = _job(tmp_path / "a", nodes=2, slots=3)
    assert few.returncode == 2 and not (tmp_path / "a" / "srun.args").exists()
    assert "needs 3 nodes" in few.stderr and len(few.stderr.strip().splitlines()) == 1
    (tmp_path / "b").mkdir()
    bad = _job(tmp_path / "b", nodes=2, slots=4, PLACEMENT="spread")
    assert bad.returncode == 2 and "allowed: split, packed" in bad.stderr
    (tmp_path / "c").mkdir()
    packed = _job(tmp_path / "c", nodes=2, slots=3, PLACEMENT="packed")
    assert packed.returncode == 0, packed.stderr
    assert "--distribution" not in (tmp_path / "c" / "srun.args").read_text()
