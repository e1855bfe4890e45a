#!/usr/bin/env python
"""Decode throughput of the HF model: per-(layer, pass) KV cache vs recomputing the prefix.

    python bench/bench_decode.py [--hidden 256 --layers 6 --prompt 64 --new 64 --repeats 3]

For vanilla, IIET (history form, r=3) and an E-IIET plan (iterations 3,2,1,0,... cycled over the
layers) it runs greedy `generate` twice on the same random weights: with the cache
(use_cache=True) and without it (every step recomputes the whole prefix). Both must produce the
same tokens (checked); the table gives new tokens per second (median of --repeats) and the ratios.
fp32 on CPU; the numbers go into docs/benchmarks.md under "HF export".
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from megatron_iiet.hf import IIETConfig, IIETForCausalLM  # noqa: E402


def build(args, **arch):
    config = IIETConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, **arch,
    )
    torch.manual_seed(0)
    return IIETForCausalLM(config).eval()


def decode_rate(model, prompt, new_tokens, use_cache):
    """New tokens per second of one greedy generate call, and the sequences it produced."""
    start = time.perf_counter()
    with torch.no_grad():
        sequences = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                   do_sample=False, use_cache=use_cache, pad_token_id=0)
    return new_tokens / (time.perf_counter() - start), sequences


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=704)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    plan = [(3, 2, 1, 0)[i % 4] for i in range(args.layers)]
    variants = [
        ("vanilla", dict(architecture="vanilla")),
        ("IIET r=3", dict(architecture="iiet", iterations=3)),
        (f"E-IIET {','.join(map(str, plan))}", dict(architecture="iiet", iterations=plan)),
    ]
    prompt = torch.randint(0, args.vocab, (args.batch, args.prompt), generator=torch.Generator().manual_seed(1))
    print(f"hidden {args.hidden}, ffn {args.ffn}, layers {args.layers}, heads {args.heads}, vocab {args.vocab}, "
          f"batch {args.batch}, prompt {args.prompt}, new {args.new}, threads {torch.get_num_threads()}, "
          f"median of {args.repeats}")
    header = "| model | passes/token | cached tok/s | recompute tok/s | cache speed-up | cached vs vanilla |"
    print(header)
    print("|---|---|---|---|---|---|")
    models = {name: build(args, **arch) for name, arch in variants}
    for model in models.values():  # warm-up: first calls pay for allocator and dispatch set-up
        decode_rate(model, prompt, 4, True)
        decode_rate(model, prompt, 4, False)
    # Rounds interleave the variants so background load hits all of them alike.
    rates = {(name, cached): [] for name in models for cached in (True, False)}
    for _ in range(args.repeats):
        for name, model in models.items():
            fast, seq_cached = decode_rate(model, prompt, args.new, True)
            slow, seq_recompute = decode_rate(model, prompt, args.new, False)
            if not torch.equal(seq_cached, seq_recompute):
                raise SystemExit(f"{name}: cached and recomputed greedy tokens differ")
            rates[name, True].append(fast)
            rates[name, False].append(slow)
    vanilla_rate = statistics.median(rates[variants[0][0], True])
    for name, model in models.items():
        cached, recompute = statistics.median(rates[name, True]), statistics.median(rates[name, False])
        passes = sum(model.config.passes_per_layer())
        print(f"| {name} | {passes} | {cached:.1f} | {recompute:.1f} | {cached / recompute:.2f}x "
              f"| {cached / vanilla_rate:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
