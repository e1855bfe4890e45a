"""IIAD step 1: how much each iteration of a trained IIET matters (spec 6.1).

    torchrun --nproc-per-node 2 tools/iiad_influence.py --checkpoint RUN/checkpoints \
        --data data/valid_text_document --batches 8 --batch-size 4 --output iiad/run1 [--tp 2]

For every layer l and iteration i: the ablation influence I[l,i] (loss increase when layer l runs
i-1 iterations instead of its full plan, all other layers full; the model's own LM loss on the
same calibration batches) and, for the history form, the relative update
||S_l^(i) - S_l^(i-1)|| / ||S_l^(i-1)||. The checkpoint loads at any TP/PP (resharded);
ablations are spread over the data-parallel replicas. Writes OUTPUT/influence.json (read by
tools/iiad_plan.py), influence.md and influence.png (heat-maps, layers x iterations).
Details: docs/iiad.md.
"""

import argparse
import sys
import time
from pathlib import Path

from megatron_iiet.cli import run_tool
from megatron_iiet.errors import OperatorError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="iter_* folder or a checkpoint root")
    p.add_argument("--data", required=True, help="preprocessed dataset prefix (PREFIX.bin/.idx)")
    p.add_argument("--batches", type=int, default=8, help="calibration batches")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=None, help="default: the model's")
    p.add_argument("--offset-tokens", type=int, default=0, help="where in the data to start")
    p.add_argument("--output", type=Path, required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--no-progress", action="store_true")
    return p


class Progress:
    """A tqdm bar with ETA over this replica's ablations (rank 0 only)."""

    def __init__(self, enabled: bool):
        self.bar = None
        self.enabled = enabled

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="ablations", unit="run", file=sys.stderr)
        self.bar.update(done - self.bar.n)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def heat_map(report, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    panels = [("ablation influence (loss increase)", report.influence)]
    if report.relative_update is not None:
        panels.append(("relative update ||S(i)-S(i-1)|| / ||S(i-1)||", report.relative_update))
    width = max(len(row) for row in report.influence) or 1
    fig, axes = plt.subplots(1, len(panels), figsize=(3 + 2.2 * width * len(panels),
                                                      1.5 + 0.28 * len(report.influence)),
                             squeeze=False)
    for ax, (title, rows) in zip(axes[0], panels):
        grid = np.full((len(rows), width), np.nan)
        for layer, row in enumerate(rows):
            grid[layer, :len(row)] = row
        image = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("iteration")
        ax.set_ylabel("layer")
        ax.set_xticks(range(width), [str(i + 1) for i in range(width)])
        ax.set_yticks(range(len(rows)), [str(i + 1) for i in range(len(rows))], fontsize=7)
        fig.colorbar(image, ax=ax)
    fig.suptitle(f"IIET iteration influence: {Path(report.checkpoint).name}", fontsize=10)
    fig.tight_layout()
    import io

    from megatron_iiet.data.atomic import write_bytes_atomic

    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    plt.close(fig)
    write_bytes_atomic(path, png.getvalue())


def markdown(report) -> str:
    cal = report.calibration
    lines = [f"# Iteration influence: {report.checkpoint}", "",
             f"{report.architecture} ({report.formulation}), iterations {report.iterations}; "
             f"calibration: {cal['batches']} x {cal['batch_size']} x {cal['seq_length']} tokens of "
             f"{cal['data']}; full-model loss {report.base_loss:.5f}; {cal['seconds']:.0f} s.", "",
             "| layer | iteration | influence (loss increase) | relative update |",
             "|---|---|---|---|"]
    for layer, row in enumerate(report.influence, start=1):
        for i, value in enumerate(row, start=1):
            proxy = (f"{report.relative_update[layer - 1][i - 1]:.4f}"
                     if report.relative_update is not None else "-")
            lines.append(f"| {layer} | {i} | {value:+.5f} | {proxy} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    return run_tool(run, build_parser().parse_args(argv), distributed=True)


def run(args) -> int:
    import torch.distributed as dist

    from megatron_iiet.data.errors import DataInputError
    from megatron_iiet.distributed import initialize
    from megatron_iiet.eval.checkpoint import load_for_inference
    from megatron_iiet.iiad.influence import (InfluenceReport, calibration_batches,
                                              measure_influence)
    from megatron_iiet.model.architectures import get_architecture

    for name in ("batches", "batch_size"):
        if getattr(args, name) < 1:
            raise OperatorError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    initialize(args.tp, args.pp)
    loaded = load_for_inference(args.checkpoint)
    model, cfg = loaded.model, loaded.model.config
    architecture = get_architecture(cfg.architecture, cfg.formulation)
    if not architecture.iterates:
        raise OperatorError(f"--checkpoint {loaded.path}: a {architecture.key} model has no "
                            "iterations to measure (IIAD needs an IIET checkpoint)")
    seq = args.seq_length or loaded.max_length
    if seq > loaded.max_length:
        raise OperatorError(f"--seq-length {seq}: the model's maximum is {loaded.max_length}")
    try:
        batches = calibration_batches(args.data, args.batches, args.batch_size, seq,
                                      args.offset_tokens)
    except DataInputError as err:
        raise OperatorError(str(err)) from None
    plan = list(cfg.layer_iterations)
    started = time.perf_counter()
    progress = Progress(dist.get_rank() == 0 and not args.no_progress)
    base, influence, relative = measure_influence(model, batches, plan,
                                                  history_form=architecture.uses_history,
                                                  progress=progress)
    progress.close()
    if dist.get_rank() != 0:
        return 0
    report = InfluenceReport(
        checkpoint=str(loaded.path), architecture=cfg.architecture, formulation=cfg.formulation,
        iterations=plan, base_loss=base, influence=influence, relative_update=relative,
        calibration={"data": str(args.data), "batches": args.batches,
                     "batch_size": args.batch_size, "seq_length": seq,
                     "offset_tokens": args.offset_tokens,
                     "seconds": time.perf_counter() - started,
                     "world_size": dist.get_world_size(), "tp": args.tp, "pp": args.pp})
    args.output.mkdir(parents=True, exist_ok=True)
    report.write(args.output / "influence.json")
    from megatron_iiet.data.atomic import write_bytes_atomic

    write_bytes_atomic(args.output / "influence.md", markdown(report).encode("utf-8"))
    heat_map(report, args.output / "influence.png")
    print(markdown(report))
    print(f"wrote {args.output}/influence.json, influence.md, influence.png")
    return 0


if __name__ == "__main__":  # python -m megatron_iiet.commands.iiad_influence
    raise SystemExit(main())
