"""Issue 31.3, in-pretraining distillation as released: IIET trained from scratch with a KL term
to a frozen PCformer-RK2 teacher on the window that corresponds to the release's steps 20k-25k of
30k (here 2/3 to 5/6 of the cell's steps), over every position (the release's semantics),
lambda 1, T 1. The student is the cell's IIET run at ``--lr`` and ``--seed`` with only the
`distill:` section added, so it compares with that run at equal tokens; the teacher is a finished
PCformer-RK2 run of the same cell (its newest checkpoint). docs/scaling.md has the results.

    python examples/release_distill.py CELL TEACHER_RUN --lr LR [--seed S] [--dry-run | --collect]
    # e.g. python examples/release_distill.py xs_20tpp pcformer_rk2_xs_7.26M_lr0.004_s1234 --lr 2e-3
"""

from __future__ import annotations

import sys
from pathlib import Path

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


def main(argv: list[str]) -> int:
    parser = variant_parser(__doc__)
    parser.add_argument("teacher_run")
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    return run_variant(args, lambda: distill_command(args.cell, args.teacher_run, args.lr,
                                                     args.seed))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
