"""Convert between megatron_iiet training checkpoints and Hugging Face folders.

    # megatron (any TP/PP, megatron or DeepSpeed engine) -> HF
    python tools/convert_checkpoint.py megatron-to-hf CKPT OUT_DIR [--dtype fp32|bf16|fp16]
        [--trim-vocab] [--max-shard-size 2GB] [--tokenizer PATH | --no-tokenizer]
        [--expect-architecture iiet] [--allow-nonfinite] [--max-abs-weight 1e4] [--force]

    # HF (ours, or the authors' release layout) -> megatron, model only, at a chosen layout
    python tools/convert_checkpoint.py hf-to-megatron HF_DIR OUT_ROOT [--tp 2] [--pp 2]
        [--precision fp32|bf16|fp16] [--iterations 3 | 3,2,1,0,...] [--allow-nonfinite]
        [--max-abs-weight 1e4] [--force]

CKPT is a checkpoint root (with `latest`) or one iter_* directory. OUT_ROOT receives `latest`
and iter_0000000/ (meta.json marked model_only); continue training from it with
`pretrain_iiet.py --set checkpoint.load=OUT_ROOT` (fresh optimizer, step 0; resume that run
later with the default checkpoint.load=auto). Outputs are written to a temporary folder and
renamed into place. An output that is the source, holds it or lies inside it is refused
whatever the flags; an existing output is replaced only with --force, and only if it is an
earlier export as the converter wrote it (it leaves .megatron_iiet_export.json in every output
listing what it wrote). Weights holding NaN/Inf (or values the output dtype cannot hold) are
refused unless --allow-nonfinite; weights beyond +-1e4 unless --max-abs-weight allows them.
Bad input exits with code 2 and one line `error: ...` naming the file at fault. Mapping and
details: docs/hf.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from megatron_iiet.cli import parse_iterations, positive_number
from megatron_iiet.hf.checks import DEFAULT_MAX_ABS_WEIGHT, DTYPES
from megatron_iiet.model.architectures import architecture_names


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="direction", required=True)

    to_hf = sub.add_parser("megatron-to-hf", help="export a training checkpoint as an HF folder")
    to_hf.add_argument("checkpoint", help="checkpoint root (with `latest`) or an iter_* dir")
    to_hf.add_argument("out_dir", type=Path)
    to_hf.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")
    to_hf.add_argument("--trim-vocab", action="store_true",
                       help="cut the vocabulary padding (to the tokenizer's size)")
    to_hf.add_argument("--max-shard-size", default="2GB")
    to_hf.add_argument("--tokenizer", help="tokenizer to ship (default: the one in meta.json)")
    to_hf.add_argument("--no-tokenizer", action="store_true", help="write the weights only")

    to_meg = sub.add_parser("hf-to-megatron", help="HF folder -> model-only training checkpoint")
    to_meg.add_argument("hf_dir", type=Path)
    to_meg.add_argument("out_dir", type=Path, help="checkpoint root to create")
    to_meg.add_argument("--tp", type=int, default=1, help="tensor-parallel size to write")
    to_meg.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to write")
    to_meg.add_argument("--precision", choices=tuple(DTYPES), default="fp32")
    to_meg.add_argument("--iterations", type=parse_iterations, default=None,
                        help="IIET iteration plan to record (default: the folder's)")

    for p in (to_hf, to_meg):
        p.add_argument("--expect-architecture", choices=architecture_names(),
                       help="refuse a source of another architecture")
        p.add_argument("--force", action="store_true",
                       help="replace the output if it is an earlier export (never anything else)")
        p.add_argument("--allow-nonfinite", action="store_true",
                       help="convert NaN/Inf weights (or weights the output dtype cannot hold) "
                            "instead of refusing them")
        p.add_argument("--max-abs-weight", type=positive_number, default=DEFAULT_MAX_ABS_WEIGHT,
                       metavar="N", help="refuse weights of magnitude above N (default "
                       f"{DEFAULT_MAX_ABS_WEIGHT:g}: far above trained weights; inf: no bound)")
        p.add_argument("--quiet", action="store_true", help="no progress lines")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from megatron_iiet.platform import name_deepspeed_accelerator

    name_deepspeed_accelerator()  # before anything imports DeepSpeed
    from transformers.utils import logging as hf_logging

    from megatron_iiet.cli import fail
    from megatron_iiet.errors import OperatorError
    from megatron_iiet.hf.convert import export_to_hf, import_from_hf

    hf_logging.disable_progress_bar()  # our own progress lines say what is happening

    start = time.perf_counter()

    def progress(line: str) -> None:
        if not args.quiet:
            print(f"[{time.perf_counter() - start:6.1f}s] {line}", file=sys.stderr, flush=True)

    try:
        if args.direction == "megatron-to-hf":
            s = export_to_hf(args.checkpoint, args.out_dir, dtype=args.dtype,
                             trim_vocab=args.trim_vocab, max_shard_size=args.max_shard_size,
                             force=args.force, expect_architecture=args.expect_architecture,
                             tokenizer=args.tokenizer, with_tokenizer=not args.no_tokenizer,
                             allow_nonfinite=args.allow_nonfinite, progress=progress,
                             max_abs_weight=args.max_abs_weight)
            print(f"wrote {s.output}: {s.architecture}, {s.parameters / 1e6:.2f}M parameters "
                  f"({s.dtype}), vocab {s.vocab_size}, {len(s.weight_files)} weight file(s), "
                  f"tokenizer {s.tokenizer or 'none'}; from {s.source} (step {s.step}, layout "
                  f"{s.source_layout}) in {s.seconds:.1f}s")
        else:
            s = import_from_hf(args.hf_dir, args.out_dir, tp=args.tp, pp=args.pp,
                               precision=args.precision, iterations=args.iterations,
                               force=args.force, expect_architecture=args.expect_architecture,
                               allow_nonfinite=args.allow_nonfinite, progress=progress,
                               max_abs_weight=args.max_abs_weight)
            print(f"wrote {s.output}: {s.architecture} model-only checkpoint, TP={s.layout['tensor']}"
                  f" PP={s.layout['pipeline']}, vocab {s.vocab_size}, {s.precision}, tokenizer "
                  f"{s.tokenizer or 'none'} in {s.seconds:.1f}s")
    except OperatorError as err:  # ConversionError, or a tokenizer/storage fault met on the way
        fail(err)
    return 0


if __name__ == "__main__":  # python -m megatron_iiet.commands.convert_checkpoint
    raise SystemExit(main())
