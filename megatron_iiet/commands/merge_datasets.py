"""Merge indexed datasets made with one tokenizer into one, streaming (bounded memory).

Example:
  python tools/merge_datasets.py --input out/data/corpus_shard00000 out/data/corpus_shard00001 --output-prefix out/data/all

An existing output dataset is replaced only with --overwrite; an input is never the output.
"""

from __future__ import annotations

import argparse

from megatron_iiet.cli import fail


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, help="dataset prefixes, in order")
    parser.add_argument("--output-prefix", required=True)
    parser.add_argument("--overwrite", action="store_true", help="replace an existing dataset at --output-prefix (never an input)")
    args = parser.parse_args(argv)
    from megatron_iiet.data.indexed_io import merge_datasets

    try:
        meta = merge_datasets(args.input, args.output_prefix, overwrite=args.overwrite)
    except ValueError as error:
        fail(error)
    print(f"merged {len(args.input)} datasets into {args.output_prefix}: {meta['documents']:,} documents, {meta['tokens']:,} tokens")


if __name__ == "__main__":  # python -m megatron_iiet.commands.merge_datasets
    raise SystemExit(main())
