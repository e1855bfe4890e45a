"""What the command-line tools share."""

from __future__ import annotations

import sys


def fail(error: BaseException) -> None:
    """Exit with status 2 and a one-line reason: bad input gets no traceback."""
    print(f"error: {error}", file=sys.stderr)
    raise SystemExit(2)
