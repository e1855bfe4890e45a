"""Issue 31.5, IIAD in the trained regime: an E-IIET planned from a cell's IIET run at 3/4 of its
steps and trained for the last quarter, against the IIET run itself and vanilla at equal tokens.

- **Plan**: the iteration influence (tools/iiad_influence.py) of the IIET run's checkpoint at 3/4
  of its steps, on the cell's held-out book past its validation windows; then the plan of
  predicted decode speed-up >= ``--speedup`` (default 2: the 2x-decode plan of docs/iiad.md,
  tools/iiad_plan.py --target-speedup).
- **Student**: the IIET run's own settings with ``model.iterations`` set to the plan, started
  from that checkpoint with ``checkpoint.init_from`` + ``init_from_position`` (the same step, LR
  schedule and sample stream; the optimizer starts fresh, as in two_stage.py), distilled (KL
  weight 1, T 1, labelled positions: our IIAD default) from the IIET run's final checkpoint, or
  with ``--plain`` trained the same steps without a teacher (the ablation).
- **Measure**: the share of IIET's gain over vanilla the student keeps, (vanilla - student) /
  (vanilla - IIET) at equal tokens (``trained_regime_report.py --iiad CELL``).

    python examples/iiad_trained.py CELL IIET_RUN [--plain] [--speedup X] [--dry-run | --collect]
    # e.g. python examples/iiad_trained.py xs_47tpp iiet_xs_17.06M_lr0.002_s1234
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from two_stage import (cell_plan, finished_run, last_quarter_start, run_variant, trained_lr,
                       variant_command, variant_parser)

from megatron_iiet.errors import OperatorError

REPO = Path(__file__).resolve().parents[1]
CALIBRATION = {"batches": 8, "batch-size": 4}


def plan_commands(plan, iiet, start: Path, work: Path, speedup: float,
                  offset: int) -> list[list[str]]:
    """tools/iiad_influence.py on ``start``, then tools/iiad_plan.py (each skipped once done)."""
    py = sys.executable
    influence = [py, str(REPO / "tools" / "iiad_influence.py"), "--checkpoint", str(start),
                 "--data", iiet.overrides["data.valid"], "--offset-tokens", str(offset),
                 *[a for k, v in CALIBRATION.items() for a in (f"--{k}", str(v))],
                 "--output", str(work / "influence"), "--no-progress"]
    planner = [py, str(REPO / "tools" / "iiad_plan.py"), "--influence", str(work / "influence"),
               "--checkpoint", str(start), "--target-speedup", f"{speedup:g}",
               "--output", str(work / f"plan_x{speedup:g}.yaml"), "--no-distill"]
    return [influence, planner]


def make_plan(commands: list[list[str]], work: Path, speedup: float) -> dict:
    """Run the influence and the planner where their outputs are missing; the plan's json."""
    outputs = [work / "influence" / "influence.json", work / f"plan_x{speedup:g}.json"]
    for cmd, out in zip(commands, outputs):
        if out.is_file():
            continue
        work.mkdir(parents=True, exist_ok=True)
        with open(work / "iiad.log", "a") as log:
            code = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode
        if code != 0:
            raise OperatorError(f"{Path(cmd[1]).name} failed (exit {code}): {work / 'iiad.log'}")
    return json.loads(outputs[1].read_text())


def student_command(cell: str, iiet_name: str, plain: bool, speedup: float, mode: str,
                    offset: int = 65536) -> tuple[list[str], Path, dict]:
    """mode: "run" (plan first where missing), "dry-run" (print only) or "collect"."""
    from megatron_iiet.sweep.runner import run_dir

    plan = cell_plan(cell)
    iiet = finished_run(plan, iiet_name, "iiet")
    quarter, start = last_quarter_start(plan, iiet, need=mode == "run")
    work = Path(plan.spec.output) / "iiad" / iiet_name
    commands = plan_commands(plan, iiet, start, work, speedup, offset)
    plan_json = work / f"plan_x{speedup:g}.json"
    if mode == "run":
        chosen = make_plan(commands, work, speedup)
    elif plan_json.is_file():
        chosen = json.loads(plan_json.read_text())
    elif mode == "collect":
        raise OperatorError(f"{plan_json}: no plan (the student was not run here)")
    else:
        for cmd in commands:
            print(" ".join(cmd))
        chosen = {"iterations": "PLAN", "passes": None, "full_passes": None,
                  "flops_saving": 0.0, "decode_saving": None}
    teacher = run_dir(plan, iiet) / "checkpoints"  # its newest: the finished IIET
    kind = "plain" if plain else "distil"
    folder = Path(plan.spec.output) / "runs" / f"iiad_{kind}_x{speedup:g}_from_{iiet_name}"
    lr, seed = trained_lr(plan, iiet), iiet.overrides["seed"]
    last = (iiet.train_steps - quarter) / iiet.train_steps  # the student's share of the tokens
    # the planner's FLOP saving applied to IIET's training FLOPs per token; a teacher's forward
    # is a third of its training FLOPs
    student_fpt = iiet.flops_per_token * (1 - chosen["flops_saving"])
    teacher_fpt = 0.0 if plain else iiet.flops_per_token / 3
    info = {"iiet_run": iiet_name, "plan": chosen["iterations"], "passes": chosen["passes"],
            "full_passes": chosen["full_passes"], "decode_saving": chosen["decode_saving"],
            "target_speedup": speedup, "teacher": None if plain else iiet_name,
            "switch_step": quarter, "train_steps": iiet.train_steps, "lr": lr, "seed": seed,
            "tokens": iiet.tokens,
            "flops": iiet.tokens * ((1 - last) * iiet.flops_per_token
                                    + last * (student_fpt + teacher_fpt))}
    overrides = {"seed": seed, "model.iterations": chosen["iterations"],
                 "checkpoint.init_from": str(start), "checkpoint.init_from_position": True}
    if not plain:
        overrides["distill.teachers"] = [{"checkpoint": str(teacher)}]
    return variant_command(plan, iiet, folder, lr, overrides), folder, info


def main(argv: list[str]) -> int:
    parser = variant_parser(__doc__)
    parser.add_argument("iiet_run")
    parser.add_argument("--plain", action="store_true",
                        help="no teacher: the pruned student trained alone (the ablation)")
    parser.add_argument("--speedup", type=float, default=2.0,
                        help="the plan's predicted decode speed-up, at least (default 2)")
    parser.add_argument("--offset-tokens", type=int, default=65536,
                        help="where in the held-out data the influence's calibration batches "
                             "start (default past the validation windows of the trained cells)")
    args = parser.parse_args(argv)
    mode = "collect" if args.collect else "dry-run" if args.dry_run else "run"
    return run_variant(args, lambda: student_command(args.cell, args.iiet_run, args.plain,
                                                     args.speedup, mode,
                                                     args.offset_tokens))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
