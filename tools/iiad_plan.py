"""megatron_iiet.commands.iiad_plan as a script; also installed as `iiet-iiad-plan`."""

import sys

from megatron_iiet.commands.iiad_plan import main

if __name__ == "__main__":
    sys.exit(main())
