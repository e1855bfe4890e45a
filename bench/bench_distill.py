#!/usr/bin/env python
"""The distillation step against a plain step: time and memory per teacher configuration.

    .venv/bin/python bench/bench_distill.py [--layers 4 --hidden 128 --seq 256 --micro-batch 8]

One thread, fp32: a student E-IIET step (forward + backward over --micro-batches, megatron's
schedule, the trainer's objective; the optimizer step is the same in every row and left out)
with no teacher, one live teacher (the full IIET), two live teachers (IIET and PCformer-RK2) and
one offline top-k teacher (precomputed logits read from shards). Time: one process builds every
row and runs their steps round-robin (background load hits them alike), median of --steps after
--warmup. Memory: each row again in its own child process, whose peak RSS is its own. Prints a
table (step time, its ratio to the plain step, the teachers' share, peak RSS, teacher parameters
and logits held).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROWS = ["plain", "iiet", "iiet+pcformer", "offline top-k"]


def build(arch, args, iterations=None, seed=1234):
    from megatron_iiet.model.config import preset
    from megatron_iiet.model.gpt import IIETGPTModel
    from megatron_iiet.model.sharding import init_layout_independent

    cfg = preset("tiny", architecture=arch, iterations=iterations, num_layers=args.layers,
                 hidden_size=args.hidden, num_attention_heads=4, ffn_hidden_size=args.hidden * 11 // 4,
                 vocab_size=args.vocab, max_sequence_length=args.seq)
    model = IIETGPTModel(cfg)
    init_layout_independent(model, seed=seed)
    return model


def setup(args, row: str):
    """(student, objective or None, micro-batches, keep-alive) of one row."""
    import torch

    from megatron_iiet.iiad.distill import DistillationObjective, LiveTeacher
    from megatron_iiet.iiad.kl import vocab_parallel_topk
    from megatron_iiet.iiad.teacher_logits import OfflineTeacher, shard_bytes

    g = torch.Generator().manual_seed(0)
    batches = []
    for i in range(args.micro_batches):
        tokens = torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), generator=g)
        batches.append({"input_ids": tokens[:, :-1].contiguous(),
                        "labels": tokens[:, 1:].contiguous(),
                        "loss_mask": torch.ones(args.micro_batch, args.seq),
                        "sample_index": torch.arange(i * args.micro_batch,
                                                     (i + 1) * args.micro_batch)})
    plan = [int(x) for x in args.plan.split(",")]
    student = build("iiet", args, plan)
    teachers = []
    if row in ("iiet", "iiet+pcformer", "offline top-k"):
        full = build("iiet", args).eval().requires_grad_(False)
        teachers.append(LiveTeacher("iiet", 1.0, full, "-", "iiet"))
    if row == "iiet+pcformer":
        pcf = build("pcformer_rk2", args, seed=7).eval().requires_grad_(False)
        teachers.append(LiveTeacher("pcformer", 0.5, pcf, "-", "pcformer_rk2"))
    tmp = None
    if row == "offline top-k":
        tmp = tempfile.TemporaryDirectory()
        ids, values, sums = [], [], []
        with torch.no_grad():
            for b in batches:
                i, v = vocab_parallel_topk(teachers[0].model(b["input_ids"]), args.top_k)
                ids.append(i)
                values.append(v.to(torch.bfloat16))
                sums.append(b["input_ids"].sum(-1))
        Path(tmp.name, "shard_00000.pt").write_bytes(
            shard_bytes(torch.cat(ids), torch.cat(values), torch.cat(sums), 0))
        del teachers[0].model
        teachers = [OfflineTeacher("iiet_topk", 1.0, Path(tmp.name),
                                   {"shard_samples": args.micro_batches * args.micro_batch},
                                   "bench")]
    objective = DistillationObjective(teachers) if teachers else None
    return student, objective, batches, tmp


def _init_one_process(torch):
    from megatron_iiet.distributed import free_port, initialize

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                      WORLD_SIZE="1")
    initialize(1, 1)


def step(student, objective, batches) -> float:
    from megatron_iiet.training.step import forward_backward

    student.zero_grad()
    t0 = time.perf_counter()
    forward_backward(student, batches, objective=objective)
    return time.perf_counter() - t0


def memory_child(args) -> dict:
    """One row alone: its peak RSS after a few steps, and what its teachers hold."""
    import resource

    import torch

    from megatron_iiet.iiad.distill import LiveTeacher

    _init_one_process(torch)
    student, objective, batches, _keep = setup(args, args.row)
    for _ in range(2):
        step(student, objective, batches)
    live = [t for t in (objective.teachers if objective else []) if isinstance(t, LiveTeacher)]
    return {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "teacher_params_mb": sum(t.parameter_bytes() for t in live) / 2**20,
            "teacher_logits_mb": (objective.peak_logits_bytes / 2**20) if objective else 0.0}


def timing_child(args) -> dict:
    """Every row in one process, steps round-robin."""
    import torch

    _init_one_process(torch)
    rows = {row: setup(args, row) for row in ROWS}
    times = {row: [] for row in ROWS}
    teacher = {row: [] for row in ROWS}
    for _ in range(args.warmup + args.steps):
        for row, (student, objective, batches, _keep) in rows.items():
            times[row].append(step(student, objective, batches))
            teacher[row].append(objective.teacher_seconds if objective else 0.0)
    return {row: {"step_s": statistics.median(times[row][args.warmup:]),
                  "teacher_s": statistics.median(teacher[row][args.warmup:])} for row in ROWS}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--plan", default="1,0,1,0", help="the student's iterations per layer")
    p.add_argument("--top-k", type=int, default=32)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--row", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.row is not None:
        print(json.dumps(timing_child(args) if args.row == "timing" else memory_child(args)))
        return 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}

    def child(row: str) -> dict:
        cmd = [sys.executable, __file__, *sys.argv[1:], "--row", row]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        print(f"  measured {row}", file=sys.stderr)
        return json.loads(out.stdout.strip().splitlines()[-1])

    timing = child("timing")
    results = [{"row": row, **timing[row], **child(row)} for row in ROWS]
    base = results[0]
    print(f"student iterations {args.plan} (teacher: full IIET r=3), {args.layers} layers x "
          f"{args.hidden}, vocab {args.vocab}, {args.micro_batches} x {args.micro_batch} x "
          f"{args.seq} tokens per step, 1 thread, median of {args.steps} round-robin steps\n")
    print("| teachers | step s | x plain | teacher s | peak RSS MB | +MB vs plain | teacher "
          "params MB | teacher logits MB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['row']} | {r['step_s']:.3f} | {r['step_s'] / base['step_s']:.2f} | "
              f"{r['teacher_s']:.3f} | {r['peak_rss_mb']:.0f} | "
              f"{r['peak_rss_mb'] - base['peak_rss_mb']:+.0f} | {r['teacher_params_mb']:.1f} | "
              f"{r['teacher_logits_mb']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
