"""Issue 31.2, which part of the release's recipe moves a model: a run of a release-recipe cell
(`examples/sweeps/trained/CELL_release.yaml`) with one of the recipe's three changes put back to
ours, i.e. to what the paired cell CELL.yaml trains with, everything else (architecture, LR,
seed, data order, tokens) as in that run, so that the difference to it is paired. The parts:

    beta2      AdamW beta2 (release 0.999, ours 0.95)
    decay      weight decay (release 0, ours 0.1)
    schedule   the decay and its floor (release linear to 0, ours cosine to 10% of the LR)

    python examples/recipe_ablation.py CELL ARCH --lr LR --ours PART [--seed S] [--set KEY=VALUE]
                                       [--dry-run | --collect]
    # e.g. python examples/recipe_ablation.py xs_20tpp_release iiet --lr 2e-3 --ours beta2
    # and, with clipping off: ... --ours beta2 --set optimizer.clip_grad=0
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from two_stage import cell_plan, run_variant, variant_command, variant_parser

from megatron_iiet.errors import OperatorError

PARTS = ("beta2", "decay", "schedule")


def ours(cell: str, part: str, lr: float) -> dict:
    """The overrides that put ``part`` back to the recipe of the cell the release cell pairs with
    (its base config with its `set:`, and its LR floor), read from that cell's sweep file."""
    from megatron_iiet.sweep.plan import as_sets
    from megatron_iiet.training.config import load_config

    if not cell.endswith("_release"):
        raise OperatorError(f"{cell}: not a release-recipe cell (CELL_release.yaml)")
    plan = cell_plan(cell.removesuffix("_release"))  # a missing one: a one-line BadInput
    cfg = load_config(str(plan.base_path), as_sets(plan.spec.set), here=False)
    return {"beta2": {"optimizer.beta2": cfg.optimizer.beta2},
            "decay": {"optimizer.weight_decay": cfg.optimizer.weight_decay},
            "schedule": {"schedule.decay_style": cfg.schedule.decay_style,
                         "optimizer.min_lr": lr * plan.spec.lr.min_lr_ratio}}[part]


def ablation_command(cell: str, architecture: str, lr: float, part: str, seed: int,
                     also: tuple[str, ...] = ()) -> tuple[list[str], Path, dict]:
    plan = cell_plan(cell)
    run = next((r for r in plan.runs if r.architecture == architecture and r.grid), None)
    if run is None:
        raise OperatorError(f"{cell}: has no {architecture} run "
                            f"({', '.join(sorted({r.architecture for r in plan.runs}))})")
    from megatron_iiet.training.config import parse_override

    extra = dict(parse_override(text) for text in also)  # pretrain_iiet.py's own --set parser
    # the further overrides are part of the run's name, so that each variant has its own folder
    suffix = "".join("_" + re.sub(r"[^A-Za-z0-9._-]", "-", f"{k.rsplit('.', 1)[-1]}{v}")
                     for k, v in extra.items())
    folder = (Path(plan.spec.output) / "runs"
              / f"ours_{part}_{architecture}_lr{lr:g}_s{seed}{suffix}")
    info = {"architecture": architecture, "ours": part, "also": extra, "lr": lr, "seed": seed,
            "train_steps": run.train_steps, "tokens": run.tokens, "flops": run.total_flops}
    overrides = {"seed": seed, **ours(cell, part, lr), **extra}
    return variant_command(plan, run, folder, lr, overrides), folder, info


def main(argv: list[str]) -> int:
    parser = variant_parser(__doc__)
    parser.add_argument("architecture")
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--ours", choices=PARTS, required=True,
                        help="the part of the recipe put back to ours")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a further override, e.g. optimizer.clip_grad=0 (in the run's name)")
    args = parser.parse_args(argv)
    return run_variant(args, lambda: ablation_command(args.cell, args.architecture, args.lr,
                                                      args.ours, args.seed, tuple(args.set)))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
