"""megatron_iiet.commands.evaluate as a script; also installed as `iiet-evaluate`."""

import sys

from megatron_iiet.commands.evaluate import main

if __name__ == "__main__":  # the guard matters: dist_checkpointing's reader re-imports __main__
    sys.exit(main())
