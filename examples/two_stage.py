"""Issue 31.4, two-stage IIET: a cell's vanilla run continued as IIET for the last quarter.

The second stage starts from the vanilla run's checkpoint at 3/4 of its steps (the sweep keeps
the quarter checkpoints) with ``checkpoint.init_from`` + ``checkpoint.init_from_position``: the
layer weights are vanilla's, each layer's history starts from its initialisation, the step, the
LR schedule (vanilla's, at the same LR) and the sample stream go on where vanilla was; only the
optimizer starts fresh. Equal tokens with every run of the cell; FLOPs: 3/4 of vanilla's plus
1/4 of IIET's. Its metrics.jsonl is read like any run's (held-out validation every
eval.interval steps).

    python examples/two_stage.py CELL VANILLA_RUN [--dry-run]
    # e.g. python examples/two_stage.py xs_20tpp vanilla_xs_7.26M_lrbest_s1
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_iiet.errors import OperatorError  # noqa: E402


def second_stage_command(cell: str, vanilla_name: str) -> tuple[list[str], Path]:
    """(the pretrain_iiet.py command of the second stage, its run folder)."""
    from megatron_iiet.sweep.plan import plan_sweep
    from megatron_iiet.sweep.runner import _command, run_dir, run_status, saved_lr
    from megatron_iiet.training.checkpoint_index import checkpoint_name, defect

    plan = plan_sweep(REPO / "examples" / "sweeps" / "trained" / f"{cell}.yaml", 1.0)
    names = {r.name: r for r in plan.runs}
    if vanilla_name not in names or names[vanilla_name].architecture != "vanilla":
        raise OperatorError(f"{vanilla_name}: not a vanilla run of {cell} "
                            f"({', '.join(n for n in names if n.startswith('vanilla'))})")
    vanilla = names[vanilla_name]
    if run_status(plan, vanilla) != "finished":
        raise OperatorError(f"{vanilla_name}: not finished here (its checkpoints are needed)")
    quarter = 3 * (vanilla.train_steps // 4)
    start = run_dir(plan, vanilla) / "checkpoints" / checkpoint_name(quarter)
    if not start.is_dir() or defect(start) is not None:
        raise OperatorError(f"{start}: missing or incomplete (a run started before the sweep's "
                            "checkpoint.keep_last 5 kept only its last checkpoint)")
    lr = saved_lr(plan, vanilla)
    iiet = next(r for r in plan.runs if r.architecture == "iiet")  # the IIET settings of the cell
    folder = Path(plan.spec.output) / "runs" / f"two_stage_iiet_from_{vanilla_name}"
    overrides = {**iiet.overrides, "seed": vanilla.overrides["seed"], "logging.dir": str(folder),
                 "checkpoint.init_from": str(start), "checkpoint.init_from_position": True}
    second = dataclasses.replace(iiet, name=folder.name, overrides=overrides)
    return _command(plan, second, lr, 1), folder


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cell")
    parser.add_argument("vanilla_run")
    parser.add_argument("--dry-run", action="store_true", help="print the command")
    args = parser.parse_args(argv)
    try:
        cmd, folder = second_stage_command(args.cell, args.vanilla_run)
    except OperatorError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(" ".join(cmd))
        return 0
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "launch.log", "a") as log:
        return subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
