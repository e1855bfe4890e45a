#!/usr/bin/env python
"""Decode throughput of the HF model: per-(layer, pass) KV cache vs recomputing the prefix.

    python bench/bench_decode.py --prompt 128 --new 64 --repeats 3 --threads 1 [--cached-repeats 9]
                                 [--layers 6 24] [--no-recompute]

For vanilla, IIET (history form, r=3) and an E-IIET plan (iterations 3,2,1,0,... cycled over the
layers) it runs greedy `generate` on the same random weights: with the cache (use_cache=True) and,
unless --no-recompute, without it (every step recomputes the whole prefix). Both must produce the
same tokens (checked; with --no-recompute on the first --check tokens only). The table gives new
tokens per second of `generate` (prefill included; median of --cached-repeats rounds for the cache,
--repeats for recomputing, rounds interleave the models so background load hits them alike;
"spread" = (max - min) / median of the cached rate), the ratios to IIET r=3 next to the pass ratio
(issue-12 targets: E-IIET / IIET and vanilla / IIET >= 0.9 x their pass ratio), and "step ms":
the median time of one cached decode step as a plain forward call (no generate, no prefill), the
models interleaved step by step (--steps per round), which background load disturbs far less.
Below the table, least-squares fits of time per token = fixed + per-pass x passes over the rows of
each depth: the fixed part (LM head, embedding, generate's own loop) is what keeps the ratios
under the pass ratio. fp32 on CPU; the numbers go into docs/benchmarks.md under "HF export".
"""

import argparse
import statistics
import time

import torch

from megatron_iiet.hf import IIETConfig, IIETForCausalLM


def build(args, layers, **arch):
    config = IIETConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
        num_hidden_layers=layers, num_attention_heads=args.heads, **arch,
    )
    torch.manual_seed(0)
    return IIETForCausalLM(config).eval()


def generate(model, prompt, new_tokens, use_cache):
    with torch.no_grad():
        return model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, use_cache=use_cache, pad_token_id=0)


def decode_rate(model, prompt, new_tokens, use_cache):
    """New tokens per second of one greedy generate call, and the sequences it produced."""
    start = time.perf_counter()
    sequences = generate(model, prompt, new_tokens, use_cache)
    return new_tokens / (time.perf_counter() - start), sequences


def step_times(models, prompt, steps, rounds):
    """Median ms of one cached decode step (forward call + argmax) per model, interleaved."""
    samples = {key: [] for key in models}
    with torch.no_grad():
        for _ in range(rounds):
            state = {}
            for key, model in models.items():
                out = model(prompt, use_cache=True, logits_to_keep=1)
                state[key] = (out.cache, out.logits[:, -1:].argmax(-1))
            for _ in range(steps):
                for key, model in models.items():
                    cache, token = state[key]
                    start = time.perf_counter()
                    token = model(token, cache=cache).logits[:, -1:].argmax(-1)
                    samples[key].append(1e3 * (time.perf_counter() - start))
                    state[key] = (cache, token)
    return {key: statistics.median(values) for key, values in samples.items()}


def variants(layers):
    plan = [(3, 2, 1, 0)[i % 4] for i in range(layers)]
    shown = ",".join(map(str, plan)) if layers <= 8 else f"{','.join(map(str, plan[:4]))},... ({layers})"
    return [
        ("vanilla", dict(architecture="vanilla")),
        ("IIET r=3", dict(architecture="iiet", iterations=3)),
        (f"E-IIET {shown}", dict(architecture="iiet", iterations=plan)),
    ]


def fit(points):
    """Least squares t = a + b * passes over (passes, seconds per token) points."""
    n = len(points)
    mean_p = sum(p for p, _ in points) / n
    mean_t = sum(t for _, t in points) / n
    b = sum((p - mean_p) * (t - mean_t) for p, t in points) / sum((p - mean_p) ** 2 for p, _ in points)
    return mean_t - b * mean_p, b


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=704)
    parser.add_argument("--layers", type=int, nargs="+", default=[6])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cached-repeats", type=int, default=None,
                        help="rounds of cached generate (default: --repeats); they are short")
    parser.add_argument("--steps", type=int, default=32, help="decode steps per round of step ms")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-recompute", action="store_true",
                        help="time the cached decode only (recomputing is slow for deep models)")
    parser.add_argument("--check", type=int, default=8,
                        help="with --no-recompute: new tokens checked against recomputing")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    prompt = torch.randint(0, args.vocab, (args.batch, args.prompt), generator=torch.Generator().manual_seed(1))
    print(f"hidden {args.hidden}, ffn {args.ffn}, layers {' / '.join(map(str, args.layers))}, heads {args.heads}, "
          f"vocab {args.vocab}, batch {args.batch}, prompt {args.prompt}, new {args.new}, "
          f"threads {torch.get_num_threads()}, median of {args.repeats}")
    recompute = not args.no_recompute
    models = {}  # (layers, name) -> model
    for layers in args.layers:
        for name, arch in variants(layers):
            models[layers, name] = build(args, layers, **arch)
    for (layers, name), model in models.items():  # warm-up (allocator, dispatch); the token check
        decode_rate(model, prompt, 4, True)
        if not recompute:
            if not torch.equal(generate(model, prompt, args.check, True), generate(model, prompt, args.check, False)):
                raise SystemExit(f"{layers} layers, {name}: cached and recomputed greedy tokens differ")
        else:
            decode_rate(model, prompt, 4, False)
    rates = {(key, cached): [] for key in models for cached in (True, False)}
    produced = {}
    for _ in range(args.cached_repeats or args.repeats):
        for key, model in models.items():
            fast, produced[key] = decode_rate(model, prompt, args.new, True)
            rates[key, True].append(fast)
    for _ in range(args.repeats if recompute else 0):
        for key, model in models.items():
            slow, seq_recompute = decode_rate(model, prompt, args.new, False)
            if not torch.equal(produced[key], seq_recompute):
                raise SystemExit(f"{key[0]} layers, {key[1]}: cached and recomputed greedy tokens differ")
            rates[key, False].append(slow)
    steps = step_times(models, prompt, args.steps, args.repeats)

    print("| layers | model | passes/token | cached tok/s | spread | recompute tok/s | cache speed-up "
          "| x IIET r=3 | pass ratio IIET/this | (x IIET) / pass ratio | step ms | step: IIET / this "
          "| step: / pass ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    fits = []
    for layers in args.layers:
        keys = [(layers, name) for name, _ in variants(layers)]
        iiet_key = keys[1]
        iiet_rate = statistics.median(rates[iiet_key, True])
        iiet_passes = sum(models[iiet_key].config.passes_per_layer())
        points, step_points = [], []
        for key in keys:
            samples = rates[key, True]
            cached = statistics.median(samples)
            spread = (max(samples) - min(samples)) / cached
            passes = sum(models[key].config.passes_per_layer())
            points.append((passes, 1 / cached))
            step_points.append((passes, steps[key] / 1e3))
            step_ratio = steps[iiet_key] / steps[key]
            pass_ratio = iiet_passes / passes
            if recompute:
                slow = statistics.median(rates[key, False])
                slow_cols = f"{slow:.1f} | {cached / slow:.2f}x"
            else:
                slow_cols = "- | -"
            print(f"| {layers} | {key[1]} | {passes} | {cached:.1f} | {100 * spread:.0f}% | {slow_cols} "
                  f"| {cached / iiet_rate:.2f}x | {pass_ratio:.2f} | {cached / iiet_rate / pass_ratio:.2f} "
                  f"| {steps[key]:.2f} | {step_ratio:.2f}x | {step_ratio / pass_ratio:.2f} |", flush=True)
        fits.append((layers, "generate", *fit(points)))
        fits.append((layers, "decode step", *fit(step_points)))
    for layers, what, fixed, per_pass in fits:
        print(f"fit, {layers} layers, {what}: time per token = {1e3 * fixed:.2f} ms + {1e3 * per_pass:.3f} ms "
              f"x passes (the fixed part = {fixed / per_pass:.1f} passes)")


if __name__ == "__main__":
    main()
