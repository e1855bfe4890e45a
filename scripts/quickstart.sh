#!/usr/bin/env bash
# Sets up .venv (idempotent), then trains the tiny IIET on the built-in corpus with 2 CPU processes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONWARNINGS=ignore
exec .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 \
    pretrain_iiet.py --config examples/tiny_iiet.yaml "$@"
