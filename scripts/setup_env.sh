#!/usr/bin/env bash
# Creates .venv with the pinned stack. torch==2.13.0 goes first (the local CPU build); every later
# install runs under a torch==2.13.0 constraint so nothing can pull a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3.11 -m venv "$VENV" 2>/dev/null || python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q torch==2.13.0
DS_BUILD_OPS=0 "$PY" -m pip install -q -c .ci/constraints.txt -e ".[test]"
"$PY" -c "import torch, megatron.core; assert torch.__version__.startswith('2.13.0'), torch.__version__"
