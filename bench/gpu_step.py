#!/usr/bin/env python
"""Training-step time, MFU and memory on one GPU: IIET vs vanilla at the 340M preset, bf16.

    python bench/gpu_step.py                      # on a GPU machine: 340M, bf16, seq 2048
    python bench/gpu_step.py --preset tiny --seq 64 --micro-batch 2 --dtype float32  # CPU smoke

One process, one device (NCCL on CUDA, gloo on CPU), megatron-core's local layer spec. For each
configuration: the model is built on the device, one warm-up step, then the median of --steps
forward+backward steps through megatron's schedule (the optimizer is not part of the step: it
costs the same for every architecture). Rows: vanilla; IIET r=3 with no, all_passes and
all_but_last_pass iteration checkpointing; an E-IIET plan. MFU = model FLOPs (every pass,
model/flops.py) / step time / the device's dense peak (--peak-tflops; H200 bf16: 989). Memory =
peak allocated during the steps minus allocated after building (activations + gradients).
Prints a markdown table for docs/benchmarks.md; with --json also writes the rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

CONFIGS = [
    ("vanilla", dict(architecture="vanilla")),
    ("iiet r=3", dict(architecture="iiet")),
    ("iiet r=3 all_passes", dict(architecture="iiet", iteration_checkpointing="all_passes")),
    ("iiet r=3 all_but_last_pass",
     dict(architecture="iiet", iteration_checkpointing="all_but_last_pass")),
    ("e-iiet 3,2,1,0,...", dict(architecture="iiet", iterations="cycle")),
]


def measure(label, overrides, args, device):
    from megatron_iiet.distributed import seed_everything
    from megatron_iiet.model.config import preset
    from megatron_iiet.model.flops import passes_per_layer, step_flops
    from megatron_iiet.model.gpt import IIETGPTModel
    from megatron_iiet.platform import synchronize
    from megatron_iiet.training.step import forward_backward

    dtype = getattr(torch, args.dtype)
    overrides = dict(overrides)
    shape = preset(args.preset)
    if overrides.get("iterations") == "cycle":
        overrides["iterations"] = [(3, 2, 1, 0)[i % 4] for i in range(shape.num_layers)]
    cfg = preset(args.preset, **overrides, max_sequence_length=args.seq, params_dtype=dtype,
                 bf16=dtype == torch.bfloat16, vocab_size=args.vocab)
    seed_everything(0)
    model = IIETGPTModel(cfg).to(device)
    g = torch.Generator().manual_seed(0)
    mb, seq = args.micro_batch, args.seq
    tokens = torch.randint(0, cfg.vocab_size, (mb, seq + 1), generator=g).to(device)
    batch = [{"input_ids": tokens[:, :-1], "labels": tokens[:, 1:],
              "loss_mask": torch.ones(mb, seq, device=device)}]

    def step():
        model.zero_grad(set_to_none=True)
        synchronize()
        t0 = time.perf_counter()
        forward_backward(model, batch)
        synchronize()
        return time.perf_counter() - t0

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        built = torch.cuda.memory_allocated()
    step()  # warm-up
    times = [step() for _ in range(args.steps)]
    peak = (torch.cuda.max_memory_allocated() - built) / 2**30 if cuda else float("nan")
    seconds = statistics.median(times)
    flops = step_flops(cfg, mb, seq).model
    row = {"label": label, "passes": sum(passes_per_layer(cfg)) / cfg.num_layers,
           "step_s": seconds, "tokens_per_s": mb * seq / seconds,
           "mfu": flops / seconds / (args.peak_tflops * 1e12), "memory_gib": peak}
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="340m")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--peak-tflops", type=float, default=989.0,
                   help="the device's dense peak for --dtype (H200 bf16: 989)")
    p.add_argument("--only", default=None, help="comma-separated row labels")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    from megatron_iiet.distributed import initialize
    from megatron_iiet.platform import compute_device

    initialize()
    device = compute_device()
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"device: {name}; preset {args.preset}, {args.dtype}, {args.micro_batch} x {args.seq} "
          f"tokens, median of {args.steps} steps after a warm-up", flush=True)
    rows = []
    for label, overrides in CONFIGS:
        if args.only and label not in args.only.split(","):
            continue
        try:
            rows.append(measure(label, overrides, args, device))
        except torch.OutOfMemoryError:
            rows.append({"label": label, "oom": True})
            torch.cuda.empty_cache()
        print(f"  {label}: {rows[-1]}", flush=True)

    base = next((r for r in rows if r["label"] == "vanilla" and not r.get("oom")), None)
    print("\n| configuration | passes/layer | step s | x vanilla | (x vanilla)/passes | tokens/s | "
          "MFU | memory GiB | x vanilla mem |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r.get("oom"):
            print(f"| {r['label']} | out of memory | | | | | | | |")
            continue
        ratio = r["step_s"] / base["step_s"] if base else float("nan")
        mem = r["memory_gib"] / base["memory_gib"] if base else float("nan")
        print(f"| {r['label']} | {r['passes']:.2f} | {r['step_s']:.3f} | {ratio:.2f} | "
              f"{ratio / r['passes']:.3f} | {r['tokens_per_s']:.0f} | {r['mfu']:.1%} | "
              f"{r['memory_gib']:.1f} | {mem:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
