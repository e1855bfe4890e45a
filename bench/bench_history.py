#!/usr/bin/env python
"""The cross-layer history alone: kernels, memory traffic and time, direct form vs buffered form.

    .venv/bin/python bench/bench_history.py [--layers 24 --hidden 256 --seq 256 --micro-batch 4]

"Direct" is the form before the state buffer: every pop and refine of layer l a chain of l+1
scalar-times-state products and l additions. "Buffered" is model/history.py: the sums over
S_0..S_{l-1} once per layer in one matmul over the state buffer, then one addcmul per pass.
Both run IIET's released step (spec 5b, r iterations per layer) with each pass's block replaced
by an opaque stand-in whose own work is not counted, so what is counted is the history: the
pops, refines, the Np/Nc LayerNorms, the state buffer's copies and the autograd accumulation of
the states' gradients. Kernels are the aten operators that touch memory (views excluded), as
dispatched on CPU: on a GPU each is one launch. Traffic is bytes read plus written by them,
reported per token in hidden-size vectors.

The H200 estimate then prices that traffic for the 340M preset (bf16, sequence 2048): history
time per token = traffic / HBM bandwidth, or the launch time of its kernels if that is larger,
against the model's own time per token at a given MFU, FLOPs counted by model/flops.py. The
arithmetic is printed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megatron_iiet.model.architectures import StepInputs, get_architecture
from megatron_iiet.model.history import History, LayerHistoryParams

H200_HBM_BYTES_PER_S = 4.8e12
H200_BF16_DENSE_FLOPS = 989e12
LAUNCH_S = 4e-6  # per kernel launch, host side, typical for eager PyTorch on CUDA


class Counter(TorchDispatchMode):
    """Counts the aten operators that move memory, and the bytes they read and write."""

    def __init__(self):
        super().__init__()
        self.kernels = 0
        self.bytes = 0
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.paused or func.is_view or func.__name__.startswith(("empty", "new_empty",
                                                                    "detach", "_to_copy.")):
            return out
        tensors = [t for t in tree_flatten((args, kwargs or {}, out))[0]
                   if isinstance(t, torch.Tensor)]
        moved = sum(t.numel() * t.element_size() for t in tensors if t.numel() > 1)
        if moved:
            self.kernels += 1
            self.bytes += moved
        return out


COUNTER: Counter | None = None


class _OpaqueBlock(torch.autograd.Function):
    """Stands in for a pass's block: some work, not counted."""

    @staticmethod
    def forward(ctx, u):
        return _uncounted(lambda: u * 1.001 + 0.01)

    @staticmethod
    def backward(ctx, grad):
        return _uncounted(lambda: grad * 1.001)


def _uncounted(fn):
    if COUNTER is None:
        return fn()
    COUNTER.paused = True
    try:
        return fn()
    finally:
        COUNTER.paused = False


class Run:
    """The pass runner a step sees: ``run(u, norm)`` = norm(block(u))."""

    def __call__(self, u, norm=None):
        out = _OpaqueBlock.apply(u)
        return out if norm is None else norm(out)


class Config:
    def __init__(self, hidden, dtype):
        self.hidden_size, self.params_dtype, self.history_norm_eps = hidden, dtype, 1e-5
        self.history_init = "uniform"


class Layer(torch.nn.Module):
    def __init__(self, config, number):
        super().__init__()
        self.history = LayerHistoryParams(config, number)


# ---- the two forms -------------------------------------------------------------------------
def _combine(weights, states):
    out = weights[0] * states[0]
    for k in range(1, len(states)):
        out = out + weights[k] * states[k]
    return out


def direct_forward(layers, x, iterations):
    run, states = Run(), [x]
    for layer in layers:
        h = layer.history
        states = states + [run(x, norm=h.predictor_norm)]
        for _ in range(iterations):
            states[-1] = run(_combine(h.pop_weight, states), norm=h.corrector_norm)
        x = _combine(h.refine_weight, states)
    return x


def buffered_forward(layers, x, iterations):
    step = get_architecture("iiet", "history").step
    history = History.start(x, len(layers) + 2)
    for layer in layers:
        x = step(StepInputs(x=x, history=history.layer(layer.history), run=Run(), layer=layer,
                            shared=None, iterations=iterations))
    return x


FORMS = {"direct": direct_forward, "buffered": buffered_forward}


def measure(form, layers, x0, iterations, repeats):
    global COUNTER
    forward = FORMS[form]
    counts = {}
    for phase in ("forward", "backward"):
        x = x0.detach().requires_grad_()
        COUNTER = Counter()
        with COUNTER:
            out = forward(layers, x, iterations) if phase == "forward" else None
        if phase == "backward":
            out = forward(layers, x, iterations)
            with COUNTER:
                out.sum().backward()
        counts[phase] = (COUNTER.kernels, COUNTER.bytes)
        COUNTER = None
    times = []
    for _ in range(repeats):
        x = x0.detach().requires_grad_()
        start = time.perf_counter()
        forward(layers, x, iterations).sum().backward()
        times.append(time.perf_counter() - start)
    return counts, statistics.median(times)


def h200_estimate(kernels_per_micro_batch, vectors_per_token, mfu, tokens, fwd_bwd_flops_per_token):
    """History time per token on an H200 vs the model's own, both printed with their inputs."""
    hidden, bytes_per_element = 1024, 2
    traffic_s = vectors_per_token * hidden * bytes_per_element / H200_HBM_BYTES_PER_S
    launch_s = kernels_per_micro_batch * LAUNCH_S / tokens
    history_s = max(traffic_s, launch_s)
    model_s = fwd_bwd_flops_per_token / (mfu * H200_BF16_DENSE_FLOPS)
    return traffic_s, launch_s, history_s, model_s, history_s / (model_s + history_s)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--h200-micro-batch", type=int, default=4, help="340M estimate: sequences of 2048")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    config = Config(args.hidden, torch.float32)
    layers = [Layer(config, n) for n in range(1, args.layers + 1)]
    for layer in layers:  # away from the uniform init, so no sum is trivially symmetric
        with torch.no_grad():
            layer.history.pop_weight.uniform_(0.0, 2.0 / layer.history.layer_number)
            layer.history.refine_weight.uniform_(0.0, 2.0 / layer.history.layer_number)
    x0 = torch.randn(args.seq, args.micro_batch, args.hidden)
    tokens = args.seq * args.micro_batch
    vector_bytes = args.hidden * 4

    print(f"history alone: {args.layers} layers, r={args.iterations}, hidden {args.hidden}, "
          f"seq {args.seq}, micro-batch {args.micro_batch}, fp32, {args.threads} threads\n")
    results = {form: measure(form, layers, x0, args.iterations, args.repeats) for form in FORMS}
    # same numbers from both forms, or the comparison means nothing
    outs = [FORMS[f](layers, x0, args.iterations) for f in FORMS]
    rel = ((outs[0] - outs[1]).norm() / outs[0].norm()).item()

    print("| form | fwd kernels | bwd kernels | kernels/pass | fwd vectors/token | bwd vectors/token | "
          "total vectors/token | fwd+bwd ms |")
    print("|---|---|---|---|---|---|---|---|")
    passes = args.layers * (args.iterations + 1)
    table = {}
    for form, (counts, seconds) in results.items():
        (fk, fb), (bk, bb) = counts["forward"], counts["backward"]
        fv, bv = fb / vector_bytes / tokens, bb / vector_bytes / tokens
        table[form] = (fk + bk, fv + bv)
        print(f"| {form} | {fk} | {bk} | {(fk + bk) / passes:.1f} | {fv:.0f} | {bv:.0f} | "
              f"{fv + bv:.0f} | {seconds * 1e3:.0f} |")
    (dk, dv), (nk, nv) = table["direct"], table["buffered"]
    dt, nt = results["direct"][1], results["buffered"][1]
    print(f"\nbuffered vs direct: {dk / nk:.1f}x fewer kernels, {dv / nv:.1f}x less traffic, "
          f"{dt / nt:.2f}x faster on this CPU; outputs agree to {rel:.1e} relative")

    # ---- H200, 340M preset: kernels per micro-batch and vectors per token do not depend on the
    # hidden size, sequence or batch, only on layers and iterations
    if (args.layers, args.iterations) != (24, 3):
        print("\n(the H200 estimate is for the 340M preset: run with --layers 24 --iterations 3)")
        return 0
    from megatron_iiet.model.config import preset
    from megatron_iiet.model.flops import step_flops

    seq, mb = 2048, args.h200_micro_batch
    cfg = preset("340m", architecture="iiet", max_sequence_length=seq)
    flops_per_token = step_flops(cfg, mb, seq).model / (mb * seq)
    print(f"\nH200 estimate, 340M IIET r=3 (24 layers, hidden 1024, bf16, {mb} x {seq} tokens per "
          f"micro-batch): model {flops_per_token / 1e9:.2f} GFLOP per token (fwd+bwd, every pass); "
          f"HBM {H200_HBM_BYTES_PER_S / 1e12:.1f} TB/s, bf16 dense {H200_BF16_DENSE_FLOPS / 1e12:.0f} "
          f"TFLOP/s, {LAUNCH_S * 1e6:.0f} us per kernel launch.")
    print("history s/token = max(vectors/token x 1024 x 2 B / HBM, kernels x launch / tokens); "
          "share = history / (model s/token at the MFU + history)\n")
    tokens_h200 = mb * seq
    model_ms = h200_estimate(0, 0, 0.5, tokens_h200, flops_per_token)[3] * tokens_h200 * 1e3
    print(f"model time per micro-batch at 50% MFU: {model_ms:.1f} ms\n")
    print("| form | kernels/micro-batch | vectors/token | traffic ms/micro-batch | "
          "launch ms/micro-batch | share at 50% MFU | share at 100% |")
    print("|---|---|---|---|---|---|---|")
    for form, (kernels, vectors) in table.items():
        t, l, _, _, share50 = h200_estimate(kernels, vectors, 0.5, mb * seq, flops_per_token)
        share100 = h200_estimate(kernels, vectors, 1.0, mb * seq, flops_per_token)[-1]
        print(f"| {form} | {kernels} | {vectors:.0f} | {t * tokens_h200 * 1e3:.2f} | "
              f"{l * tokens_h200 * 1e3:.2f} | {share50:.1%} | {share100:.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
