"""IIAD step 2: an E-IIET iteration plan from measured influences (spec 6.2).

    python tools/iiad_plan.py --influence iiad/run1 --threshold 0.01 --output e-iiet.yaml
    python tools/iiad_plan.py --influence iiad/run1 --target-passes 40 --output e-iiet.yaml
    python tools/iiad_plan.py --influence iiad/run1 --target-speedup 1.5 --output e-iiet.yaml

Each layer keeps the smallest number of iterations such that every dropped iteration has
influence below tau; with --target-passes / --target-speedup, tau is the smallest threshold that
reaches the target. Prints the plan (passes kept, predicted FLOP and decode-time saving) and
writes OUTPUT: the checkpoint's own training config with `model.iterations` set to the plan, the
IIET weights as the starting point (`checkpoint.init_from`) and a `distill:` section whose
teacher is the full IIET (`--teacher` to name others, `--no-distill` for plain continued training
of the pruned student), a config that `pretrain_iiet.py --config OUTPUT` runs (and resumes);
plus OUTPUT's name with .md (the table) and .json.
Details: docs/iiad.md.
"""

import argparse
from pathlib import Path

from megatron_iiet.cli import run_tool
from megatron_iiet.errors import OperatorError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--influence", type=Path, required=True,
                   help="influence.json of tools/iiad_influence.py, or its folder")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--threshold", type=float, help="tau: drop iterations with influence < tau")
    target.add_argument("--target-passes", type=int, help="total passes per token at most")
    target.add_argument("--target-speedup", type=float,
                        help="predicted decode speed-up over the full plan at least")
    p.add_argument("--checkpoint", default=None,
                   help="the IIET checkpoint (default: the one the influence was measured on)")
    p.add_argument("--context", type=int, default=None,
                   help="context length for the FLOPs per token (default: the model's)")
    p.add_argument("--output", type=Path, required=True, help="the E-IIET config (YAML)")
    p.add_argument("--teacher", action="append", default=[], metavar="CKPT[=WEIGHT]",
                   help="a distillation teacher (repeatable; default: the IIET checkpoint, "
                        "weight 1)")
    p.add_argument("--no-distill", action="store_true",
                   help="no teachers: continued training of the pruned student alone")
    p.add_argument("--train-steps", type=int, default=None,
                   help="schedule.train_steps of the student (default: the IIET's)")
    p.add_argument("--run-dir", default=None,
                   help="logging.dir of the E-IIET run (default: outputs/<OUTPUT's stem>)")
    return p


def main(argv=None) -> int:
    return run_tool(run, build_parser().parse_args(argv))


def teachers(args, ckpt) -> list[dict]:
    out = []
    for text in args.teacher or [str(Path(ckpt).resolve())]:
        path, _, weight = text.partition("=")
        try:
            out.append({"checkpoint": path, "weight": float(weight) if weight else 1.0})
        except ValueError:
            raise OperatorError(f"--teacher {text}: expected CKPT or CKPT=WEIGHT") from None
    return out


def run(args) -> int:
    import json

    import yaml

    from megatron_iiet.data.atomic import write_bytes_atomic, write_json_atomic
    from megatron_iiet.iiad.influence import InfluenceReport
    from megatron_iiet.iiad.planner import Planner, PlanError, table
    from megatron_iiet.training.checkpoint_index import (CheckpointError, read_meta,
                                                         resolve_checkpoint)
    from megatron_iiet.training.checkpoint_meta import model_config_from

    path = args.influence / "influence.json" if args.influence.is_dir() else args.influence
    try:
        report = InfluenceReport.read(path)
    except FileNotFoundError:
        raise OperatorError(f"--influence {path}: no such file (run tools/iiad_influence.py)")
    except (ValueError, TypeError) as err:
        raise OperatorError(f"--influence {path}: not an influence report ({err})") from None
    try:
        ckpt = resolve_checkpoint(args.checkpoint or report.checkpoint)
        meta = read_meta(ckpt)
    except (CheckpointError, FileNotFoundError) as err:
        raise OperatorError(f"--checkpoint: {err}") from None
    model_cfg = model_config_from(meta, ckpt, error=OperatorError)
    if list(model_cfg.layer_iterations) != list(report.iterations):
        raise OperatorError(f"--checkpoint {ckpt}: iterations {list(model_cfg.layer_iterations)}, "
                            f"but the influence was measured with {report.iterations}")
    planner = Planner(report.influence, model_cfg, args.context or model_cfg.max_sequence_length)
    try:
        if args.threshold is not None:
            plan = planner.plan(args.threshold)
        elif args.target_passes is not None:
            plan = planner.for_passes(args.target_passes)
        else:
            plan = planner.for_speedup(args.target_speedup)
    except PlanError as err:
        raise OperatorError(str(err)) from None

    config = json.loads(json.dumps(meta.config))  # a plain copy
    config["model"]["iterations"] = plan.iterations
    config.setdefault("checkpoint", {}).update(
        {"load": "auto", "load_model_only": False, "init_from": str(Path(ckpt).resolve()),
         "dir": None, "overwrite": False})
    config["distill"] = {"teachers": [] if args.no_distill else teachers(args, ckpt)}
    if args.train_steps is not None:
        schedule = config.setdefault("schedule", {})
        schedule["train_steps"] = args.train_steps
        schedule["warmup_steps"] = min(schedule.get("warmup_steps", 10), args.train_steps - 1)
    config.setdefault("logging", {})["dir"] = args.run_dir or f"outputs/{args.output.stem}"
    header = (f"# E-IIET plan from {path} (tools/iiad_plan.py): tau {plan.tau:.6g}, "
              f"{plan.passes} of {plan.full_passes} passes,\n# predicted FLOP saving "
              f"{plan.flops_saving:.1%}, decode-time saving {plan.decode_saving:.1%}.\n"
              "# The student starts from the IIET weights with the pruned loop"
              + (".\n" if args.no_distill else "\n# and distils from distill.teachers.\n"))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(args.output, (header + yaml.safe_dump(config, sort_keys=False)).encode())
    text = table(plan, report.influence)
    write_bytes_atomic(args.output.with_suffix(".md"), (text + "\n").encode())
    write_json_atomic(args.output.with_suffix(".json"), {
        "tau": plan.tau, "iterations": plan.iterations, "passes": plan.passes,
        "full_passes": plan.full_passes, "flops_saving": plan.flops_saving,
        "decode_saving": plan.decode_saving, "influence": str(path), "checkpoint": str(ckpt)})
    print(text)
    print(f"\nwrote {args.output} (run it: python pretrain_iiet.py --config {args.output})")
    return 0


if __name__ == "__main__":  # python -m megatron_iiet.commands.iiad_plan
    raise SystemExit(main())
