"""Step time of the tiny quickstart with this checkout's trainer against an earlier commit's,
measured side by side in one run (A/B/A/B... so drift in machine load hits both alike).

    .venv/bin/python bench/bench_trainer_overhead.py --before a748c7d [--rounds 3] [--steps 60]

The earlier commit is checked out into a temporary git worktree and run with this venv. Each
round trains examples/tiny_iiet.yaml (2 processes, torchrun) for --steps steps on the built-in
corpus, every step logged, no checkpoint or validation inside the timed steps; the table gives
the median step time over steps 11..N of each run, and the median over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(tree: Path, out: Path, steps: int) -> list[float]:
    overrides = {"schedule.train_steps": steps, "schedule.warmup_steps": 5,
                 "logging.log_interval": 1, "logging.progress_bar": "false",
                 "logging.tensorboard": "false", "checkpoint.save_interval": 0,
                 "eval.interval": 0, "logging.dir": str(out), "checkpoint.load": "null",
                 "data.builtin_dir": str(out.parent / f"builtin_{tree.name}")}
    args = [a for k, v in overrides.items() for a in ("--set", f"{k}={v}")]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(tree / "pretrain_iiet.py"), "--config", str(tree / "examples/tiny_iiet.yaml"), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(tree)}
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"run failed in {tree}:\n{proc.stderr[-3000:]}")
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r["step_s"] for r in map(json.loads, lines) if r["kind"] == "train" and r["step"] > 10]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--before", required=True, help="git revision of the earlier trainer")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_trainer_") as tmp:
        tmp = Path(tmp)
        before = tmp / "before"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(before),
                        args.before], check=True, capture_output=True)
        try:
            trees = {"before": before, "after": REPO}
            medians = {name: [] for name in trees}
            for r in range(args.rounds):
                for name, tree in trees.items():
                    times = run(tree, tmp / f"{name}_{r}", args.steps)
                    medians[name].append(statistics.median(times))
                    print(f"round {r + 1}/{args.rounds} {name:6s} median step "
                          f"{medians[name][-1] * 1e3:.1f} ms over {len(times)} steps", flush=True)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(before)],
                           capture_output=True)
    b, a = (statistics.median(medians[n]) for n in ("before", "after"))
    print("\n| trainer | median step (ms), per round | median of rounds (ms) |")
    print("|---|---|---|")
    for name in trees:
        per_round = ", ".join(f"{m * 1e3:.1f}" for m in medians[name])
        print(f"| {name} ({args.before if name == 'before' else 'HEAD'}) | {per_round} | "
              f"{statistics.median(medians[name]) * 1e3:.1f} |")
    print(f"\nafter / before: {a / b:.3f}")


if __name__ == "__main__":
    main()
