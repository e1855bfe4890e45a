"""End-to-end training throughput, checkpoint cost and ZeRO optimizer memory, in one run.

    .venv/bin/python bench/bench_training.py [--steps 12] [--out outputs/bench_training]

Every measurement is a real `pretrain_iiet.py` run (fresh processes, gloo on CPU) on the
built-in corpus; numbers come from the runs' metrics.jsonl:
1. tokens/s and MFU of vanilla / pcformer_rk2 / iiet (r=3) at one size, 1 and 2 processes (DP);
2. checkpoint save time and size, and load time (a resumed run), per architecture;
3. optimizer state per rank with DeepSpeed ZeRO 1/2/3 at DP=2, against DP=1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(overrides: dict, nproc: int) -> None:
    args = []
    for k, v in overrides.items():
        args += ["--set", f"{k}={v}"]
    script = str(REPO / "pretrain_iiet.py")
    cmd = ([sys.executable, script] if nproc == 1 else
           [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", script]) + args
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, 2 // nproc)), "PYTHONWARNINGS": "ignore",
           "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"run failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")


def records(log_dir: Path, kind: str) -> list[dict]:
    lines = (log_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--out", default="outputs/bench_training")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    args = p.parse_args(argv)

    from megatron_iiet.data.prepare import prepare_builtin_corpus

    out = (REPO / args.out).resolve()
    data = prepare_builtin_corpus(str(out / "data"), vocab_size=2048, corpus_size="2MB")
    base = {
        "data.train": data.data_prefix, "data.tokenizer": data.tokenizer_model,
        "data.seq_length": args.seq, "data.num_workers": 1, "data.split": "90,10,0",
        "data.cache_dir": str(out / "cache"),
        "model.hidden_size": args.hidden, "model.num_layers": args.layers,
        "model.num_attention_heads": 4, "model.ffn_hidden_size": args.hidden * 11 // 4,
        "schedule.train_steps": args.steps, "schedule.warmup_steps": 2,
        "parallel.micro_batch_size": 4, "parallel.global_batch_size": 8,
        "logging.progress_bar": "false", "logging.tensorboard": "false", "eval.steps": 1,
    }
    print(f"model: hidden {args.hidden}, {args.layers} layers, seq {args.seq}, global batch 8, "
          f"fp32, {args.steps} steps (median over steps 3..end)\n")

    throughput, checkpoints = [], []
    for arch in ("vanilla", "pcformer_rk2", "iiet"):
        for nproc in (1, 2):
            log = out / f"{arch}_np{nproc}"
            run({**base, "model.architecture": arch, "logging.dir": str(log),
                 "checkpoint.load": "null"}, nproc)
            steps = records(log, "train")[2:]
            throughput.append((arch, nproc, statistics.median(r["tokens_per_s"] for r in steps),
                               statistics.median(r["mfu"] for r in steps)))
            if nproc == 1:
                save = records(log, "checkpoint")[-1]
                run({**base, "model.architecture": arch, "logging.dir": str(log),
                     "schedule.train_steps": args.steps + 1}, nproc)
                load = records(log, "resume")[-1]
                checkpoints.append((arch, save["seconds"], save["bytes"], load["seconds"]))
            print(f"  measured {arch} x{nproc}", flush=True)

    zero = []
    for stage in (1, 2, 3):
        per_dp = {}
        for nproc in (1, 2):
            log = out / f"zero{stage}_np{nproc}"
            run({**base, "model.architecture": "iiet", "parallel.engine": "deepspeed",
                 "parallel.zero_stage": stage, "schedule.train_steps": 3,
                 "logging.dir": str(log), "checkpoint.load": "null"}, nproc)
            per_dp[nproc] = records(log, "train")[-1]["optimizer_state_mb"]
        zero.append((stage, per_dp[1], per_dp[2]))
        print(f"  measured ZeRO-{stage}", flush=True)

    vanilla = {n: t for a, n, t, _ in throughput if a == "vanilla"}
    print("\n| architecture | processes | tokens/s | x vanilla | MFU |")
    print("|---|---|---|---|---|")
    for arch, nproc, tps, mfu in throughput:
        print(f"| {arch} | {nproc} | {tps:.0f} | {tps / vanilla[nproc]:.2f} | {mfu:.1%} |")
    print("\n| architecture | save s | checkpoint MB | load s |")
    print("|---|---|---|---|")
    for arch, save_s, size, load_s in checkpoints:
        print(f"| {arch} | {save_s:.2f} | {size / 2**20:.1f} | {load_s:.2f} |")
    print("\n| ZeRO stage | optimizer state MB/rank, DP=1 | DP=2 | ratio |")
    print("|---|---|---|---|")
    for stage, one, two in zero:
        print(f"| {stage} | {one:.2f} | {two:.2f} | {two / one:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
