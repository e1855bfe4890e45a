#!/usr/bin/env python
"""Prefill and cached greedy decode speed of exported HF models (the E-IIET artefacts).

    python bench/bench_decode_exports.py vanilla=EXPORT_A iiet=EXPORT_B e-iiet=EXPORT_C \
        [--prompt 128 --new 64 --rounds 5 --threads 1 --reference iiet]

Each LABEL=FOLDER is a folder written by `tools/convert_checkpoint.py megatron-to-hf`. Every
round runs each model once, in turn (so background load hits them alike): a prefill of --prompt
random tokens (one forward with the cache) and greedy `generate` of --new tokens with the exact
per-(layer, pass) cache. The table gives the medians over rounds: prefill tokens/s, decode
tokens/s (new tokens over the generate time minus its prefill), passes per token, and each
model's ratios to --reference next to the inverse pass ratio.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path


def passes(config) -> int:
    """Block passes per token, from the exported model's own config (the same architecture table
    the shipped forward runs), so a new architecture needs no entry here."""
    return sum(config.passes_per_layer())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="+", metavar="LABEL=FOLDER")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reference", default=None, help="label the ratios refer to (default: first)")
    args = p.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    models = {}
    for text in args.models:
        label, _, folder = text.partition("=")
        if not folder or not Path(folder).is_dir():
            print(f"error: {text}: expected LABEL=FOLDER (an HF export)", file=sys.stderr)
            return 2
        models[label] = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    reference = args.reference or next(iter(models))
    vocab = min(m.config.vocab_size for m in models.values())
    prompt = torch.randint(0, vocab, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    timings = {label: {"prefill": [], "generate": []} for label in models}
    with torch.no_grad():
        for _ in range(args.rounds):
            for label, model in models.items():
                t0 = time.perf_counter()
                model(prompt, use_cache=True)
                timings[label]["prefill"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                model.generate(prompt, max_new_tokens=args.new, min_new_tokens=args.new,
                               do_sample=False, use_cache=True, pad_token_id=0)
                timings[label]["generate"].append(time.perf_counter() - t0)
    rows = {}
    for label, model in models.items():
        prefill = statistics.median(timings[label]["prefill"])
        generate = statistics.median(timings[label]["generate"])
        rows[label] = {"passes": passes(model.config), "prefill_tps": args.prompt / prefill,
                       "decode_tps": args.new / max(generate - prefill, 1e-9)}
    ref = rows[reference]
    print(f"prompt {args.prompt}, {args.new} new tokens, batch 1, {args.threads} thread(s), "
          f"fp32, median of {args.rounds} interleaved rounds; ratios to {reference}\n")
    print("| model | passes/token | prefill tok/s | decode tok/s | decode x | prefill x | "
          "passes ratio (ref/model) |")
    print("|---|---|---|---|---|---|---|")
    for label, r in rows.items():
        print(f"| {label} | {r['passes']} | {r['prefill_tps']:.0f} | {r['decode_tps']:.1f} | "
              f"{r['decode_tps'] / ref['decode_tps']:.2f} | "
              f"{r['prefill_tps'] / ref['prefill_tps']:.2f} | "
              f"{ref['passes'] / r['passes']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
