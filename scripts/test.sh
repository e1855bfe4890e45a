#!/usr/bin/env bash
# Sets up .venv (idempotent) and runs the whole test suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p outputs  # outputs/test-report.xml: per-test times (python bench/suite_times.py)
exec .venv/bin/python -m pytest -q -rs -p no:cacheprovider --durations=15 \
    --junitxml=outputs/test-report.xml "$@"
