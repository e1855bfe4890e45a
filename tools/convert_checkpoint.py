"""megatron_iiet.commands.convert_checkpoint as a script; also installed as `iiet-convert-checkpoint`."""

import sys

# tests import build_parser from here
from megatron_iiet.commands.convert_checkpoint import build_parser, main  # noqa: F401

if __name__ == "__main__":  # the guard matters: dist_checkpointing's writer re-imports __main__
    sys.exit(main())
