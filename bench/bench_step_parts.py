"""Where one training step's time goes, architecture against architecture: every aten operator
timed at dispatch, forward and backward apart, and the Python/autograd overhead alone.

    .venv/bin/python bench/bench_step_parts.py [--layers 24 --architectures vanilla iiet]

Three measurements, each in the same process for both architectures (fp32, 1 thread, h256, seq
256, micro-batch 4 unless given):

* **operators**: one step under a ``TorchDispatchMode`` that times each aten call; the table lists
  the operators whose time differs most from ``passes ratio x`` the first architecture's (for
  IIET r=3 against vanilla: 4x), so the history's own operators and any operator that got slower
  per call stand out. The mode's own cost inflates every call a little, alike for both.
* **forward / backward**: the model's forward (with the loss) and its backward timed apart,
  median of ``--rounds``; ``(F + B + F) / (F + B)`` is what recomputing every pass's forward once
  (``iteration_checkpointing: all_passes``) costs at most.
* **overhead**: the same step at hidden 32, seq 8, micro-batch 1, where the operators cost next
  to nothing: what is left is Python, autograd and dispatch per pass.

Used for docs/benchmarks.md, "Step time and memory at 24 layers".
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time

import torch

from megatron_iiet.distributed import spawn_local


def measure(architectures: list[str], shape: dict, rounds: int) -> dict:
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron_iiet.distributed import seed_everything
    from megatron_iiet.model.config import IIETTransformerConfig
    from megatron_iiet.model.gpt import IIETGPTModel

    def build(arch: str, hidden: int, ffn: int, seq: int):
        cfg = IIETTransformerConfig(num_layers=shape["layers"], hidden_size=hidden,
                                    num_attention_heads=4, ffn_hidden_size=ffn,
                                    vocab_size=shape["vocab"], architecture=arch,
                                    max_sequence_length=seq)
        seed_everything(0)
        return IIETGPTModel(cfg)

    def tokens(seq: int, mb: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(0)
        return torch.randint(0, shape["vocab"], (mb, seq + 1), generator=generator)

    def step(model, ids) -> tuple[float, float]:
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss = model(ids[:, :-1], labels=ids[:, 1:]).mean()
        t1 = time.perf_counter()
        loss.backward()
        return t1 - t0, time.perf_counter() - t1

    class OperatorTimes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seconds, self.calls = collections.defaultdict(float), collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            start = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            self.seconds[name] += time.perf_counter() - start
            self.calls[name] += 1
            return out

    ids = tokens(shape["seq"], shape["micro_batch"])
    models = {a: build(a, shape["hidden"], shape["ffn"], shape["seq"]) for a in architectures}
    split = {a: [] for a in architectures}
    for r in range(rounds + 1):  # round 0 warms up
        for arch, model in models.items():
            times = step(model, ids)
            if r:
                split[arch].append(times)
    operators = {}
    for arch, model in models.items():
        with OperatorTimes() as timer:
            step(model, ids)
        operators[arch] = (dict(timer.seconds), dict(timer.calls))
    del models
    tiny_ids = tokens(8, 1)
    tiny = {a: build(a, 32, 64, 8) for a in architectures}
    overhead = {a: [] for a in architectures}
    for r in range(rounds + 2):
        for arch, model in tiny.items():
            if r:
                overhead[arch].append(sum(step(model, tiny_ids)))
    return {
        "split": {a: (statistics.median(f for f, _ in v), statistics.median(b for _, b in v))
                  for a, v in split.items()},
        "operators": operators,
        "overhead": {a: statistics.median(v) for a, v in overhead.items()},
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=704)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--architectures", nargs=2, default=["vanilla", "iiet"],
                   metavar=("BASE", "OTHER"))
    p.add_argument("--passes-ratio", type=float, default=4.0,
                   help="passes of OTHER per pass of BASE (IIET r=3 / vanilla: 4)")
    p.add_argument("--top", type=int, default=15)
    args = p.parse_args(argv)
    shape = dict(layers=args.layers, hidden=args.hidden, ffn=args.ffn, vocab=args.vocab,
                 seq=args.seq, micro_batch=args.micro_batch)
    res = spawn_local(measure, 1, threads_per_rank=1, timeout_s=3600,
                      architectures=args.architectures, shape=shape, rounds=args.rounds)[0]
    base, other, k = *args.architectures, args.passes_ratio
    print(f"shape: {shape}, fp32, 1 thread; {other} against {base}, passes ratio {k:g}\n")

    print("| architecture | forward s | backward s | B/F | (F+B+F)/(F+B) "
          "| overhead s/step (h32, seq 8) |")
    print("|---|---|---|---|---|---|")
    for arch in args.architectures:
        f, b = res["split"][arch]
        print(f"| {arch} | {f:.3f} | {b:.3f} | {b / f:.2f} | {(2 * f + b) / (f + b):.3f} | "
              f"{res['overhead'][arch]:.3f} |")
    (fb, bb), (fo, bo) = res["split"][base], res["split"][other]
    print(f"\nstep {other} / {base}: {(fo + bo) / (fb + bb):.2f}x; overhead "
          f"{res['overhead'][other] / res['overhead'][base]:.2f}x")

    (bs, bc), (os_, oc) = res["operators"][base], res["operators"][other]
    total_b, total_o = sum(bs.values()), sum(os_.values())
    print(f"\noperators, one step: {base} {total_b:.2f} s, {other} {total_o:.2f} s "
          f"({total_o / total_b:.2f}x)\n")
    print(f"| operator | {base} ms (calls) | {other} ms (calls) | {other} - {k:g} x {base} ms |")
    print("|---|---|---|---|")
    names = sorted(set(bs) | set(os_), key=lambda n: -abs(os_.get(n, 0) - k * bs.get(n, 0)))
    for name in names[:args.top]:
        print(f"| {name} | {1e3 * bs.get(name, 0):.1f} ({bc.get(name, 0)}) | "
              f"{1e3 * os_.get(name, 0):.1f} ({oc.get(name, 0)}) | "
              f"{1e3 * (os_.get(name, 0) - k * bs.get(name, 0)):+.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
