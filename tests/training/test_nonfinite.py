"""Non-finite losses: the update is skipped and counted; too many stop the run."""

import pytest

from megatron_iiet.distributed import spawn_local
from tests.training.conftest import base_overrides, launch, records
from tests.workers import nonfinite_steps_are_skipped


@pytest.mark.parametrize("engine", ["megatron", "deepspeed"])
def test_nan_step_changes_nothing(engine):
    r = spawn_local(nonfinite_steps_are_skipped, 1, engine_name=engine)[0]
    assert r["poisoned_skipped"] and r["unchanged"], r
    assert not r["healthy_skipped"] and r["healthy_changed"] and r["healthy_loss_finite"], r


def test_run_stops_after_too_many_skipped_steps(tiny_data, tmp_path):
    # weights ~1e30 overflow to inf/NaN on every step
    proc = launch(base_overrides(tiny_data, tmp_path, **{
        "model.init_method_std": 1e30, "logging.max_skipped_steps": 2,
        "schedule.train_steps": 10}))
    assert proc.returncode != 0
    assert "non-finite loss" in proc.stderr + proc.stdout
    steps = records(tmp_path, "train")
    assert [r["skipped_steps"] for r in steps] == [1, 2, 3]
    assert not (tmp_path / "checkpoints" / "latest").exists()
