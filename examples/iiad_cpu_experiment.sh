#!/usr/bin/env bash
# The IIAD experiment of docs/iiad.md on the 2-core machine (about 2 hours): an IIET (r=3) and a
# vanilla baseline of the same shape and tokens, iteration influence, E-IIET plans at three pass
# targets, each distilled from the full IIET and, as the ablation, trained the same steps without
# a teacher; once with two teachers; the IIET itself continued as many steps; then HF exports,
# decode speed and the local lm-eval tasks. Every stage is skipped when its output exists, so
# the script resumes.
#
#   usage: bash examples/iiad_cpu_experiment.sh            (OUT=outputs/iiad_cpu by default)
#          PLANS="6" SEEDS="4321 4322 4323" bash examples/iiad_cpu_experiment.sh
#            (one plan, each student pair at three data-order seeds: the noise of distilled - plain)
#
# Data: `bash examples/cpu_compare.sh --prepare-only` (21 Gutenberg books for training, the 22nd
# held out: in-domain validation and the influence's calibration data).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONWARNINGS=ignore OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
       TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-.venv/bin/python}
TR="$PY -m torch.distributed.run --standalone --nproc-per-node 2"
E=${OUT:-outputs/iiad_cpu}
DATA=outputs/cpu_compare/data
STEPS=${STEPS:-100}          # the students' (and the continued IIET's) training steps
PLANS=${PLANS:-6 8 10}       # pass targets of the E-IIET plans (of 16 passes)
SEEDS=${SEEDS:-4321}         # data-order seeds of each student pair; the first is the plain name
# (OUT is this script's own output directory, not cpu_compare's: prepare the data where DATA says)
[ -f $DATA/gutenberg_heldout.bin ] || OUT=outputs/cpu_compare bash examples/cpu_compare.sh --prepare-only
mkdir -p $E

BASE="--config examples/cpu_compare_iiet.yaml --set data.train=$DATA/gutenberg_train
  --set data.valid=$DATA/gutenberg_heldout --set data.cache_dir=$E/cache
  --set logging.progress_bar=false --set checkpoint.keep_last=0 --set checkpoint.save_interval=200"
train() { # run-name, then pretrain_iiet.py --set options
  local name=$1; shift
  [ -f $E/$name/done ] && return 0
  echo "== $name"
  $TR pretrain_iiet.py $BASE --set logging.dir=$E/$name "$@" > $E/$name.log 2>&1 \
    && touch $E/$name/done || { echo "$name failed: $E/$name.log"; exit 1; }
}
# 1. the bases: same shape, data, tokens (600 x 16 x 256) and seed; IIET at lr 5e-4 (lr 1e-3
#    and 2e-3 leave it longer on the unigram plateau), vanilla at its 1e-3
train vanilla --set model.architecture=vanilla --set optimizer.lr=1e-3 --set optimizer.min_lr=1e-4
train iiet --set optimizer.lr=5e-4 --set optimizer.min_lr=5e-5
# 2. influence on the held-out book (8 x 4 x 256 tokens past its first 64k)
[ -f $E/influence/influence.json ] || $TR tools/iiad_influence.py --checkpoint $E/iiet/checkpoints \
  --data $DATA/gutenberg_heldout --batches 8 --batch-size 4 --seq-length 256 \
  --offset-tokens 65536 --output $E/influence --no-progress > $E/influence.log 2>&1
# 3. plans (of 16 passes) -> distilled and plain students, same schedule and data order
STUDENT="--set optimizer.lr=2e-4 --set optimizer.min_lr=2e-5 --set schedule.warmup_steps=10
  --set seed=4321 --set logging.progress_bar=false --set eval.interval=50
  --set checkpoint.save_interval=50 --set checkpoint.keep_last=0"
student() { # run-name config [--set ...]
  local name=$1 config=$2; shift 2
  [ -f $E/$name/done ] && return 0
  echo "== $name"
  $TR pretrain_iiet.py --config $config $STUDENT "$@" > $E/$name.log 2>&1 \
    && touch $E/$name/done || { echo "$name failed: $E/$name.log"; exit 1; }
}
for P in $PLANS; do
  [ -f $E/plan$P.yaml ] || $PY tools/iiad_plan.py --influence $E/influence --target-passes $P \
    --output $E/plan$P.yaml --run-dir $E/distil_p$P --train-steps $STEPS > $E/plan$P.log
  [ -f $E/plain$P.yaml ] || $PY tools/iiad_plan.py --influence $E/influence --target-passes $P \
    --output $E/plain$P.yaml --run-dir $E/plain_p$P --train-steps $STEPS --no-distill >> $E/plan$P.log
  for S in $SEEDS; do
    suffix=$([ "$S" = "${SEEDS%% *}" ] || echo _s$S)
    student distil_p$P$suffix $E/plan$P.yaml --set seed=$S --set logging.dir=$E/distil_p$P$suffix
    student plain_p$P$suffix $E/plain$P.yaml --set seed=$S --set logging.dir=$E/plain_p$P$suffix
  done
done
FIRST=${PLANS%% *}
student distil2_p$FIRST $E/plan$FIRST.yaml --set logging.dir=$E/distil2_p$FIRST --set \
  "distill.teachers=[{checkpoint: $E/iiet/checkpoints, weight: 0.7}, {checkpoint: $E/vanilla/checkpoints, weight: 0.3}]"
train iiet_cont --set checkpoint.init_from=$E/iiet/checkpoints --set schedule.train_steps=$STEPS \
  $STUDENT
# 4. HF exports, decode speed (exact cache), local lm-eval tasks
MODELS="vanilla iiet iiet_cont distil2_p$FIRST"
EXPORTS="vanilla=$E/hf/vanilla iiet=$E/hf/iiet"
for P in $PLANS; do
  MODELS="$MODELS distil_p$P plain_p$P"
  EXPORTS="$EXPORTS e-iiet-p$P=$E/hf/distil_p$P"
done
for M in $MODELS; do
  [ -d $E/hf/$M ] || $PY tools/convert_checkpoint.py megatron-to-hf $E/$M/checkpoints $E/hf/$M --quiet
done
[ -s $E/decode.md ] || $PY bench/bench_decode_exports.py $EXPORTS \
  --prompt 128 --new 64 --rounds 5 --reference iiet > $E/decode.md
for M in $MODELS; do
  [ -f $E/eval/$M/results.json ] || $PY tools/evaluate.py --checkpoint $E/$M/checkpoints \
    --tasks wikitext,lambada_openai,piqa,hellaswag,winogrande,arc_easy,arc_challenge \
    --limit 300 --output $E/eval/$M --label $M --no-progress > $E/eval_$M.log 2>&1
done
$PY tools/compare_runs.py $E/vanilla $E/iiet --plot $E/pretraining.png
STUDENTS="$E/iiet_cont $E/distil2_p$FIRST"
for P in $PLANS; do STUDENTS="$STUDENTS $E/distil_p$P $E/plain_p$P"; done
$PY tools/compare_runs.py $STUDENTS --plot $E/students.png
echo "done: $E"
