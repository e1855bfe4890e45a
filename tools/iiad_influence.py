"""megatron_iiet.commands.iiad_influence as a script; also installed as `iiet-iiad-influence`."""

import sys

from megatron_iiet.commands.iiad_influence import main

if __name__ == "__main__":  # the guard matters: dist_checkpointing's reader re-imports __main__
    sys.exit(main())
