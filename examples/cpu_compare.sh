#!/usr/bin/env bash
# Equal-size CPU comparison: vanilla vs PCformer-RK2 vs IIET (r=3), trained on the 22 Project
# Gutenberg books of the shared data, validated on WikiText-2 (raw) valid.
#
#   usage: bash examples/cpu_compare.sh [--prepare-only] [--nproc N] [--runs "vanilla pcformer iiet"]
#                                       [--runs-dir DIR] [-- pretrain_iiet.py options]
#
#   --prepare-only  strip the Gutenberg boilerplate, train the tokenizer, preprocess both corpora,
#                   then stop (a few minutes on 2 cores)
#   --nproc N       processes per training run (default 2: data parallel over 2 CPU cores)
#   --runs LIST     which of vanilla / pcformer / iiet to train (default: all three, in that order)
#   --runs-dir DIR  where the runs' logs and checkpoints go (default $OUT: $OUT/vanilla, ...)
#   -- ARGS         passed to every pretrain_iiet.py run, e.g. a 5-step smoke test of the recipe:
#                   --runs-dir outputs/cpu_compare_smoke -- --set schedule.train_steps=5 \
#                   --set schedule.warmup_steps=1
#
# Environment: PYTHON (default .venv/bin/python), IIET_SHARED_DATA (default ../shared/data, the
# directory holding gutenberg/ and wikitext-2-raw/), OUT (default outputs/cpu_compare).
# Everything is written under $OUT; nothing goes into the repository. Steps that are already
# done (tokenizer, datasets) are reused; a training run resumes from its last checkpoint.
# Expected time (2 CPU cores): ~12 / 24 / 33 min per run, see each examples/cpu_compare_*.yaml.
set -euo pipefail

usage() { sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; }
PREPARE_ONLY=0
NPROC=2
RUNS="vanilla pcformer iiet"
RUNS_DIR=""
EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --prepare-only) PREPARE_ONLY=1 ;;
    --nproc) NPROC=${2:?--nproc needs a number}; shift ;;
    --runs) RUNS=${2:?--runs needs a list}; shift ;;
    --runs-dir) RUNS_DIR=${2:?--runs-dir needs a directory}; shift ;;
    --) shift; EXTRA=("$@"); break ;;
    -h|--help) usage; exit 0 ;;
    *) echo "error: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
SHARED=${IIET_SHARED_DATA:-../shared/data}
OUT=${OUT:-outputs/cpu_compare}
RUNS_DIR=${RUNS_DIR:-$OUT}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONWARNINGS=ignore

[ -d "$SHARED/gutenberg" ] || { echo "error: $SHARED/gutenberg not found (set IIET_SHARED_DATA)" >&2; exit 2; }
VALID_RAW="$SHARED/wikitext-2-raw/wiki.valid.raw"
[ -f "$VALID_RAW" ] || { echo "error: $VALID_RAW not found (set IIET_SHARED_DATA)" >&2; exit 2; }
if [ "$OUT" != outputs/cpu_compare ]; then
  echo "note: the configs read their data from outputs/cpu_compare/data; with OUT=$OUT add" \
       "--set data.train=... --set data.valid=... --set data.tokenizer=... yourself" >&2
fi
mkdir -p "$OUT/raw" "$OUT/data"

# 1. The books without their Project Gutenberg header and licence (one book = one document), and
#    WikiText-2 valid as one document (its .raw suffix is not an input type the tools know).
if [ ! -s "$OUT/raw/gutenberg.jsonl" ] || [ ! -s "$OUT/raw/wikitext2_valid.jsonl" ] \
   || [ ! -s "$OUT/raw/gutenberg_heldout.jsonl" ]; then
  echo "== stripping Gutenberg boilerplate -> $OUT/raw/gutenberg.jsonl, $OUT/raw/wikitext2_valid.jsonl"
  "$PY" - "$SHARED/gutenberg" "$VALID_RAW" "$OUT/raw" <<'PYEOF'
import json, os, sys
from pathlib import Path
from megatron_iiet.data.corpus import strip_gutenberg_boilerplate

def write_jsonl(path, records):
    text = "".join(json.dumps(r) + "\n" for r in records)
    if path.exists() and path.read_text(encoding="utf-8") == text:
        return  # unchanged: keep its modification time, so datasets made from it stay current
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)

books_dir, valid_raw, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
books = sorted(books_dir.glob("*.txt"))
records = [{"text": strip_gutenberg_boilerplate(b.read_text(encoding="utf-8-sig"), str(b)),
            "source": b.name} for b in books]
write_jsonl(out / "gutenberg.jsonl", records)
# In-domain validation (the IIAD experiment, the scaling ladder): one book held out of training.
HELD_OUT = "1342-0.txt"  # Pride and Prejudice, ~170k tokens
write_jsonl(out / "gutenberg_train.jsonl", [r for r in records if r["source"] != HELD_OUT])
write_jsonl(out / "gutenberg_heldout.jsonl", [r for r in records if r["source"] == HELD_OUT])
write_jsonl(out / "wikitext2_valid.jsonl",
            [{"text": valid_raw.read_text(encoding="utf-8"), "source": valid_raw.name}])
print(f"{len(books)} books ({(out / 'gutenberg.jsonl').stat().st_size / 2**20:.1f} MiB), "
      f"WikiText-2 valid ({valid_raw.stat().st_size / 2**20:.1f} MiB)")
PYEOF
fi

# 2. Tokenizer (BPE, 4096 pieces) on the training books only.
if [ ! -f "$OUT/tokenizer/tokenizer.model" ]; then
  echo "== training the tokenizer -> $OUT/tokenizer"
  "$PY" tools/train_tokenizer.py --input "$OUT/raw/gutenberg.jsonl" --text-key text \
      --vocab-size 4096 --output-dir "$OUT/tokenizer"
fi

# 3. Indexed datasets (preprocess_data.py skips a finished run with the same arguments).
echo "== preprocessing Gutenberg -> $OUT/data/gutenberg"
"$PY" tools/preprocess_data.py --input "$OUT/raw/gutenberg.jsonl" --text-key text \
    --tokenizer "$OUT/tokenizer/tokenizer.model" --output-prefix "$OUT/data/gutenberg" \
    --workers 2 --no-progress
for part in gutenberg_train gutenberg_heldout; do
  echo "== preprocessing $part -> $OUT/data/$part"
  "$PY" tools/preprocess_data.py --input "$OUT/raw/$part.jsonl" --text-key text \
      --tokenizer "$OUT/tokenizer/tokenizer.model" --output-prefix "$OUT/data/$part" \
      --workers 2 --no-progress
done
echo "== preprocessing WikiText-2 valid -> $OUT/data/wikitext2_valid"
"$PY" tools/preprocess_data.py --input "$OUT/raw/wikitext2_valid.jsonl" --text-key text \
    --tokenizer "$OUT/tokenizer/tokenizer.model" --output-prefix "$OUT/data/wikitext2_valid" \
    --workers 1 --no-progress
if [ "$PREPARE_ONLY" = 1 ]; then
  echo "prepared: tokenizer $OUT/tokenizer, datasets $OUT/data/{gutenberg,gutenberg_train,gutenberg_heldout,wikitext2_valid}"
  exit 0
fi

# 4. The three runs, one after another (same data order, same seed, same token budget).
LOGDIRS=()
for run in $RUNS; do
  config="examples/cpu_compare_${run}.yaml"
  [ -f "$config" ] || { echo "error: $config does not exist (runs: vanilla pcformer iiet)" >&2; exit 2; }
  echo "== training $config with $NPROC processes"
  OMP_NUM_THREADS=$(( $(nproc) / NPROC > 0 ? $(nproc) / NPROC : 1 )) \
    "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
    pretrain_iiet.py --config "$config" --set logging.progress_bar=false \
    --set "logging.dir=$RUNS_DIR/$run" "${EXTRA[@]}"
  LOGDIRS+=("$RUNS_DIR/$run")
done

# 5. Final validation loss / perplexity of each run (and a PNG of the curves if matplotlib is there).
"$PY" tools/compare_runs.py "${LOGDIRS[@]}" --plot "$RUNS_DIR/compare.png"
