"""CPU step time with and without flushing subnormal floats (`parallel.flush_denormals`), from
the same checkpoint of a trained-regime run, side by side (A/B/A/B... so drift in machine load
hits both alike), and whether the two modes train to the same bits.

    bash examples/trained_regime.sh prepare      # the data, once
    .venv/bin/python bench/bench_denormals.py [--warm-steps 500] [--steps 50] [--rounds 2]

First trains s (3 x 96) PCformer-RK2 as in examples/sweeps/trained/s_20tpp_warmup.yaml (LR
1.6e-2) for --warm-steps steps, past the point where its step time rises; then each round
resumes that checkpoint once per mode for --steps steps and saves. The table gives the median
step time over each resumed run's steps and whether every logged loss and the saved weights and
optimizer state are byte-identical between the modes.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "outputs/cpu_compare/data"


def s_pcformer(log_dir: Path, steps: int, flush: bool) -> list[str]:
    values = {
        "model.num_layers": 3, "model.hidden_size": 96, "model.num_attention_heads": 3,
        "model.ffn_hidden_size": 272, "model.architecture": "pcformer_rk2", "seed": 1234,
        "data.train": DATA / "gutenberg_train_long", "data.valid": DATA / "gutenberg_heldout",
        "data.cache_dir": REPO / "outputs/sweeps/trained_data_cache",
        "parallel.global_batch_size": 16, "parallel.micro_batch_size": 16,
        "data.seq_length": 256, "schedule.train_steps": 3611, "schedule.warmup_steps": 361,
        "optimizer.lr": 0.016, "optimizer.min_lr": 0.0016, "schedule.exit_interval": steps,
        "checkpoint.save_interval": 0, "eval.interval": 0, "logging.log_interval": 1,
        "logging.progress_bar": "false", "logging.tensorboard": "false",
        "logging.dir": log_dir, "checkpoint.load": "auto", "parallel.flush_denormals": flush,
    }
    text = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in values.items()}
    return [a for k, v in text.items() for a in ("--set", f"{k}={v}")]


def train(log_dir: Path, steps: int, flush: bool, threads: int) -> list[dict]:
    cmd = [sys.executable, str(REPO / "pretrain_iiet.py"), "--config",
           str(REPO / "examples/cpu_compare_iiet.yaml"), *s_pcformer(log_dir, steps, flush)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONWARNINGS": "ignore",
           "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"training failed:\n{proc.stderr[-3000:]}")
    lines = (log_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "train"]


def saved_state(log_dir: Path) -> Path:
    latest = (log_dir / "checkpoints/latest").read_text().strip()
    return log_dir / "checkpoints" / latest


def same_bytes(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.glob("*.distcp"))
    return bool(names) and all(filecmp.cmp(a / n, b / n, shallow=False) for n in names)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--warm-steps", type=int, default=500)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    if not (DATA / "gutenberg_train_long.bin").exists():
        print(f"error: {DATA}/gutenberg_train_long.bin not found: run `bash "
              "examples/trained_regime.sh prepare` first", file=sys.stderr)
        raise SystemExit(2)
    with tempfile.TemporaryDirectory(prefix="bench_denormals_") as tmp:
        tmp = Path(tmp)
        print(f"training {args.warm_steps} steps to the checkpoint both modes resume ...",
              flush=True)
        warm = train(tmp / "warm", args.warm_steps, True, args.threads)
        print(f"  step time over its last 50 steps: "
              f"{statistics.median(r['step_s'] for r in warm[-50:]):.3f} s (flushed)")
        modes = {"subnormals kept": False, "flushed (default)": True}
        medians = {m: [] for m in modes}
        runs = {}
        for r in range(args.rounds):
            for mode, flush in modes.items():
                out = tmp / f"{flush}_{r}"
                shutil.copytree(tmp / "warm/checkpoints", out / "checkpoints")
                rows = train(out, args.steps, flush, args.threads)
                medians[mode].append(statistics.median(x["step_s"] for x in rows))
                runs[mode] = (out, [(x["loss"], x["grad_norm"]) for x in rows])
                print(f"  round {r + 1} {mode}: {medians[mode][-1]:.3f} s/step", flush=True)
        (a, losses_a), (b, losses_b) = runs.values()
        kept, flushed = (statistics.median(v) for v in medians.values())
        print(f"\nstep time, s PCformer-RK2 at steps {args.warm_steps + 1}.."
              f"{args.warm_steps + args.steps}, {args.threads} threads, median of {args.rounds} "
              "rounds:")
        print("| mode | s/step | per round |\n|---|---|---|")
        for mode, values in medians.items():
            print(f"| {mode} | {statistics.median(values):.3f} | "
                  f"{' / '.join(f'{v:.3f}' for v in values)} |")
        print(f"\nflushed / kept: {flushed / kept:.2f}x the time ({kept / flushed:.2f}x faster)")
        print(f"losses and gradient norms identical at every step: {losses_a == losses_b}")
        print(f"saved weights and optimizer state byte-identical: "
              f"{same_bytes(saved_state(a), saved_state(b))}")


if __name__ == "__main__":
    main()
