"""Import an IIET/PCformer checkpoint in the authors' released layout into this project's HF format.

    python tools/import_release.py RELEASE_DIR OUT_DIR [--architecture NAME]
                                   [--iterations 3 | --iterations 3,2,1,0,...]
                                   [--dtype float32|bfloat16|float16] [--force]

RELEASE_DIR: a LLaMA-style folder (config.json + model.safetensors / pytorch_model.bin, sharded or
not) with the extra history / PCformer / gate tensors. The architecture is read from the tensors
where they fit only one (iiet history form, pcformer_rk2, pcformer_rk4, ode_rk2_gated). A plain
LLaMA's tensors fit vanilla, ode_rk2 and ode_rk4 alike, so such a folder needs --architecture
(unless its config.json names the architecture, as ours do): without it the import is refused
(exit 2), and an --architecture the tensors contradict (iiet without history tensors,
ode_rk2_gated without gates) is refused too. OUT_DIR is written atomically and loads with
AutoModelForCausalLM.from_pretrained(OUT_DIR, trust_remote_code=True). Name mapping: docs/hf.md.
"""

import argparse
from pathlib import Path

import torch

from megatron_iiet.cli import fail, parse_iterations
from megatron_iiet.hf.configuration_iiet import architecture_names
from megatron_iiet.errors import OperatorError
from megatron_iiet.hf.release_import import import_release

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("release_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--architecture", choices=architecture_names(), default=None,
                        help="the model's architecture, needed where the tensors fit several "
                             "(a plain LLaMA: vanilla, ode_rk2, ode_rk4); checked against them")
    parser.add_argument("--iterations", type=parse_iterations, default=None,
                        help="IIET iterations per layer (default 3 each, as released)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="dtype of the written weights (default: that of the release's embedding)")
    parser.add_argument("--max-shard-size", default="5GB")
    parser.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        out = import_release(
            args.release_dir,
            args.out_dir,
            iterations=args.iterations,
            architecture=args.architecture,
            force=args.force,
            dtype=DTYPES.get(args.dtype),
            max_shard_size=args.max_shard_size,
        )
    except OperatorError as err:  # a bad release folder, or an output it must not replace
        fail(err)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":  # python -m megatron_iiet.commands.import_release
    raise SystemExit(main())
