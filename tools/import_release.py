"""megatron_iiet.commands.import_release as a script; also installed as `iiet-import-release`."""

import sys

from megatron_iiet.commands.import_release import main

if __name__ == "__main__":
    sys.exit(main())
