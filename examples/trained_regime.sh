#!/usr/bin/env bash
# Issue 31's trained-regime CPU comparison (docs/scaling.md, "The trained regime"): vanilla vs
# PCformer-RK2 vs IIET (r=3) at 20 and ~47 tokens per parameter, >= 3k steps per run, each
# (architecture, size, budget) with its own LR grid and then 3 seeds at the best LR.
#
#   usage: bash examples/trained_regime.sh prepare            # data only (a few minutes)
#          [JOBS=2] bash examples/trained_regime.sh run CELL [ORDER]  # a cell's grid + seeds, resumable
#          bash examples/trained_regime.sh collect CELL       # results.json (+ WikiText-2 loss)
#
# CELL is a sweep file's name under examples/sweeps/trained/ (e.g. xs_20tpp). ORDER lists phase-1
# task indices (0-based, `sweep.py launch --dry-run` order) to run first, e.g. the middle LR of
# every architecture, so that an interrupted session still leaves one finished run per
# architecture; without it the sweep's own order. JOBS runs side by side, one thread each.
#
# Data: the 21 training books of the CPU ladder plus the 16 of gutenberg-extra (37 books, ~10.9M
# tokens with the ladder's 4096-piece tokenizer); in-domain validation on the ladder's held-out
# book (Pride and Prejudice), out of domain on WikiText-2 valid. Everything is written under
# $OUT (default outputs/cpu_compare, shared with cpu_compare.sh); nothing goes into the
# repository. Each finished cell's results are copied to results/trained/CELL/ by `collect` (small
# JSON, never checkpoints): commit them, and a later session continues from what is committed
# (`run` skips the finished runs it finds under the sweep's output, and a cell whose committed
# results list every run as finished is not rerun).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
SHARED=${IIET_SHARED_DATA:-../shared/data}
OUT=${OUT:-outputs/cpu_compare}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONWARNINGS=ignore

prepare() {
  bash examples/cpu_compare.sh --prepare-only
  [ -d "$SHARED/gutenberg-extra" ] || { echo "error: $SHARED/gutenberg-extra not found (set IIET_SHARED_DATA)" >&2; exit 2; }
  if [ ! -s "$OUT/raw/gutenberg_train_long.jsonl" ]; then
    "$PY" - "$SHARED/gutenberg-extra" "$OUT/raw" <<'PYEOF'
import json, os, sys
from pathlib import Path
from megatron_iiet.data.corpus import strip_gutenberg_boilerplate

extra_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
records = [json.loads(line) for line in (out / "gutenberg_train.jsonl").read_text().splitlines()]
records += [{"text": strip_gutenberg_boilerplate(b.read_text(encoding="utf-8-sig"), str(b)),
             "source": "extra/" + b.name} for b in sorted(extra_dir.glob("*.txt"))]
tmp = out / "gutenberg_train_long.jsonl.tmp"
tmp.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
os.replace(tmp, out / "gutenberg_train_long.jsonl")
print(f"{len(records)} training books")
PYEOF
  fi
  "$PY" tools/preprocess_data.py --input "$OUT/raw/gutenberg_train_long.jsonl" --text-key text \
      --tokenizer "$OUT/tokenizer/tokenizer.model" --output-prefix "$OUT/data/gutenberg_train_long" \
      --workers 2 --no-progress
}

case "${1:-}" in
  prepare) prepare ;;
  run)
    CELL=${2:?run needs a CELL (examples/sweeps/trained/*.yaml)}
    SWEEP=examples/sweeps/trained/$CELL.yaml
    [ -f "$SWEEP" ] || { echo "error: $SWEEP does not exist" >&2; exit 2; }
    [ -s "$OUT/data/gutenberg_train_long.bin" ] || prepare
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    ORDER=${3:-}
    JOBS=${JOBS:-1}
    if [ -n "$ORDER" ]; then
      printf '%s\n' $ORDER | xargs -P "$JOBS" -I{} "$PY" tools/sweep.py launch "$SWEEP" --phase 1 --task {}
    fi
    "$PY" tools/sweep.py launch "$SWEEP" --jobs "$JOBS"  # the rest of the grid, then the seeds
    ;;
  collect)
    CELL=${2:?collect needs a CELL}
    SWEEP=examples/sweeps/trained/$CELL.yaml
    "$PY" tools/sweep.py collect "$SWEEP" --extra-valid "wikitext=$OUT/data/wikitext2_valid"
    mkdir -p "results/trained/$CELL"
    cp "outputs/sweeps/trained_$CELL/results.json" "results/trained/$CELL/"
    ;;
  *) sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
