"""Train a sentencepiece tokenizer (BPE or unigram) and write tokenizer.model plus the Hugging
Face tokenizer files for the same vocabulary.

Example:
  python tools/train_tokenizer.py --input builtin:python-stdlib:4MB --output-dir out/tok --vocab-size 4096
  python tools/train_tokenizer.py --input data/*.jsonl --text-key content --output-dir out/tok
"""

from __future__ import annotations

import argparse
import time

from megatron_iiet.cli import fail


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, help="files, globs, directories or builtin:python-stdlib[:SIZE]")
    parser.add_argument("--output-dir", required=True, help="where tokenizer.model and the HF files go")
    parser.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--no-byte-fallback", action="store_true", help="map unknown characters to <unk> instead of bytes")
    parser.add_argument("--character-coverage", type=float, default=0.9995)
    parser.add_argument("--user-defined-symbols", nargs="*", default=[], help="pieces always kept whole")
    parser.add_argument("--control-symbols", nargs="*", default=[], help="extra special tokens (never produced from text)")
    parser.add_argument("--input-sentence-size", type=int, default=1_000_000, help="text chunks sampled for training (0 = all)")
    parser.add_argument("--normalization", default="identity", help="sentencepiece normalization rule (identity, nmt_nfkc, nfkc, ...)")
    parser.add_argument("--add-dummy-prefix", action="store_true", help="prepend a space to every input, like Llama")
    parser.add_argument("--text-key", default="text", help="field holding the text (jsonl/parquet/csv/arrow)")
    parser.add_argument("--text-unit", choices=["document", "paragraph", "line"], default="document", help="document unit of .txt files")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--strip", choices=["gutenberg"], default=None,
                        help="clean each document first: gutenberg keeps the book between Project Gutenberg's "
                             "START / END lines (a byte-order mark is always dropped)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing tokenizer.model in --output-dir")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    from megatron_iiet.data.tokenizer_training import TokenizerTrainingConfig, train_tokenizer

    options = dict(
        inputs=tuple(args.input), output_dir=args.output_dir, model_type=args.model_type, vocab_size=args.vocab_size,
        byte_fallback=not args.no_byte_fallback, character_coverage=args.character_coverage,
        user_defined_symbols=tuple(args.user_defined_symbols), control_symbols=tuple(args.control_symbols),
        input_sentence_size=args.input_sentence_size, normalization=args.normalization,
        add_dummy_prefix=args.add_dummy_prefix, text_key=args.text_key, text_unit=args.text_unit,
        strip=args.strip, overwrite=args.overwrite,
    )
    if args.threads:
        options["threads"] = args.threads
    started = time.perf_counter()
    try:
        info = train_tokenizer(TokenizerTrainingConfig(**options))
    except ValueError as error:
        fail(error)
    print(f"trained {args.model_type} tokenizer, vocab {info['vocab_size']}, in {time.perf_counter() - started:.1f} s")
    print(f"  sentencepiece model: {info['model']}")
    print(f"  HF tokenizer dir:    {info['hf_dir']}")
    print(f"  fingerprint:         {info['fingerprint']}")


if __name__ == "__main__":  # python -m megatron_iiet.commands.train_tokenizer
    raise SystemExit(main())
