#!/usr/bin/env bash
# One rank of a kvstage hardware run, as one SLURM task (started by scripts/kvstage.sbatch
# through srun; tests/test_sbatch.py starts it with SLURM's variables set by hand).
#
# Identity: `kvstage hw-rank` without --role/--rank reads SLURM_PROCID, SLURM_NTASKS and
# SLURM_LOCALID (hw/transport/placement.py); the rendezvous is MASTER_ADDR:MASTER_PORT; the run's
# secret and resolved scenario are RUN_DIR/run.secret and RUN_DIR/scenario.toml, written
# by the launcher (`kvstage hw --no-spawn`). Needs RUN_DIR, MASTER_ADDR, MASTER_PORT;
# KVSTAGE (default .venv/bin/kvstage) and DEVICE (cuda or cpu) are optional.
set -euo pipefail
: "${RUN_DIR:?set RUN_DIR: the --out of kvstage hw}" "${MASTER_ADDR:?}" "${MASTER_PORT:?}" "${SLURM_PROCID:?}"
KVSTAGE=${KVSTAGE:-.venv/bin/kvstage}
# The launcher wrote both files before srun started, but another node may see them late
# (NFS attribute caches): wait, bounded.
for _ in $(seq "$((${WAIT_S:-60} * 10))"); do
    [[ -s $RUN_DIR/run.secret && -s $RUN_DIR/scenario.toml ]] && break
    sleep 0.1
done
if [[ ! -s $RUN_DIR/run.secret || ! -s $RUN_DIR/scenario.toml ]]; then
    echo "task $SLURM_PROCID on $(hostname): no $RUN_DIR/run.secret and scenario.toml: is RUN_DIR on a shared file system?" >&2
    exit 2
fi
# "cuda" means this task's GPU: cuda:SLURM_LOCALID where the task sees every GPU of its
# node, cuda:0 where SLURM binds one GPU to each task (hw/transport/placement.py rank_device reads
# CUDA_VISIBLE_DEVICES).
args=()
[[ -n ${DEVICE:-} ]] && args+=(--device "$DEVICE")
exec "$KVSTAGE" hw-rank "$RUN_DIR/scenario.toml" --secret-file "$RUN_DIR/run.secret" "${args[@]}"
