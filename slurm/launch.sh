#!/usr/bin/env bash
# Run pretrain_iiet.py on every task of the current SLURM allocation: one task = one rank.
#
#   usage (inside sbatch/salloc): bash slurm/launch.sh --config CONFIG.yaml [--set key=value ...]
#
# Sets MASTER_ADDR to the first node of SLURM_JOB_NODELIST (scontrol show hostnames) and
# MASTER_PORT (default 20000 + job id mod 20000, so jobs sharing a node do not collide), then
# `srun` starts one python per task. Each task exports RANK/WORLD_SIZE/LOCAL_RANK from
# SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID (megatron_iiet.distributed.initialize would read the
# SLURM names too; the exports keep torch and the entry point's "rank 0 prints" consistent).
# Ask for the processes with the allocation: --nodes, --ntasks-per-node = GPUs per node (or 1-2
# on CPU), --cpus-per-task. Environment: IIET_PYTHON (default REPO/.venv/bin/python),
# MASTER_PORT, OMP_NUM_THREADS (default SLURM_CPUS_PER_TASK), IIET_SRUN_ARGS (extra srun options).
# Returns srun's exit status (0 also after a preemption signal: the trainer saved and stopped).
set -euo pipefail

if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0
fi
if [ -z "${SLURM_JOB_ID:-}" ] || [ -z "${SLURM_JOB_NODELIST:-}" ]; then
  echo "error: not inside a SLURM allocation (run it from sbatch or salloc; see --help)" >&2
  exit 2
fi
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${IIET_PYTHON:-$REPO/.venv/bin/python}
[ -x "$PY" ] || { echo "error: python $PY not found (set IIET_PYTHON)" >&2; exit 2; }

MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR
export MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
ntasks=${SLURM_NTASKS:-$(( ${SLURM_JOB_NUM_NODES:-1} * ${SLURM_NTASKS_PER_NODE:-1} ))}
echo "launch: job $SLURM_JOB_ID, $ntasks tasks on ${SLURM_JOB_NUM_NODES:-1} node(s)" \
     "($SLURM_JOB_NODELIST), MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT" \
     "restart ${SLURM_RESTART_COUNT:-0}"

cd "$REPO"
# --kill-on-bad-exit: one failed rank ends the step instead of leaving the others waiting.
# shellcheck disable=SC2086
exec srun --kill-on-bad-exit=1 --ntasks="$ntasks" ${IIET_SRUN_ARGS:-} bash -c '
  export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID
  echo "launch: rank $RANK/$WORLD_SIZE (local $LOCAL_RANK) on node ${SLURMD_NODENAME:-$(hostname)}"
  exec "$0" pretrain_iiet.py "$@"' "$PY" "$@"
