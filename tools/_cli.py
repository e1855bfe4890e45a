"""Shared CLI plumbing for the data tools: repo import path and one-line error exits."""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


def fail(error: BaseException) -> "NoReturn":  # noqa: F821
    print(f"error: {error}", file=sys.stderr)
    raise SystemExit(2)
