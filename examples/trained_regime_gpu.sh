#!/usr/bin/env bash
# Issue 31's trained-regime cells on one lent GPU (docs/scaling.md, "Second cell"): the s cells
# need ~20 CPU-hours per grid, a few minutes on an H200 with the runs side by side under MPS.
#
#   here:       bash examples/trained_regime_gpu.sh stage
#               (the data of examples/trained_regime.sh prepare and a megatron-core wheel, into
#               the git-ignored .gpu/ and .whl/; then the device tool's run with carry
#               [".gpu", ".whl"] and the command below)
#   on the GPU: [JOBS=9 LAUNCH_S=430] bash examples/trained_regime_gpu.sh device CELL [CELL ...]
#               (every CELL's sweep at once, JOBS runs side by side each; collect; a tarball of
#               the sweeps' outputs without checkpoints in $OUT)
#   here again: bash examples/trained_regime_gpu.sh unpack TARBALL
#               (the runs into outputs/sweeps/, each cell's results.json into results/trained/CELL/)
#
# A launch cut by LAUNCH_S leaves its runs partial; their metrics come back, their checkpoints do
# not, so a later lease restarts them. The WikiText-2 losses need the checkpoints: collect runs
# on the GPU before the tarball is made (COLLECT_S seconds, 0 to skip).
set -uo pipefail
cd "$(dirname "$0")/.."
DATA=outputs/cpu_compare

stage() {
  set -e
  [ -s "$DATA/data/gutenberg_train_long.bin" ] || bash examples/trained_regime.sh prepare
  grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo /.gpu/ >> .git/info/exclude
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
  rm -rf .gpu/data .gpu/tokenizer && mkdir -p .gpu/data .gpu/tokenizer .whl
  for f in gutenberg_train_long gutenberg_heldout wikitext2_valid; do
    cp "$DATA/data/$f.bin" "$DATA/data/$f.idx" "$DATA/data/$f.meta.json" .gpu/data/
  done
  cp "$DATA/tokenizer/tokenizer.model" .gpu/tokenizer/
  # the sample-order cache: built once here, not by nine runs racing on the GPU machine
  [ -d outputs/sweeps/trained_data_cache ] && rm -rf .gpu/trained_data_cache \
      && cp -a outputs/sweeps/trained_data_cache .gpu/
  # The GPU machine has torch and no internet: megatron-core travels as a wheel (its Python 3.12).
  ls .whl/megatron_core-*.whl >/dev/null 2>&1 || python3 -m pip download --no-deps \
      --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d .whl "megatron-core==0.16.1"
  du -sh .gpu .whl
  echo "then: run(command='JOBS=9 bash examples/trained_regime_gpu.sh device s_20tpp', carry=['.gpu', '.whl'])"
}

device() {
  [ $# -ge 1 ] || { echo "error: device needs at least one CELL" >&2; exit 2; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
      .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONWARNINGS=ignore \
      TOKENIZERS_PARALLELISM=false
  mkdir -p "$DATA" outputs/sweeps
  cp -a .gpu/data "$DATA/data" && cp -a .gpu/tokenizer "$DATA/"
  [ -d .gpu/trained_data_cache ] && cp -a .gpu/trained_data_cache outputs/sweeps/
  nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
  python3 -c "import torch, megatron.core as m; print('torch', torch.__version__, 'mcore', m.__version__)" || exit 1
  # MPS lets the small runs share the GPU's SMs instead of time-slicing it.
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
  mkdir -p /tmp/mps /tmp/mpslog
  if nvidia-cuda-mps-control -d 2>/dev/null && timeout 60 python3 -c "import torch; (torch.ones(1).cuda() + 1).item()"; then
    echo "MPS on"
  else
    echo quit | nvidia-cuda-mps-control 2>/dev/null; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    echo "MPS off"
  fi
  local pids=() cell
  for cell in "$@"; do
    [ -f "examples/sweeps/trained/$cell.yaml" ] || { echo "error: no sweep file for $cell" >&2; exit 2; }
    timeout "${LAUNCH_S:-430}" python3 tools/sweep.py launch "examples/sweeps/trained/$cell.yaml" \
        --jobs "${JOBS:-9}" > "$OUT/launch_$cell.log" 2>&1 &
    pids+=($!)
  done
  while sleep 60; do
    local alive=0 p; for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    echo "--- $(date +%T) $(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader)"
    for cell in "$@"; do tail -n 2 "$OUT/launch_$cell.log"; done
    [ "$alive" = 1 ] || break
  done
  wait
  local dirs=()
  for cell in "$@"; do
    if [ "${COLLECT_S:-70}" -gt 0 ]; then
      timeout "${COLLECT_S:-70}" python3 tools/sweep.py collect "examples/sweeps/trained/$cell.yaml" \
          --extra-valid "wikitext=$DATA/data/wikitext2_valid" 2>&1 | tail -n 3
    fi
    dirs+=("outputs/sweeps/trained_$cell")
  done
  tar czf "$OUT/trained_gpu.tgz" --exclude checkpoints --exclude tensorboard "${dirs[@]}"
  ls -la "$OUT"
}

unpack() {
  local tarball=${1:?unpack needs the tarball the device run returned}
  set -e
  mkdir -p outputs/sweeps
  tar xzf "$tarball" -C .
  # collect on the GPU merged the cell's committed results (the sweep file's `committed:`) with
  # the new runs, so its results.json is the cell's whole record; git keeps the one it replaces.
  for results in $(tar tzf "$tarball" | grep -E '^outputs/sweeps/trained_[^/]+/results\.json$'); do
    local cell; cell=$(basename "$(dirname "$results")"); cell=${cell#trained_}
    mkdir -p "results/trained/$cell"
    cp "$results" "results/trained/$cell/results.json"
    echo "results/trained/$cell/results.json: $(git diff --stat -- "results/trained/$cell" | tail -n 1)"
  done
}

case "${1:-}" in
  stage) stage ;;
  device) shift; device "$@" ;;
  unpack) shift; unpack "$@" ;;
  *) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
