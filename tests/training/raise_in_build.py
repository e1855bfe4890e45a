"""pretrain_iiet.py with ``build_engine`` raising, as a library bug or an input check would:
``python raise_in_build.py bug|bad_input ARGS``. Patched in here, not kept in the library: no
real input makes torch or megatron raise on demand."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_iiet.training.signals import protect_spawned_helper  # noqa: E402

protect_spawned_helper(__name__)  # as pretrain_iiet.py does


def _install(kind: str) -> None:
    from megatron_iiet.errors import BadInput
    from megatron_iiet.training import engines

    def build_engine(*_args, **_kwargs):
        if kind == "bug":
            raise ValueError("simulated bug inside a library call")
        raise BadInput("parallel.engine: simulated input check")

    engines.build_engine = build_engine


if __name__ == "__main__":
    _install(sys.argv[1])
    import pretrain_iiet

    sys.exit(pretrain_iiet.main(sys.argv[2:]))
