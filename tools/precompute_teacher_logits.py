"""megatron_iiet.commands.precompute_teacher_logits as a script; also installed as `iiet-precompute-teacher-logits`."""

import sys

from megatron_iiet.commands.precompute_teacher_logits import main

if __name__ == "__main__":  # the guard matters: dist_checkpointing's reader re-imports __main__
    sys.exit(main())
