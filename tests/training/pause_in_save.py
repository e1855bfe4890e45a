"""pretrain_iiet.py with the first checkpoint commit held open, so a test can send a signal (or
kill the job) while a checkpoint is half written: ``python pause_in_save.py MARKER SECONDS ARGS``.

The pause is patched in here, not kept in the library: rank 0 writes MARKER (the partial
directory's path) when every rank has written its files, then waits SECONDS before committing.
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_iiet.training.signals import protect_spawned_helper  # noqa: E402

protect_spawned_helper(__name__)  # as pretrain_iiet.py does


def _install(marker: Path, seconds: float) -> None:
    from megatron_iiet.training.checkpointing import CheckpointManager

    publish = CheckpointManager._publish

    def paused(self, meta, partial, final, *rest):
        if not marker.exists():
            marker.write_text(str(partial))
            time.sleep(seconds)
        return publish(self, meta, partial, final, *rest)

    CheckpointManager._publish = paused


if __name__ == "__main__":  # dist_checkpointing's helper processes re-import __main__
    marker, seconds = Path(sys.argv[1]), float(sys.argv[2])
    _install(marker, seconds)
    import pretrain_iiet

    sys.exit(pretrain_iiet.main(sys.argv[3:]))
