"""Tokenize raw text into megatron-core indexed datasets (.bin/.idx + .meta.json), streaming,
with several worker processes, optional shards, resume and a streaming merge.

Inputs: jsonl/json, txt, parquet, csv, arrow files, globs, directories, or builtin:python-stdlib.
Re-running with the same arguments resumes: finished shards are kept, a half-written one is redone.
One run per output prefix at a time (lock PREFIX.lock); an input edited since the last run is refused
unless --overwrite.

Example:
  python tools/preprocess_data.py --input data/*.jsonl --tokenizer out/tok/tokenizer.model \\
      --output-prefix out/data/corpus --workers 2 --shard-size 100M --merge
"""

from __future__ import annotations

import argparse

from megatron_iiet.cli import fail
from megatron_iiet.data.bpe_cache import DEFAULT_MAX_ENTRIES


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, help="files, globs, directories or builtin:python-stdlib[:SIZE]")
    parser.add_argument("--tokenizer", required=True, help="sentencepiece .model file or HF tokenizer directory")
    parser.add_argument("--output-prefix", required=True, help="dataset path prefix (writes PREFIX.bin/.idx/.meta.json)")
    parser.add_argument("--text-key", default="text", help="field holding the text (jsonl/parquet/csv/arrow)")
    parser.add_argument("--text-unit", choices=["document", "paragraph", "line"], default="document", help="document unit of .txt files")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes (0 = tokenize in the main process)")
    parser.add_argument("--shard-size", default=None, help="tokens per shard, e.g. 50M (shards: PREFIX_shardNNNNN)")
    parser.add_argument("--merge", action="store_true", help="merge the shards into PREFIX at the end")
    parser.add_argument("--keep-shards", action="store_true", help="keep shard files after --merge")
    parser.add_argument("--dtype", default=None, help="token dtype (default: smallest that fits the vocabulary)")
    parser.add_argument("--no-eod", action="store_true", help="do not append EOD after each document")
    parser.add_argument("--batch-documents", type=int, default=512, help="documents per worker task")
    parser.add_argument("--segment-cache-entries", type=int, default=DEFAULT_MAX_ENTRIES,
                        help="segments (words, punctuation, ...) memoised per worker (~40 bytes each; same output at any size)")
    parser.add_argument("--no-segment-cache", action="store_true",
                        help="encode every document with sentencepiece directly (same output, slower)")
    parser.add_argument("--hf-reader", action="store_true", help="read .jsonl/.txt through HF datasets too (same rows, slower start)")
    parser.add_argument("--strip", choices=["gutenberg"], default=None,
                        help="clean each document first: gutenberg keeps the book between Project Gutenberg's "
                             "START / END lines (a byte-order mark is always dropped)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace output of an earlier run with other arguments or inputs edited since")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def parse_count(text: str | None) -> int | None:
    if text is None:
        return None
    units = {"K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    text = text.strip().upper()
    scale = units.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in units else text
    try:
        return int(float(number) * scale)
    except ValueError:
        raise ValueError(f"--shard-size {text!r}: expected a token count such as 1000000 or 50M") from None


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    from megatron_iiet.data.preprocess import PreprocessConfig, run_preprocess

    try:
        if args.merge and args.shard_size is None:
            raise ValueError("--merge needs --shard-size")
        config = PreprocessConfig(
            inputs=tuple(args.input), tokenizer=args.tokenizer, output_prefix=args.output_prefix,
            text_key=args.text_key, text_unit=args.text_unit, workers=args.workers,
            shard_size=parse_count(args.shard_size), merge=args.merge, keep_shards=args.keep_shards,
            dtype=args.dtype, append_eod=not args.no_eod, batch_documents=args.batch_documents,
            segment_cache_entries=0 if args.no_segment_cache else args.segment_cache_entries, hf_reader=args.hf_reader,
            strip=args.strip, overwrite=args.overwrite, progress=not args.no_progress,
        )
        summary = run_preprocess(config)
    except ValueError as error:
        fail(error)
    if summary.already_complete:
        print(f"already complete: {summary.outputs[0]} ({summary.documents:,} documents, {summary.tokens:,} tokens)")
        return
    rate = summary.seconds and summary.input_bytes / summary.seconds / 2**20
    print("summary")
    print(f"  documents written   {summary.documents:,}")
    print(f"  tokens              {summary.tokens:,}")
    print(f"  empty documents     {summary.empty_documents:,} (not written)")
    print(f"  skipped (null text) {summary.skipped_documents:,}")
    print(f"  shards resumed      {summary.resumed_shards}")
    print(f"  time                {summary.seconds:.1f} s ({rate:.1f} MiB/s of text this run)")
    print(f"  outputs             {', '.join(summary.outputs) if len(summary.outputs) <= 4 else f'{len(summary.outputs)} shards: {summary.outputs[0]} ...'}")


if __name__ == "__main__":  # python -m megatron_iiet.commands.preprocess_data
    raise SystemExit(main())
