"""Scaling-law sweeps: plan, launch, collect, fit (docs/scaling.md).

    python tools/sweep.py plan examples/sweeps/cpu_ladder.yaml --dry-run
    python tools/sweep.py launch examples/sweeps/cpu_ladder.yaml [--jobs 2] [--nproc 2] [--phase 1 --task I]
    python tools/sweep.py submit examples/sweeps/paper_340m_1.3b.yaml [--max-parallel 8] [-- SBATCH ARGS]
    python tools/sweep.py collect examples/sweeps/cpu_ladder.yaml [--extra-valid NAME=PREFIX]
    python tools/sweep.py fit examples/sweeps/cpu_ladder.yaml [--valid NAME] [--bootstrap 200]

plan: the concrete runs (parameters, FLOPs per token with every pass, tokens, total FLOPs,
estimated time); errors in the sweep are one line before anything runs. launch: runs what is not
finished, resuming unfinished runs, phase 1 (the LR grid) then phase 2 (the grid's best LR
carried up), --jobs K runs at once; --task I runs the I-th run of --phase (a SLURM array
task); --retrain-committed also trains the runs finished only in the committed results, to
rebuild their checkpoints on this machine. submit: the same as SLURM array jobs of
slurm/sweep.sbatch, phase 2 after phase 1 (afterok). collect: results.json / results.csv (and
best_lr.json) in the sweep's output folder. fit: per architecture L(N, D) = E + A/N^alpha +
B/D^beta with bootstrap intervals and the compute frontier; writes fit.md and PNG plots next to
the results.
"""

import argparse
import sys
from pathlib import Path

from megatron_iiet.cli import run_tool
from megatron_iiet.errors import OperatorError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("plan", "launch", "submit", "collect", "fit"):
        s = sub.add_parser(name)
        s.add_argument("sweep", help="the sweep YAML")
        s.add_argument("--flops-per-second", type=float, default=None,
                       help="sustained FLOP/s per run for time estimates (default: measured)")
        if name == "plan":
            s.add_argument("--dry-run", action="store_true", help="print the table only")
            s.add_argument("--measure", action="store_true",
                           help="time the smallest run for a few steps here and estimate every "
                                "run from that (start-up included); default: a rough FLOP rate")
        if name == "launch":
            s.add_argument("--nproc", type=int, default=1, help="processes per run (torchrun)")
            s.add_argument("--jobs", type=int, default=1,
                           help="runs at once on this machine, each with cores/(jobs*nproc) "
                                "threads (small models use cores better side by side)")
            s.add_argument("--phase", type=int, choices=(1, 2), default=None)
            s.add_argument("--task", type=int, default=None,
                           help="only the TASK-th run of --phase (SLURM array index)")
            s.add_argument("--dry-run", action="store_true", help="print the commands")
            s.add_argument("--retrain-committed", action="store_true",
                           help="also train runs finished only in the committed results (their "
                                "folders are on another machine), to have their checkpoints here")
        if name == "submit":
            s.add_argument("--max-parallel", type=int, default=None,
                           help="array tasks running at once (sbatch --array=...%%K)")
            s.add_argument("--dry-run", action="store_true", help="print the sbatch commands")
        if name == "collect":
            s.add_argument("--extra-valid", action="append", default=[], metavar="NAME=PREFIX",
                           help="also score each final checkpoint on this dataset (repeatable)")
        if name == "fit":
            s.add_argument("--valid", default=None,
                           help="which validation loss to fit (an --extra-valid NAME of collect; "
                                "default: the run's own validation)")
            s.add_argument("--bootstrap", type=int, default=200)
    return p


def _rate(args) -> float:
    if args.flops_per_second:
        return args.flops_per_second
    import torch

    from megatron_iiet.training.metrics import measured_peak_flops

    # a training step sustains about a third of a large matmul's rate on CPU (measured with
    # bench/bench_training.py); the estimate is a guide, not a promise
    return measured_peak_flops(torch.float32) / 3


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    sbatch_args = argv[argv.index("--") + 1:] if "--" in argv else []  # submit's: for sbatch
    args = build_parser().parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if sbatch_args and args.command != "submit":
        raise SystemExit("error: arguments after -- are for `submit` (sbatch options)")
    args.sbatch_args = sbatch_args
    return run_tool(run, args)


def run(args) -> int:
    from megatron_iiet.sweep.plan import plan_sweep, plan_table

    if args.command == "launch" and args.task is not None and args.phase is None:
        raise OperatorError("--task needs --phase (the index counts the runs of one phase)")
    try:
        plan = plan_sweep(args.sweep, _rate(args) if args.command == "plan" else 1.0)
    except ValueError as err:
        raise OperatorError(f"{args.sweep}: {err}") from None
    if args.command == "plan":
        if args.measure:
            import dataclasses

            from megatron_iiet.sweep.runner import calibrate

            try:
                pace = calibrate(plan)
            except RuntimeError as err:
                raise OperatorError(str(err)) from None
            print(f"measured: {pace.seconds_per_flop * 1e12:.3g} s per TFLOP at the smallest "
                  f"run, {pace.overhead_s:.0f} s per run besides its steps")
            plan.runs[:] = [dataclasses.replace(r, estimated_seconds=pace.estimate(r))
                            for r in plan.runs]
        print(plan_table(plan))
        if not args.dry_run:
            from megatron_iiet.data.atomic import write_bytes_atomic

            out = Path(plan.spec.output)
            out.mkdir(parents=True, exist_ok=True)
            write_bytes_atomic(out / "plan.md", (plan_table(plan) + "\n").encode())
            print(f"wrote {out / 'plan.md'}")
        return 0
    if args.command == "launch":
        from megatron_iiet.sweep.runner import launch

        try:
            if args.jobs < 1:
                raise ValueError(f"--jobs {args.jobs}: at least 1")
            launch(plan, nproc=args.nproc, phase=args.phase, task=args.task, jobs=args.jobs,
                   dry_run=args.dry_run, retrain_committed=args.retrain_committed)
        except ValueError as err:
            raise OperatorError(str(err)) from None
        except RuntimeError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        return 0
    if args.command == "submit":
        from megatron_iiet.sweep.runner import submit_slurm

        try:
            submit_slurm(plan, args.sweep, sbatch_args=args.sbatch_args,
                         max_parallel=args.max_parallel, dry_run=args.dry_run)
        except RuntimeError as err:
            raise OperatorError(str(err)) from None
        return 0
    if args.command == "collect":
        from megatron_iiet.sweep.runner import ExtraValid, collect

        extra = []
        for text in args.extra_valid:
            name, _, prefix = text.partition("=")
            if not name or not prefix:
                raise OperatorError(f"--extra-valid {text}: expected NAME=PREFIX")
            extra.append(ExtraValid(name, prefix))
        results = collect(plan, extra)
        done = sum(r["status"] == "finished" for r in results)
        print(f"{done} of {len(results)} runs finished; wrote {plan.spec.output}/results.json, "
              "results.csv")
        return 0
    return _fit(plan, args)


def _fit(plan, args) -> int:
    import json

    from megatron_iiet.data.atomic import write_bytes_atomic
    from megatron_iiet.sweep import compare, fit

    out = Path(plan.spec.output)
    results_file = out / "results.json"
    if not results_file.is_file():
        raise OperatorError(f"{results_file}: not there; run `tools/sweep.py collect` first")
    key = f"valid_loss_{args.valid}" if args.valid else "valid_loss"
    rows = [dict(r, loss=r[key]) for r in json.loads(results_file.read_text())
            if r["status"] == "finished" and r.get(key) is not None]
    if not rows:
        raise OperatorError(f"{results_file}: no finished run has {key}")
    comparison = compare.equal_tokens_table(rows, _loss_columns(rows))
    rows = compare.best_lr_rows(rows)
    sweep_fit = fit.fit_sweep(rows, n_boot=args.bootstrap)
    suffix = f"_{args.valid}" if args.valid else ""
    fit.plot_loss_vs_flops(rows, sweep_fit, out / f"loss_vs_flops{suffix}.png")
    fit.plot_loss_vs_tokens(rows, out / f"loss_vs_tokens{suffix}.png")
    unfitted = [a for a in sweep_fit.architectures.values() if a.fit is None]
    if len(unfitted) == len(sweep_fit.architectures):  # no law: a residual plot would be empty
        print("no scaling law could be fitted: " + "; ".join(f"{a.architecture}: {a.reason}"
                                                             for a in unfitted))
    else:
        fit.plot_residuals(rows, sweep_fit, out / f"residuals{suffix}.png")
    text = ("## Loss at equal tokens (each cell at its best LR)\n\n" + comparison + "\n"
            + fit.report_markdown(rows, sweep_fit))
    write_bytes_atomic(out / f"fit{suffix}.md", text.encode())
    print(text)
    plots = "loss_vs_flops, loss_vs_tokens" + ("" if len(unfitted) == len(sweep_fit.architectures)
                                                else ", residuals")
    print(f"wrote {out}/fit{suffix}.md and the PNG plots ({plots})")
    return 0


def _loss_columns(rows) -> dict[str, str]:
    """Column title -> result key: the in-domain validation loss, then each extra set."""
    extra = sorted({k for r in rows for k in r if k.startswith("valid_loss_")})
    return {"valid": "valid_loss", **{k[len("valid_loss_"):]: k for k in extra}}


if __name__ == "__main__":  # python -m megatron_iiet.commands.sweep
    raise SystemExit(main())
