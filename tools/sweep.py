"""megatron_iiet.commands.sweep as a script; also installed as `iiet-sweep`."""

import sys

from megatron_iiet.commands.sweep import main

if __name__ == "__main__":  # the guard matters: dist_checkpointing's reader re-imports __main__
    sys.exit(main())
