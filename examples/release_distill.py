"""Issue 31.3, in-pretraining distillation as released: IIET trained from scratch with a KL term
to a frozen PCformer-RK2 teacher on the window that corresponds to the release's steps 20k-25k of
30k (here 2/3 to 5/6 of the cell's steps), over every position (the release's semantics),
lambda 1, T 1. The student is the cell's IIET run at ``--lr`` and ``--seed`` with only the
`distill:` section added, so it compares with that run at equal tokens; the teacher is a finished
PCformer-RK2 run of the same cell (its newest checkpoint). docs/scaling.md has the results.

``--control`` runs its pair without the teacher: the distilled run's newest checkpoint before the
window (step <= its start) and its metrics up to there are copied into the control's folder, which
trains on from there with the `distill:` section left out. Before the window the two are one run,
so the control differs from the distilled run only by the distillation, also where the cell's own
IIET run was trained on another machine (whose floating-point rounding takes another path through
the plateau, which moves the end by as much as the distillation might).

    python examples/release_distill.py CELL TEACHER_RUN --lr LR [--seed S] [--control]
                                       [--dry-run | --collect]
    # e.g. python examples/release_distill.py xs_20tpp pcformer_rk2_xs_7.26M_lr0.004_s1234 --lr 2e-3
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from two_stage import cell_plan, finished_run, run_variant, variant_command, variant_parser

from megatron_iiet.errors import OperatorError

RELEASE_WINDOW = (20_000, 25_000, 30_000)  # distil while start < step <= end, of total steps


def distill_command(cell: str, teacher_name: str, lr: float,
                    seed: int) -> tuple[list[str], Path, dict]:
    from megatron_iiet.sweep.runner import run_dir

    plan = cell_plan(cell)
    teacher = finished_run(plan, teacher_name, "pcformer_rk2")
    iiet = next((r for r in plan.runs if r.architecture == "iiet"), None)
    if iiet is None:
        raise OperatorError(f"{cell}: has no IIET run")
    start, end, total = RELEASE_WINDOW
    steps = iiet.train_steps
    folder = (Path(plan.spec.output) / "runs"
              / f"release_distill_iiet_lr{lr:g}_s{seed}_from_{teacher_name}")
    first, last = round(steps * start / total), round(steps * end / total)
    window_tokens = iiet.tokens * (last - first) / steps
    info = {"teacher": teacher_name, "window": [first, last], "train_steps": steps, "lr": lr,
            "seed": seed, "tokens": iiet.tokens,
            # the teacher's forward (a third of its training FLOPs) on the window's tokens
            "flops": iiet.total_flops + teacher.flops_per_token / 3 * window_tokens}
    return variant_command(plan, iiet, folder, lr, {
        "seed": seed,
        "distill.teachers": [{"checkpoint": str(run_dir(plan, teacher) / "checkpoints")}],
        "distill.start_step": first, "distill.end_step": last,
        "distill.positions": "all"}), folder, info


def control_command(cell: str, teacher_name: str, lr: float, seed: int,
                    mode: str) -> tuple[list[str], Path, dict]:
    """The distilled run's pair without the teacher. ``mode`` "launch" seeds the control's folder
    from the distilled run (once; refused in one line when it has no checkpoint before the
    window), "collect" needs it seeded, "dry-run" only prints."""
    _, distilled, info = distill_command(cell, teacher_name, lr, seed)
    plan = cell_plan(cell)
    iiet = next(r for r in plan.runs if r.architecture == "iiet")
    folder = distilled.with_name(distilled.name.replace("release_distill_", "release_control_", 1))
    first = info["window"][0]
    step = (branch_from(distilled, folder, first) if mode == "launch"
            else _branch_step(folder, required=mode == "collect"))
    return variant_command(plan, iiet, folder, lr, {"seed": seed}), folder, {
        "control_of": distilled.name, "branch_step": step,
        "window": info["window"], "train_steps": info["train_steps"], "lr": lr, "seed": seed,
        "tokens": info["tokens"], "flops": iiet.total_flops}


def branch_from(distilled: Path, folder: Path, first: int) -> int:
    """Copy ``distilled``'s newest complete checkpoint at step <= ``first`` and its metrics
    records up to that step into ``folder`` (unless ``folder`` already holds a checkpoint): the
    step the control starts from."""
    import json
    import shutil

    from megatron_iiet.data.atomic import write_bytes_atomic
    from megatron_iiet.training.checkpoint_index import (
        LATEST, PARTIAL_SUFFIX, defect, list_checkpoints, step_of)
    from megatron_iiet.training.metrics_log import read_records

    own = folder / "checkpoints"
    if own.is_dir() and list_checkpoints(own):
        return _branch_step(folder, required=True)
    before = [c for c in list_checkpoints(distilled / "checkpoints")
              if step_of(c) <= first and defect(c) is None]
    if not before:
        raise OperatorError(f"{distilled}: no complete checkpoint at or before step {first} (the "
                            "window's start) to branch the control from: run the distilled run "
                            "first, and stop it (SIGTERM saves) before its window if need be")
    start = max(before, key=step_of)
    step = step_of(start)
    own.mkdir(parents=True, exist_ok=True)
    partial = own / (start.name + PARTIAL_SUFFIX)
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(start, partial)
    kept = [r for r in read_records(distilled)
            if r.get("kind") in ("train", "valid") and r["step"] <= step]
    write_bytes_atomic(folder / "metrics.jsonl",
                       "".join(json.dumps(r) + "\n" for r in kept).encode())
    write_bytes_atomic(folder / BRANCH, f"{step}\n".encode())
    # the checkpoint goes in last: a copy cut short leaves no checkpoint, and is done again
    partial.rename(own / start.name)
    write_bytes_atomic(own / LATEST, start.name.encode())
    print(f"{folder.name}: branched from {start}")
    return step


BRANCH = "branched_at_step"


def _branch_step(folder: Path, required: bool) -> Optional[int]:
    try:
        return int((folder / BRANCH).read_text())
    except (OSError, ValueError):
        if not required:
            return None
        raise OperatorError(f"{folder}: not branched from its distilled run yet (run "
                            "--control without --collect or --dry-run first)") from None


def main(argv: list[str]) -> int:
    parser = variant_parser(__doc__)
    parser.add_argument("teacher_run")
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--control", action="store_true",
                        help="the same run without the teacher, branched from the distilled run "
                             "before the window")
    args = parser.parse_args(argv)
    if args.control:
        return run_variant(args, lambda: control_command(
            args.cell, args.teacher_run, args.lr, args.seed,
            mode="collect" if args.collect else "dry-run" if args.dry_run else "launch"))
    return run_variant(args, lambda: distill_command(args.cell, args.teacher_run, args.lr,
                                                     args.seed))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
