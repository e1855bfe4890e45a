"""Bad input is reported in one line, with exit code 2, before any training step."""

import shutil
from pathlib import Path

import pytest

from megatron_iiet.data.prepare import prepare_builtin_corpus
from tests.training.conftest import base_overrides, check_ok, launch, records


def _fails_before_training(proc, log_dir, *needles):
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    message = proc.stderr
    for needle in needles:
        assert needle in message, message[-2000:]
    assert not records(log_dir, "train"), "a training step ran"


def test_wrong_data_path(tiny_data, tmp_path):
    log = tmp_path / "run"
    proc = launch(base_overrides(tiny_data, log, **{"data.train": str(tmp_path / "nope")}))
    _fails_before_training(proc, log, "error:", "nope")


def test_unknown_config_key(tiny_data, tmp_path):
    proc = launch(base_overrides(tiny_data, tmp_path) + ["optimizer.learning_rate=1"])
    _fails_before_training(proc, tmp_path, "optimizer.learning_rate", "unknown key")


def test_tokenizer_mismatch_between_data_and_config(tiny_data, tmp_path):
    other = prepare_builtin_corpus(str(tmp_path / "other"), vocab_size=384, corpus_size="128KB")
    log = tmp_path / "run"
    proc = launch(base_overrides(tiny_data, log, **{"data.tokenizer": other.tokenizer_model}))
    _fails_before_training(proc, log, "error:", "tokenizer")


def test_checkpoint_of_another_architecture(tiny_data, tmp_path):
    vanilla = tmp_path / "vanilla"
    check_ok(launch(base_overrides(tiny_data, vanilla, **{
        "model.architecture": "vanilla", "schedule.train_steps": 3})))
    log = tmp_path / "iiet"
    proc = launch(base_overrides(tiny_data, log, **{
        "checkpoint.load": str(vanilla / "checkpoints")}))
    _fails_before_training(proc, log, "another architecture", "architecture: checkpoint 'vanilla'")


def test_mixed_precision_megatron_engine_needs_cuda(tiny_data, tmp_path):
    import torch

    if torch.cuda.is_available():
        import pytest

        pytest.skip("CUDA present: the megatron engine supports bf16 here")
    proc = launch(base_overrides(tiny_data, tmp_path, **{"parallel.precision": "bf16"}))
    _fails_before_training(proc, tmp_path, "parallel.precision", "deepspeed")


@pytest.mark.parametrize("kind", ["bug", "bad_input"])
def test_only_operator_errors_lose_their_traceback(tiny_data, tmp_path, kind):
    """A ValueError from inside the build (a bug in our code, torch or megatron) keeps its
    traceback; an input check's BadInput is one line. Neither leaves the run lock behind."""
    from megatron_iiet.locks import DIRECTORY_LOCK
    from tests.training.faults import one_line_error

    log = tmp_path / "run"
    entry = [str(Path(__file__).with_name("raise_in_build.py")), kind]
    proc = launch(base_overrides(tiny_data, log), entry=entry)
    if kind == "bug":
        assert proc.returncode == 1, proc.stderr[-3000:]
        assert "Traceback" in proc.stderr and "ValueError: simulated bug" in proc.stderr
        assert "error: simulated bug" not in proc.stderr
    else:
        one_line_error(proc, "parallel.engine: simulated input check")
    assert not records(log, "train") and not (log / DIRECTORY_LOCK).exists()
