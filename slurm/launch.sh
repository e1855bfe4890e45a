#!/usr/bin/env bash
# Run one of the project's entry points on the current SLURM allocation: the launcher every
# slurm/*.sbatch script ends in.
#
#   usage (inside sbatch/salloc): bash slurm/launch.sh [options] ENTRY.py [ENTRY ARGS...]
#
#   ENTRY.py        pretrain_iiet.py or any tools/*.py, relative to the repository
#   --single        one process on the first node (conversion, HF evaluation, sweep tasks);
#                   default: one process per SLURM task (srun), each with RANK/WORLD_SIZE/LOCAL_RANK
#   --requeue       long jobs: on USR1 (--signal=B:USR1@...) or TERM, forward it to the processes
#                   (the trainer saves and exits 0), then `scontrol requeue` this job unless the
#                   --finished command says the work is done; the requeued job resumes
#   --finished CMD  with --requeue: a shell command that exits 0 when nothing is left to do
#   --no-health     skip the health check (every rank reaches the rendezvous and agrees on the
#                   world size, ~5 s) that runs before the entry
#   --dry-run       print the environment and the commands, run nothing (works outside SLURM)
#
# Rendezvous from the allocation: MASTER_ADDR = first node of SLURM_JOB_NODELIST, MASTER_PORT =
# 20000 + job id mod 20000 (jobs sharing a node do not collide; the health check uses the port
# after it). Processes per node: SLURM's tasks (--ntasks-per-node = GPUs per node, or 1-2 on
# CPU). On GPU nodes NCCL is used with asynchronous error handling (a hung collective ends the
# job instead of holding the allocation) and CUDA_DEVICE_MAX_CONNECTIONS=1; without GPUs gloo
# (set GLOO_SOCKET_IFNAME if the nodes' default interface cannot reach each other).
# Per-job folder: IIET_JOB_DIR (default IIET_JOBS_ROOT/NAME-JOBID, or NAME-ARRAYJOB_TASK for an
# array task; IIET_JOBS_ROOT defaults to REPO/runs/slurm) holds
# commands.sh (what ran), starts.log (one line per start, requeues included) and health.json.
# Environment: IIET_PYTHON (default REPO/.venv/bin/python), MASTER_PORT, OMP_NUM_THREADS
# (default SLURM_CPUS_PER_TASK), IIET_SRUN_ARGS (extra srun options), IIET_HEALTH_TIMEOUT (300 s).
# Exit status: the entry's (0 also after a preemption save: the job was requeued).
set -uo pipefail

usage() { sed -n '2,32p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
SINGLE=0 REQUEUE=0 HEALTH=1 DRY=0 FINISHED=""
while [ $# -gt 0 ]; do
  case "$1" in
    --single) SINGLE=1 ;;
    --requeue) REQUEUE=1 ;;
    --finished) FINISHED=${2:?--finished needs a command}; shift ;;
    --no-health) HEALTH=0 ;;
    --dry-run) DRY=1 ;;
    -h|--help) usage; exit 0 ;;
    --*) echo "error: launch.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) break ;;
  esac
  shift
done
[ $# -ge 1 ] || { echo "error: launch.sh: no entry point given (see --help)" >&2; exit 2; }
ENTRY=$1; shift
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
[ -f "$REPO/$ENTRY" ] || { echo "error: launch.sh: $REPO/$ENTRY does not exist" >&2; exit 2; }
PY=${IIET_PYTHON:-$REPO/.venv/bin/python}
if [ "$DRY" = 0 ]; then
  if [ -z "${SLURM_JOB_ID:-}" ] || [ -z "${SLURM_JOB_NODELIST:-}" ]; then
    echo "error: launch.sh: not inside a SLURM allocation (run it from sbatch or salloc, or add --dry-run)" >&2
    exit 2
  fi
  [ -x "$PY" ] || { echo "error: launch.sh: python $PY not found (set IIET_PYTHON)" >&2; exit 2; }
fi
JOB_ID=${SLURM_JOB_ID:-0}
NODELIST=${SLURM_JOB_NODELIST:-$(hostname -s)}

if [ -n "${SLURM_ARRAY_JOB_ID:-}" ]; then JOB_TAG=${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}; else JOB_TAG=$JOB_ID; fi
export IIET_JOB_DIR=${IIET_JOB_DIR:-${IIET_JOBS_ROOT:-$REPO/runs/slurm}/${SLURM_JOB_NAME:-job}-$JOB_TAG}
if command -v scontrol >/dev/null && [ -n "${SLURM_JOB_NODELIST:-}" ]; then
  MASTER_ADDR=$(scontrol show hostnames "$NODELIST" | head -n 1)
else
  MASTER_ADDR=$NODELIST
fi
export MASTER_ADDR
export MASTER_PORT=${MASTER_PORT:-$((20000 + JOB_ID % 20000))}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} HF_DATASETS_OFFLINE=${HF_DATASETS_OFFLINE:-1}
if [ "${SLURM_GPUS_ON_NODE:-0}" != 0 ] || { [ -n "${CUDA_VISIBLE_DEVICES:-}" ] && [ "${CUDA_VISIBLE_DEVICES}" != "-1" ]; }; then
  BACKEND=nccl
  export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
  export NCCL_DEBUG=${NCCL_DEBUG:-WARN} CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
else
  BACKEND=gloo
fi
NTASKS=${SLURM_NTASKS:-$(( ${SLURM_JOB_NUM_NODES:-1} * ${SLURM_NTASKS_PER_NODE:-1} ))}
[ "$SINGLE" = 1 ] && NTASKS=1

# The commands, as they will run (also the --dry-run output and IIET_JOB_DIR/commands.sh).
q() { printf '%q ' "$@"; }
# --kill-on-bad-exit: one failed rank ends the step instead of leaving the others waiting.
SRUN="srun --kill-on-bad-exit=1 --ntasks=$NTASKS ${IIET_SRUN_ARGS:-}"
RANK_ENV='export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID;'
HEALTH_CMD="$SRUN bash -c '$RANK_ENV exec \"\$0\" -m megatron_iiet.slurm health' $(q "$PY")"
if [ "$SINGLE" = 1 ]; then
  MAIN_CMD="$(q "$PY" "$ENTRY" "$@")"
else
  MAIN_CMD="$SRUN bash -c '$RANK_ENV echo \"launch: rank \$RANK/\$WORLD_SIZE (local \$LOCAL_RANK) on node \${SLURMD_NODENAME:-\$(hostname)}\"; exec \"\$0\" \"\$@\"' $(q "$PY" "$ENTRY" "$@")"
fi
summary="launch: job $JOB_TAG, $NTASKS task(s) on ${SLURM_JOB_NUM_NODES:-1} node(s) ($NODELIST), \
MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT backend=$BACKEND restart ${SLURM_RESTART_COUNT:-0}, \
job folder $IIET_JOB_DIR"
commands="cd $(q "$REPO")"
if [ "$HEALTH" = 1 ] && [ "$SINGLE" = 0 ]; then commands+=$'\n'"$HEALTH_CMD"; fi
commands+=$'\n'"$MAIN_CMD"
if [ "$DRY" = 1 ]; then
  echo "$summary"
  echo "$commands"
  exit 0
fi
echo "$summary"
mkdir -p "$IIET_JOB_DIR"
printf '#!/usr/bin/env bash\n# job %s, restart %s, %s\n%s\n' "$JOB_TAG" "${SLURM_RESTART_COUNT:-0}" \
  "$(date -Is)" "$commands" > "$IIET_JOB_DIR/commands.sh"
echo "$(date -Is) start restart=${SLURM_RESTART_COUNT:-0} nodes=$NODELIST tasks=$NTASKS" >> "$IIET_JOB_DIR/starts.log"
cd "$REPO"

signalled=""
forward() {  # $1: the signal name; the processes finish their step, save and exit 0
  signalled=$1
  echo "launch: got SIG$1 at $(date -Is), forwarding it"
  [ -n "${child:-}" ] && kill "-$1" "$child" 2>/dev/null
}
# Trapped from here on: a signal during the health check is remembered, and nothing starts.
trap 'forward USR1' USR1
trap 'forward TERM' TERM

if [ "$HEALTH" = 1 ] && [ "$SINGLE" = 0 ]; then
  eval "$HEALTH_CMD" || { echo "error: launch.sh: health check failed; nothing started" >&2; exit 3; }
fi

status=0
if [ -z "$signalled" ]; then
  eval "exec $MAIN_CMD" &  # exec: the signal reaches srun (or python) itself
  child=$!
  # `wait` returns early when a trapped signal arrives: wait until the child has really ended.
  while :; do
    wait "$child"; status=$?
    kill -0 "$child" 2>/dev/null || break
  done
  echo "launch: $ENTRY exited with status $status"
fi
if [ "$REQUEUE" = 1 ] && [ "$signalled" = USR1 ]; then
  if [ -n "$FINISHED" ] && (cd "$REPO" && eval "$FINISHED") >/dev/null 2>&1; then
    echo "launch: the work is finished; not requeueing"
  else
    echo "launch: requeueing job $JOB_ID (restart $(( ${SLURM_RESTART_COUNT:-0} + 1 ))); it resumes from its last checkpoint"
    scontrol requeue "$JOB_ID"
    exit 0
  fi
fi
exit "$status"
