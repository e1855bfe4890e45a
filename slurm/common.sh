# Sourced by every slurm/*.sbatch script once REPO is known:
#   REPO=${IIET_REPO:-${SLURM_SUBMIT_DIR:-$PWD}}; source "$REPO/slurm/common.sh" || exit 2
# Gives: cd to the repository, PY, LAUNCH (the launcher), DRY_RUN (--dry-run if it was the first
# argument; removed from "$@" by `take_dry_run "$@"; set -- "${ARGS[@]}"`), and checks that end
# the job with one `error:` line and exit 2 before any node is kept busy.
cd "$REPO" || exit 2
PY=${IIET_PYTHON:-$REPO/.venv/bin/python}
export IIET_PYTHON=$PY
LAUNCH=(bash "$REPO/slurm/launch.sh")

fail() { echo "error: $*" >&2; exit 2; }

# Usage line of the calling script (its "#   usage:" comment) on -h/--help, or when args are missing.
usage_or_continue() {  # $1: the script, $2: minimum arguments, then the arguments
  local script=$1 minimum=$2; shift 2
  if [ $# -lt "$minimum" ] || [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
    grep -E '^#( |$)' "$script" | grep -v '^#SBATCH' | sed 's/^# \{0,1\}//' >&2
    if [ $# -ge 1 ] && { [ "$1" = "-h" ] || [ "$1" = "--help" ]; }; then exit 0; fi
    exit 2
  fi
}

take_dry_run() {  # sets DRY_RUN and ARGS (the arguments without a leading --dry-run)
  DRY_RUN=()
  ARGS=("$@")
  if [ "${1:-}" = "--dry-run" ]; then DRY_RUN=(--dry-run); ARGS=("${@:2}"); fi
}

# The value of option $1 (--opt VALUE or --opt=VALUE) in the remaining arguments, or empty.
option_value() {
  local name=$1; shift
  while [ $# -gt 0 ]; do
    case "$1" in
      "$name") echo "${2:-}"; return ;;
      "$name"=*) echo "${1#*=}"; return ;;
    esac
    shift
  done
}

# Each named option, when given, must name an existing path.
require_paths() {  # require_paths "--checkpoint --config" ARGS...
  local names=$1 name value; shift
  for name in $names; do
    value=$(option_value "$name" "$@")
    if [ -n "$value" ] && [ ! -e "$value" ]; then fail "$name $value does not exist"; fi
  done
}

# A pretraining config (and its --set overrides) must load and name inputs that exist.
check_run_config() {  # CONFIG [--set k=v ...]
  PYTHONWARNINGS=ignore "$PY" -m megatron_iiet.slurm check "$@" || exit 2
}
