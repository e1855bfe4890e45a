import os
import warnings

import pytest
import torch

# megatron-core warns at import about every optional CUDA extension it does not find.
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")
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
    "tests/sweep/test_launch.py", "tests/data/test_data_faults.py",
    "tests/data/test_input_cleaning.py", "tests/data/test_stale_data.py",
    "tests/data/test_merge_datasets_tool.py", "tests/slurm/test_slurm_jobs.py",
    "tests/model/test_compile.py", "tests/model/test_iteration_checkpointing.py",
    "tests/eval/test_evaluate_tool.py", "tests/hf/test_hf_release_import.py",
}


def pytest_collection_modifyitems(config, items):
    root = config.rootpath
    for item in items:
        where = item.path.relative_to(root).as_posix() if item.path.is_relative_to(root) else ""
        if where in SLOW_MODULES or item.get_closest_marker("distributed"):
            item.add_marker(pytest.mark.slow)
