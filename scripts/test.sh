#!/usr/bin/env bash
# Sets up .venv (idempotent) and runs the whole test suite on CPU, in IIET_TEST_WORKERS pytest-xdist
# workers (default 2, one per core; 0 runs in this process). Arguments go to pytest, e.g.
# `bash scripts/test.sh -m "not slow"` (the quick tier) or `bash scripts/test.sh tests/model -k tp2`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p outputs  # outputs/test-report.xml: per-test times (python bench/suite_times.py)
exec .venv/bin/python -m pytest -q -rs -p no:cacheprovider --durations=15 \
    -n "${IIET_TEST_WORKERS:-2}" --dist loadscope --junitxml=outputs/test-report.xml "$@"
