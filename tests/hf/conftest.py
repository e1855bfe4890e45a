"""Make the repository and this folder importable however pytest is started (the package is not
installed in the dev venv), and keep every HF test offline."""

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for path in (HERE.parents[1], HERE):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _one_torch_thread(one_torch_thread):
    """Every test here uses tiny tensors."""
