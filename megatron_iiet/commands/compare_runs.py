"""Compare training runs by their metrics.jsonl: final validation loss/perplexity, a table.

    python tools/compare_runs.py outputs/cpu_compare/vanilla outputs/cpu_compare/iiet \\
        --plot outputs/cpu_compare/compare.png

Each RUN is a logging.dir (holding metrics.jsonl) or a metrics.jsonl file. With --plot, and if
matplotlib is installed, it also writes a PNG of the validation and training loss curves
(matplotlib is optional: without it only the table is printed, and the script says so).
A restarted run appends to its metrics.jsonl; from the step it restarted at, its records replace
the earlier attempt's (``metrics_log.last_attempt``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from megatron_iiet.training.metrics_log import last_attempt


def read_run(spec: str) -> dict:
    path = Path(spec)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{spec}: no metrics.jsonl there")
    records = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            record["kind"], record["step"] = str(record["kind"]), int(record["step"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{lineno}: not a metrics record ({e})") from None
        records.append(record)
    train = {r["step"]: r for r in last_attempt(records, "train")}
    valid = {r["step"]: r for r in last_attempt(records, "valid")}
    name = path.parent.name if path.name == "metrics.jsonl" else path.stem
    return {"name": name, "path": str(path), "train": train, "valid": valid}


def summarize(run: dict, tail: int) -> dict:
    train, valid = run["train"], run["valid"]
    last_valid = valid[max(valid)] if valid else None
    last_losses = [r["loss"] for r in list(train.values())[-tail:]]
    seconds = sum(r.get("step_s", 0.0) for r in train.values())
    return {
        "run": run["name"],
        "steps": max(train) if train else 0,
        "valid_step": max(valid) if valid else None,
        "valid_loss": last_valid["loss"] if last_valid else None,
        "valid_ppl": (math.exp(last_valid["loss"]) if last_valid and last_valid["loss"] < 50
                      else None),
        "train_loss": sum(last_losses) / len(last_losses) if last_losses else None,
        # logged steps only: with logging.log_interval > 1 this undercounts the training time
        "logged_step_s": seconds / len(train) if train else None,
    }


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: list[dict], tail: int) -> None:
    header = ["run", "steps", "valid@step", "valid loss", "valid ppl",
              f"train loss (last {tail} logged)", "s/step"]
    lines = [[r["run"], str(r["steps"]), _fmt(r["valid_step"], "d"), _fmt(r["valid_loss"], ".4f"),
              _fmt(r["valid_ppl"], ".2f"), _fmt(r["train_loss"], ".4f"),
              _fmt(r["logged_step_s"], ".2f")] for r in rows]
    widths = [max(len(h), *(len(l[i]) for l in lines)) for i, h in enumerate(header)]
    print(" | ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("-|-".join("-" * w for w in widths))
    for l in lines:
        print(" | ".join(c.ljust(w) for c, w in zip(l, widths)))


def plot(runs: list[dict], out: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed; printed the table only (no plot written)")
        return False
    fig, (ax_valid, ax_train) = plt.subplots(1, 2, figsize=(12, 4.5))
    for run in runs:
        if run["valid"]:
            ax_valid.plot(list(run["valid"]), [r["loss"] for r in run["valid"].values()],
                          marker="o", label=run["name"])
        if run["train"]:
            ax_train.plot(list(run["train"]), [r["loss"] for r in run["train"].values()],
                          label=run["name"], linewidth=1)
    for ax, title in ((ax_valid, "validation loss"), (ax_train, "training loss")):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    print(f"plot: {out}")
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="RUN", help="logging.dir or metrics.jsonl")
    p.add_argument("--plot", metavar="PNG", help="write loss curves here (needs matplotlib)")
    p.add_argument("--tail", type=int, default=10,
                   help="average the training loss over this many last logged steps (default 10)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON lines instead")
    args = p.parse_args(argv)
    if args.tail < 1:
        print("error: --tail must be at least 1", file=sys.stderr)
        return 2
    try:
        runs = [read_run(r) for r in args.runs]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = [summarize(r, args.tail) for r in runs]
    if args.json:
        for row in rows:
            print(json.dumps(row))
    else:
        print_table(rows, args.tail)
    if args.plot:
        plot(runs, Path(args.plot))
    return 0


if __name__ == "__main__":  # python -m megatron_iiet.commands.compare_runs
    raise SystemExit(main())
