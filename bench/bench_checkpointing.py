"""What per-pass activation checkpointing (and ``model.compile``) costs in step time, the modes
interleaved in one process.

    .venv/bin/python bench/bench_checkpointing.py [--layers 24 --micro-batch 4 --rounds 3]
    .venv/bin/python bench/bench_checkpointing.py --compile --modes none   # eager vs compiled

``bench_model.py`` runs every (architecture, mode) in a fresh process, one after another: right
for peak memory, but its time ratios mix in whatever the machine did between the processes and
each process's own allocator warm-up. Here every architecture is built once in one process and
the steps go round all (architecture, mode) cells in turn, so load and allocator state hit every
cell alike; each ratio is the median over the rounds of the per-round ratio (the first
architecture's plain step, and the cell's own plain step of the same round). Recomputation must
not change the result: the gradients of every mode are compared with the plain step's (printed;
bit-identical on CPU).
``--compile`` adds every mode again with each pass under torch.compile; the compile happens in
the warm-up step, whose time is printed apart (compiled gradients differ from eager ones by
fp32 rounding: inductor fuses and reorders).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from megatron_iiet.distributed import spawn_local
from megatron_iiet.model.config import ITERATION_CHECKPOINTING
from megatron_iiet.model.ode_step import KEEP_TAIL_MODE

ARCHITECTURES = {"vanilla": dict(architecture="vanilla"), "iiet r=3": dict(architecture="iiet"),
                 "pcformer_rk2": dict(architecture="pcformer_rk2")}


def measure(architectures: list[str], shape: dict, modes: list[tuple[str, bool]],
            rounds: int) -> dict:
    from megatron_iiet.distributed import seed_everything
    from megatron_iiet.model.config import IIETTransformerConfig
    from megatron_iiet.model.gpt import IIETGPTModel
    from megatron_iiet.training.step import forward_backward

    seq, mb = shape.pop("seq"), shape.pop("micro_batch")
    models = {}
    for label in architectures:
        cfg = IIETTransformerConfig(**shape, **ARCHITECTURES[label], max_sequence_length=seq)
        seed_everything(0)
        models[label] = (cfg, IIETGPTModel(cfg))
    tokens = torch.randint(0, shape["vocab_size"], (mb, seq + 1),
                           generator=torch.Generator().manual_seed(0))
    batch = [{"input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(mb, seq)}]

    def step(label: str, mode: tuple[str, bool]) -> tuple[float, torch.Tensor]:
        cfg, model = models[label]
        # every layer reads these from the shared config at each forward
        cfg.iteration_checkpointing, cfg.compile = mode
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        forward_backward(model, batch)
        seconds = time.perf_counter() - t0
        return seconds, torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    reference, warm_up_s = {}, {}
    for label in architectures:  # warm-up (and compile), and the reference gradients
        for mode in modes:
            warm_up_s[(label, mode)], grads = step(label, mode)
            reference.setdefault(label, grads)  # modes[0] is ("none", eager)
    cells = [(label, mode) for label in architectures for mode in modes]
    times = {cell: [] for cell in cells}
    grad_error = {cell: 0.0 for cell in cells}
    for _ in range(rounds):
        for cell in cells:
            seconds, grads = step(*cell)
            ref = reference[cell[0]]
            grad_error[cell] = max(grad_error[cell], ((grads - ref).abs().max() / ref.abs().max()).item())
            times[cell].append(seconds)
    base = architectures[0]
    return [
        dict(label=label, mode=mode, step_s=statistics.median(times[(label, mode)]),
             x_plain=statistics.median(t / p for t, p in zip(times[(label, mode)],
                                                             times[(label, modes[0])])),
             x_base=statistics.median(t / p for t, p in zip(times[(label, mode)],
                                                            times[(base, modes[0])])),
             grad_error=grad_error[(label, mode)], warm_up_s=warm_up_s[(label, mode)])
        for label, mode in cells
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=704)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--architectures", nargs="+", default=["vanilla", "iiet r=3"],
                   choices=sorted(ARCHITECTURES))
    p.add_argument("--modes", nargs="+", default=list(ITERATION_CHECKPOINTING),
                   choices=ITERATION_CHECKPOINTING)
    p.add_argument("--compile", action="store_true",
                   help="also run every mode with model.compile (torch.compile of each pass)")
    args = p.parse_args(argv)
    names = ["none"] + [m for m in args.modes if m != "none"]
    compilable = [m for m in names if m != KEEP_TAIL_MODE]  # keep_tail runs its passes eagerly
    modes = [(m, False) for m in names] + ([(m, True) for m in compilable] if args.compile else [])
    shape = dict(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                 ffn_hidden_size=args.ffn, vocab_size=args.vocab, seq=args.seq,
                 micro_batch=args.micro_batch)
    print(f"shape: {shape}, fp32, {args.threads} thread(s), one process, every (architecture, "
          f"mode) in turn, median of {args.rounds} rounds after a warm-up\n")
    print(f"| architecture | iteration ckpt | compiled | step s | x {args.architectures[0]} plain "
          f"| x own plain step | grad max rel. diff | first step s |")
    print("|---|---|---|---|---|---|---|---|")
    rows = spawn_local(measure, 1, threads_per_rank=args.threads, timeout_s=3600,
                       architectures=args.architectures, shape=shape, modes=modes,
                       rounds=args.rounds)[0]
    for r in rows:
        name, compiled = r["mode"]
        print(f"| {r['label']} | {name} | {'yes' if compiled else 'no'} | {r['step_s']:.3f} | "
              f"{r['x_base']:.2f} | {r['x_plain']:.3f} | {r['grad_error']:.1e} | "
              f"{r['warm_up_s']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
