"""What the command-line tools share."""

from __future__ import annotations

import argparse
import sys


def fail(error: BaseException) -> None:
    """Exit with status 2 and a one-line reason: bad input gets no traceback."""
    print(f"error: {error}", file=sys.stderr)
    raise SystemExit(2)


def run_tool(run, args, distributed: bool = False) -> int:
    """A tool's main: ``run(args)``, an operator's mistake as one line and exit 2 (``fail``).
    ``distributed``: a tool launched under torchrun, whose process groups are torn down at the
    end, with DeepSpeed's accelerator named first (it reads the platform at import)."""
    from megatron_iiet.errors import OperatorError

    if distributed:
        from megatron_iiet.platform import name_deepspeed_accelerator

        name_deepspeed_accelerator()
    try:
        return run(args)
    except OperatorError as err:
        fail(err)
    finally:
        if distributed:
            from megatron_iiet.distributed import teardown

            teardown()


def parse_iterations(text: str):
    """argparse type of --iterations: '3' -> 3 (every layer); '3,2,1,0' -> one entry per layer."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an int or a comma list of ints (one per layer), got {text!r}") from None
    return values[0] if len(values) == 1 else values


def positive_number(text: str) -> float:
    """argparse type of a bound such as --max-abs-weight: a number > 0 ('inf' for none)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:  # NaN compares false too
        raise argparse.ArgumentTypeError(f"expected a number > 0 (or inf), got {text!r}")
    return value
