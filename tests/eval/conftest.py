"""Session fixtures of the evaluation tests: a tiny IIET trained for a few steps at TP=2 (with
in-loop task evaluation when the task data is present), and its HF export."""

import os
import shutil
from pathlib import Path

import pytest

from tests.forked import run_script

from tests.training.conftest import base_overrides, check_ok, launch

REPO = Path(__file__).resolve().parents[2]
SEQ = 64
TRAIN_STEPS = 8
TASKS_INTERVAL = 4
IN_LOOP_TASKS = "[lambada_openai,piqa]"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def task_data_dir():
    from megatron_iiet.eval.tasks import default_data_dir

    return default_data_dir()


def require_task_data():
    """The shared task files, or a skip saying so (CI has them: there a missing folder fails)."""
    found = task_data_dir()
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true but the task data (../shared/data) is missing")
        pytest.skip("task data not found: ../shared/data beside the repository, or pass --data-dir / set $IIET_SHARED_DATA")
    return found


def run_overrides(data, log_dir, **extra):
    values = {"data.seq_length": SEQ, "schedule.train_steps": TRAIN_STEPS,
              "parallel.tensor": 2, "checkpoint.save_interval": TASKS_INTERVAL,
              "optimizer.lr": 1e-2, "logging.tensorboard": True, "logging.log_interval": 1}
    if task_data_dir() is not None:
        values.update({"eval.tasks": IN_LOOP_TASKS, "eval.tasks_interval": TASKS_INTERVAL,
                       "eval.tasks_limit": 6})
    values.update(extra)
    return base_overrides(data, log_dir, **values)


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """(log dir, checkpoint root, data) of a TP=2 tiny IIET run of TRAIN_STEPS steps."""
    from megatron_iiet.data.prepare import prepare_builtin_corpus

    data = prepare_builtin_corpus(str(tmp_path_factory.mktemp("eval_data")), vocab_size=512,
                                  corpus_size="512KB")
    log_dir = tmp_path_factory.mktemp("eval_run") / "run"
    check_ok(launch(run_overrides(data, log_dir), nproc=2))
    return log_dir, log_dir / "checkpoints", data


@pytest.fixture(scope="session")
def exported(trained, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval_export") / "hf"
    proc = run_script(REPO / "tools" / "convert_checkpoint.py", ["megatron-to-hf", trained[1], out],
                      cwd=REPO, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def copy_run_until(trained, step: int, dst: Path) -> Path:
    """A new run directory holding the trained run's checkpoint of ``step`` only."""
    from megatron_iiet.training.checkpoint_index import checkpoint_name

    name = checkpoint_name(step)
    ckpt = dst / "checkpoints"
    ckpt.mkdir(parents=True)
    shutil.copytree(trained[1] / name, ckpt / name)
    (ckpt / "latest").write_text(name)
    return dst


@pytest.fixture(autouse=True)
def _one_torch_thread(one_torch_thread):
    """Tiny tensors everywhere."""
