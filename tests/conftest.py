import os
import warnings

import pytest
import torch

# megatron-core warns at import about every optional CUDA extension it does not find.
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")
if os.environ.get("PYTEST_XDIST_WORKER"):  # two workers share the two cores: one thread each
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
else:
    os.environ.setdefault("OMP_NUM_THREADS", "2")


@pytest.fixture
def one_torch_thread():
    """Tiny tensors: one thread avoids oversubscribing the 2 shared cores (directories whose
    tests are all tiny use it for every test)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# Modules whose tests train, convert or evaluate real checkpoints in fresh processes (seconds to
# minutes each). With every `distributed` test they form the `slow` tier, so that
# `scripts/test.sh -m "not slow"` is the quick development run (docs/architecture.md).
SLOW_MODULES = {
    "tests/training/test_checkpoint_faults.py", "tests/training/test_preemption.py",
    "tests/training/test_bad_input.py", "tests/training/test_async_checkpoint.py",
    "tests/training/test_nonfinite.py", "tests/training/test_resume_changed_config.py",
    "tests/training/test_wandb.py", "tests/training/test_deepspeed_pickles.py",
    "tests/training/test_config_values.py", "tests/training/test_data_split.py",
    "tests/training/test_callbacks.py", "tests/training/test_config_resolution.py",
    "tests/sweep/test_launch.py", "tests/sweep/test_step_probe.py",
    "tests/data/test_data_faults.py",
    "tests/data/test_input_cleaning.py", "tests/data/test_stale_data.py",
    "tests/data/test_merge_datasets_tool.py", "tests/slurm/test_slurm_jobs.py",
    "tests/model/test_compile.py", "tests/model/test_iteration_checkpointing.py",
    "tests/eval/test_evaluate_tool.py", "tests/hf/test_hf_release_import.py",
}


# Directories whose tests share an expensive session fixture (checkpoints of every variant, a
# trained run and its export, a SLURM cluster). Under pytest-xdist (scripts/test.sh runs 2
# workers) each is one unit of work, run by one worker, so that its fixtures are built once; any
# other module is a unit of its own.
SHARED_FIXTURE_DIRS = ("tests/convert", "tests/eval", "tests/slurm", "tests/iiad")


def pytest_xdist_make_scheduler(config, log):
    """xdist's per-scope scheduling with the units above. (Its `loadgroup` mode cannot be used:
    pytest-xdist 3.8 marks a group in `item._nodeid`, which pytest 9 no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    class SharedFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return next((d for d in SHARED_FIXTURE_DIRS if module.startswith(d + "/")), module)

    return SharedFixtureScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    root = config.rootpath
    for item in items:
        where = item.path.relative_to(root).as_posix() if item.path.is_relative_to(root) else ""
        if where in SLOW_MODULES or item.get_closest_marker("distributed"):
            item.add_marker(pytest.mark.slow)
