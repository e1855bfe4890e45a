"""Issue 31.4, two-stage IIET: a cell's vanilla run continued as IIET for the last quarter.

The second stage starts from the vanilla run's checkpoint at 3/4 of its steps (the sweep keeps
the quarter checkpoints) with ``checkpoint.init_from`` + ``checkpoint.init_from_position``: the
layer weights are vanilla's, each layer's history starts from its initialisation, the step, the
LR schedule (vanilla's, at the same LR) and the sample stream go on where vanilla was; only the
optimizer starts fresh. Equal tokens with every run of the cell; FLOPs: 3/4 of vanilla's plus
1/4 of IIET's. ``--rewarmup N`` ramps the LR from 0 back to the schedule's over the second
stage's first N updates (schedule.rewarmup_*; its folder and results carry ``_rewarmupN``).
Its metrics.jsonl is read like any run's (held-out validation every eval.interval steps).

    python examples/two_stage.py CELL VANILLA_RUN [--rewarmup N] [--dry-run | --collect]
    # e.g. python examples/two_stage.py xs_20tpp vanilla_xs_7.26M_lrbest_s1
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from pathlib import Path

from megatron_iiet.errors import OperatorError

REPO = Path(__file__).resolve().parents[1]


def cell_plan(cell: str):
    """The plan of a trained-regime cell (examples/sweeps/trained/CELL.yaml), or of the sweep
    file CELL names (a .yaml path)."""
    from megatron_iiet.sweep.plan import plan_sweep

    path = Path(cell) if cell.endswith(".yaml") else (
        REPO / "examples" / "sweeps" / "trained" / f"{cell}.yaml")
    return plan_sweep(path, 1.0)


def results_dir(cell: str) -> Path:
    """Where a cell's small results are kept: results/trained/CELL (committed), or for a sweep
    file CELL.yaml the folder results/CELL beside it."""
    if cell.endswith(".yaml"):
        return Path(cell).parent / "results" / Path(cell).stem
    return REPO / "results" / "trained" / cell


def finished_run(plan, name: str, architecture: str):
    """The plan's run ``name`` of ``architecture``, finished here (its checkpoints are needed)."""
    from megatron_iiet.sweep.runner import run_status

    names = {r.name: r for r in plan.runs}
    if name not in names or names[name].architecture != architecture:
        raise OperatorError(f"{name}: not a {architecture} run of {plan.spec.name} "
                            f"({', '.join(n for n in names if n.startswith(architecture))})")
    if run_status(plan, names[name]) != "finished":
        raise OperatorError(f"{name}: not finished here (its checkpoints are needed)")
    return names[name]


def variant_command(plan, base, folder: Path, lr: float, overrides: dict) -> list[str]:
    """pretrain_iiet.py command of ``base`` (a run of the plan) renamed to ``folder``, with
    ``overrides`` on top (last, so that they also win over the LR floor the plan sets)."""
    from megatron_iiet.sweep.plan import as_sets
    from megatron_iiet.sweep.runner import _command

    renamed = dataclasses.replace(base, name=folder.name,
                                  overrides={**base.overrides, "logging.dir": str(folder)})
    return _command(plan, renamed, lr, 1, extra=tuple(as_sets(overrides)))


def trained_lr(plan, run) -> float:
    """The LR ``run`` was trained with: its checkpoint's, or its committed result's."""
    from megatron_iiet.sweep.runner import saved_lr

    lr = saved_lr(plan, run)
    if lr is None:
        lr = plan.committed.get(run.name, {}).get("lr")
    if lr is None:
        raise OperatorError(f"{run.name}: its LR is not known here (no checkpoint, no committed LR)")
    return lr


def last_quarter_start(plan, run, need: bool = True) -> tuple[int, Path]:
    """(the step at 3/4 of ``run``, its checkpoint there): where a variant of the run's last
    quarter starts. ``need``: refuse in one line when that checkpoint is missing here."""
    from megatron_iiet.sweep.runner import run_dir
    from megatron_iiet.training.checkpoint_index import checkpoint_name, defect

    quarter = 3 * (run.train_steps // 4)
    start = run_dir(plan, run) / "checkpoints" / checkpoint_name(quarter)
    if need and not run_dir(plan, run).is_dir():
        raise OperatorError(f"{run.name}: its run folder is not on this machine (only its "
                            "committed results are; the variant needs its checkpoints: "
                            "`tools/sweep.py launch SWEEP --retrain-committed` trains it here)")
    if need and (not start.is_dir() or defect(start) is not None):
        raise OperatorError(f"{start}: missing or incomplete (a run started before the sweep's "
                            "checkpoint.keep_last 5 kept only its last checkpoint)")
    return quarter, start


def second_stage_command(cell: str, vanilla_name: str, need_start: bool = True,
                         rewarmup: int = 0) -> tuple[list[str], Path, dict]:
    """(the pretrain_iiet.py command of the second stage, its run folder, what its results
    record besides the curves)."""
    plan = cell_plan(cell)
    vanilla = finished_run(plan, vanilla_name, "vanilla")
    quarter, start = last_quarter_start(plan, vanilla, need_start)
    iiet = next(r for r in plan.runs if r.architecture == "iiet")  # the IIET settings of the cell
    suffix = f"_rewarmup{rewarmup}" if rewarmup else ""
    folder = Path(plan.spec.output) / "runs" / f"two_stage_iiet_from_{vanilla_name}{suffix}"
    lr, seed = trained_lr(plan, vanilla), vanilla.overrides["seed"]
    share = quarter / vanilla.train_steps  # of the tokens trained as vanilla
    info = {"first_stage": vanilla_name, "switch_step": quarter, "train_steps": vanilla.train_steps,
            "lr": lr, "seed": seed, "tokens": vanilla.tokens,
            "flops": vanilla.tokens * (share * vanilla.flops_per_token
                                       + (1 - share) * iiet.flops_per_token)}
    overrides = {"seed": seed, "checkpoint.init_from": str(start),
                 "checkpoint.init_from_position": True}
    if rewarmup:
        info["rewarmup_steps"] = rewarmup
        overrides.update({"schedule.rewarmup_from": quarter, "schedule.rewarmup_steps": rewarmup})
    return variant_command(plan, iiet, folder, lr, overrides), folder, info


def collect(cell: str, folder: Path, info: dict) -> Path:
    """A finished variant run's summary (``info`` plus its curves) as
    results/trained/CELL/<run folder>.json: small, committed, read by docs/scaling.md."""
    import json

    from megatron_iiet.data.atomic import write_bytes_atomic
    from megatron_iiet.training.metrics_log import last_attempt, read_records

    records = read_records(folder)
    valid = [(r["step"], r["loss"]) for r in last_attempt(records, "valid")]
    if not any(r.get("kind") == "end" and r.get("finished") and r.get("step") == info["train_steps"]
               for r in records) or not valid or valid[-1][0] != info["train_steps"]:
        raise OperatorError(f"{folder}: not finished (no end record at step {info['train_steps']}, "
                            "or no validation there)")
    train = last_attempt(records, "train")
    # train_curve is the cross entropy on the training batches, comparable with a sweep run's;
    # a distilled run's objective (CE plus the KL term) is kept beside it
    summary = {"name": folder.name, **info, "valid_loss": valid[-1][1], "valid_curve": valid,
               "train_curve": [(r["step"], r.get("lm", r["loss"])) for r in train],
               "finished": True}
    if any("lm" in r for r in train):
        summary["train_objective_curve"] = [(r["step"], r["loss"]) for r in train]
    out = results_dir(cell) / f"{folder.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(out, (json.dumps(summary, indent=1) + "\n").encode())
    print(f"{out}: held-out {summary['valid_loss']:.4f}")
    return out


def launch(cmd: list[str], folder: Path, dry_run: bool) -> int:
    if dry_run:
        print(" ".join(cmd))
        return 0
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "launch.log", "a") as log:
        return subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode


def variant_parser(doc: str) -> argparse.ArgumentParser:
    """The options every variant script takes: the cell, then its own, --dry-run, --collect."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("cell")
    parser.add_argument("--dry-run", action="store_true", help="print the command")
    parser.add_argument("--collect", action="store_true",
                        help="summarise the finished run into results/trained/CELL/")
    return parser


def run_variant(args: argparse.Namespace, build) -> int:
    """Launch, print (--dry-run) or collect (--collect) the variant ``build()`` describes as
    (command, run folder, what its results record); an operator's mistake is one line, exit 2."""
    try:
        cmd, folder, info = build()
        if args.collect:
            collect(args.cell, folder, {**info, "command": cmd})
            return 0
    except OperatorError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return launch(cmd, folder, args.dry_run)


def main(argv: list[str]) -> int:
    parser = variant_parser(__doc__)
    parser.add_argument("vanilla_run")
    parser.add_argument("--rewarmup", type=int, default=0, metavar="N",
                        help="ramp the LR from 0 over the second stage's first N updates")
    args = parser.parse_args(argv)
    return run_variant(args, lambda: second_stage_command(
        args.cell, args.vanilla_run, need_start=not args.collect, rewarmup=args.rewarmup))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
