"""megatron_iiet.commands.compare_runs as a script; also installed as `iiet-compare-runs`."""

import sys

from megatron_iiet.commands.compare_runs import main

if __name__ == "__main__":
    sys.exit(main())
