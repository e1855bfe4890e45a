"""Pretrain IIET (or a baseline) with megatron-core or DeepSpeed.

    torchrun --nproc-per-node 2 pretrain_iiet.py --config examples/tiny_iiet.yaml \\
        --set parallel.tensor=2 --set optimizer.lr=3e-4

With no --config it trains the `tiny` IIET on the built-in corpus (the quickstart).
"""

from __future__ import annotations

import argparse
import sys

from megatron_iiet.training.signals import protect_spawned_helper

protect_spawned_helper(__name__)  # megatron's spawned helpers re-import this file


def config_fields() -> str:
    """Every config field as `section.field (type, default)`, grouped by section: --help's
    epilog, generated from the config's dataclasses so it cannot fall behind them."""
    import dataclasses
    import textwrap

    from megatron_iiet.training.config import TrainConfig

    def type_name(t) -> str:
        if isinstance(t, type):
            return t.__name__
        name = str(t).replace("typing.", "")
        return name[len("Optional["):-1] if name.startswith("Optional[") else name

    lines = ["config fields (YAML sections, or --set SECTION.FIELD=VALUE; docs/training.md "
             "explains each):"]
    for section in dataclasses.fields(TrainConfig):
        default = section.default_factory() if section.default_factory is not dataclasses.MISSING \
            else section.default
        if not dataclasses.is_dataclass(default):
            lines.append(f"  {section.name} ({type_name(section.type)}, default {default!r})")
            continue
        names = [f"{f.name}={getattr(default, f.name)!r}" for f in dataclasses.fields(default)]
        lines += textwrap.wrap(", ".join(names), 100, initial_indent=f"  {section.name}: ",
                               subsequent_indent="      ")
    return "\n".join(lines)


def parse_args(argv=None):
    wants_help = any(a in ("-h", "--help") for a in (sys.argv[1:] if argv is None else argv))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter,
                                epilog=config_fields() if wants_help else None)
    p.add_argument("--config", help="YAML file (see examples/)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set optimizer.lr=3e-4 (repeatable)")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config (the YAML with every --set and default "
                        "applied) and exit without training")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from megatron_iiet.training.config import load_config

    try:
        cfg = load_config(args.config, args.set)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        import yaml

        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
        return 0

    from megatron_iiet.distributed import teardown
    from megatron_iiet.errors import OperatorError
    from megatron_iiet.run import TooManySkippedSteps, train

    try:
        summary = train(cfg)
    except OperatorError as e:  # bad input, a full disk, a busy directory: one line
        print(f"error: {e}", file=sys.stderr)
        return 2
    except TooManySkippedSteps as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        teardown()
    import os

    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    print(f"done: {summary.steps} steps, final train loss {summary.final_loss}, validation loss "
          f"{summary.valid_loss}" + (" (stopped by a preemption signal)" if summary.preempted else ""))
    print(f"  checkpoint:  {summary.checkpoint}\n"
          f"  metrics:     {summary.log_dir}/metrics.jsonl\n"
          f"  tensorboard: tensorboard --logdir {summary.log_dir}/tensorboard")
    return 0


if __name__ == "__main__":  # the guard matters: dist_checkpointing's writer re-imports __main__
    sys.exit(main())
