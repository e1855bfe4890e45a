"""Step time, memory and MFU of each architecture at the same size, side by side in one run.

    .venv/bin/python bench/bench_model.py [--layers 4 --hidden 256 --seq 256 --micro-batch 8]

Every configuration runs in its own fresh process (so peak-RSS readings do not leak between
them), one after another: one warm-up step, then the median of ``--steps`` forward+backward
steps. "activation MB" is the process's peak RSS over all steps minus its RSS after building the
model: activations plus gradients (the gradients are the same size for every architecture).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time

import torch

from megatron_iiet.distributed import spawn_local
from megatron_iiet.model.config import ITERATION_CHECKPOINTING

CONFIGS = [
    # label, overrides
    ("vanilla", dict(architecture="vanilla")),
    ("ode_rk2", dict(architecture="ode_rk2")),
    ("pcformer_rk2", dict(architecture="pcformer_rk2")),
    ("iiet r=3", dict(architecture="iiet")),
    ("iiet r=[1]*L", dict(architecture="iiet", iterations="ones")),
]
CHECKPOINTING = ["none", "all_passes"]  # the default rows; --checkpointing may add the other modes


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(overrides: dict, shape: dict, steps: int) -> dict:
    from megatron_iiet.distributed import seed_everything
    from megatron_iiet.model.config import IIETTransformerConfig
    from megatron_iiet.model.flops import passes_per_layer, step_flops
    from megatron_iiet.model.gpt import IIETGPTModel
    from megatron_iiet.training.step import forward_backward

    overrides = dict(overrides)
    if overrides.get("iterations") == "ones":
        overrides["iterations"] = [1] * shape["num_layers"]
    seq, mb = shape.pop("seq"), shape.pop("micro_batch")
    cfg = IIETTransformerConfig(**shape, **overrides, max_sequence_length=seq)
    seed_everything(0)
    model = IIETGPTModel(cfg)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (mb, seq + 1), generator=g)
    batch = [{"input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(mb, seq)}]

    def step():
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        forward_backward(model, batch)
        return time.perf_counter() - t0

    rss_before = _rss_mb()  # model built, nothing run yet: the peak above this is activations
    step()  # warm-up
    times = [step() for _ in range(steps)]
    return {
        "step_s": statistics.median(times),
        "activation_mb": _peak_rss_mb() - rss_before,
        "passes": sum(passes_per_layer(cfg)) / cfg.num_layers,
        "model_flops": step_flops(cfg, mb, seq).model,
    }


def gemm_flops_per_s(n: int = 2048, repeats: int = 5) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(repeats))
    return 2 * n**3 / best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=704)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--only", default=None,
                   help="comma-separated labels to run (vanilla is always run: the baseline)")
    p.add_argument("--checkpointing", nargs="+", default=CHECKPOINTING,
                   choices=ITERATION_CHECKPOINTING)
    args = p.parse_args(argv)
    if "none" not in args.checkpointing:
        p.error("--checkpointing must include none (the baseline)")
    configs = CONFIGS
    if args.only:
        wanted = {"vanilla", *args.only.split(",")}
        configs = [c for c in CONFIGS if c[0] in wanted]
        if len(configs) != len(wanted):
            p.error(f"--only: unknown label among {sorted(wanted)}; labels: "
                    f"{', '.join(c[0] for c in CONFIGS)}")

    torch.set_num_threads(args.threads)
    peak = gemm_flops_per_s()
    print(f"measured fp32 GEMM (2048^3, {args.threads} threads): {peak / 1e9:.1f} GFLOP/s")
    shape = dict(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                 ffn_hidden_size=args.ffn, vocab_size=args.vocab, seq=args.seq,
                 micro_batch=args.micro_batch)
    print(f"shape: {shape}, fp32, {args.steps} timed steps after 1 warm-up, fresh process each\n")

    rows = []
    for label, overrides in configs:
        for ckpt in args.checkpointing:
            r = spawn_local(measure, 1, threads_per_rank=args.threads, timeout_s=1800,
                            overrides=dict(overrides, iteration_checkpointing=ckpt),
                            shape=dict(shape), steps=args.steps)[0]
            r.update(label=label, ckpt=ckpt)
            rows.append(r)
            print(f"  measured {label:14s} ckpt={ckpt:10s} {r['step_s']:.3f} s", flush=True)

    base = next(r for r in rows if r["label"] == "vanilla" and r["ckpt"] == "none")
    plain = {r["label"]: r for r in rows if r["ckpt"] == "none"}
    header = (f"| architecture | iteration ckpt | passes/layer | step s | x vanilla | "
              f"(x vanilla)/passes | activation MB | x vanilla mem | x own plain step | MFU |")
    print()
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for r in rows:
        ratio = r["step_s"] / base["step_s"]
        print(
            f"| {r['label']} | {r['ckpt']} | {r['passes']:.2f} | {r['step_s']:.3f} | {ratio:.2f} | "
            f"{ratio / r['passes']:.3f} | {r['activation_mb']:.0f} | "
            f"{r['activation_mb'] / base['activation_mb']:.2f} | "
            f"{r['step_s'] / plain[r['label']]['step_s']:.2f} | "
            f"{r['model_flops'] / r['step_s'] / peak:.1%} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
