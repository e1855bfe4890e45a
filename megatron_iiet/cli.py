"""What the command-line tools share."""

from __future__ import annotations

import argparse
import sys


def fail(error: BaseException) -> None:
    """Exit with status 2 and a one-line reason: bad input gets no traceback."""
    print(f"error: {error}", file=sys.stderr)
    raise SystemExit(2)


def parse_iterations(text: str):
    """argparse type of --iterations: '3' -> 3 (every layer); '3,2,1,0' -> one entry per layer."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an int or a comma list of ints (one per layer), got {text!r}") from None
    return values[0] if len(values) == 1 else values
